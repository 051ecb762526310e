"""A skipped test fails the run unless declared expected (e2e/harness/skips.py): the declarations,
the summary that names every skip, and pytest runs of a small test dir that uses the gate."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from e2e.harness import skips
from e2e.harness.skips import ENV, DeclarationError, Expected, Skip, judge, parse_env, parse_file

REPO = Path(__file__).resolve().parent.parent


def test_file_declarations_need_a_reason_and_name_their_line() -> None:
    text = "# a comment\n\ne2e/tests/*   not root here\ntests/test_a.py::*\n"
    with pytest.raises(DeclarationError, match=r"^skips.txt:4: pattern 'tests/test_a.py::\*' has no reason"):
        parse_file(text, "skips.txt")
    assert parse_file(text.rsplit("\n", 2)[0], "skips.txt") == [
        Expected("e2e/tests/*", "not root here", "skips.txt:3")
    ]


def test_env_declarations_split_on_semicolons_and_lines_with_a_default_reason() -> None:
    got = parse_env(" e2e/* not root ;tests/test_a.py::test_b\n tests/x.py::* no cc; ")
    assert [(e.pattern, e.reason) for e in got] == [
        ("e2e/*", "not root"),
        ("tests/test_a.py::test_b", skips.ENV_REASON),
        ("tests/x.py::*", "no cc"),
    ]
    assert parse_env("") == []


def test_the_repository_declarations_parse_and_name_a_reason_each() -> None:
    """A line of e2e/expected-skips.txt without a reason would stop every run with a usage error."""
    for e in skips.declared(skips.FILE, {}):
        assert e.reason and e.source.startswith("e2e/expected-skips.txt:"), e


def test_a_skip_is_declared_by_the_first_pattern_that_matches_its_whole_id() -> None:
    expected = [
        Expected("tests/test_a.py::test_b", "one test", "f:1"),
        Expected("e2e/*", "not root", "f:2"),
        Expected("tests/test_a.py::*", "the file", "f:3"),
        Expected("tests/*_gpu.py::*", "no GPU", "f:4"),
    ]
    ids = [
        "tests/test_a.py::test_b",  # the first entry, not the third
        "tests/test_a.py::test_c[full]",  # the third
        "e2e/tests/test_kind.py::test_kind",  # `*` crosses `/`
        "tests/test_a.py",  # a file skipped at collection: `::*` needs a test
        "E2E/tests/test_x.py::test_y",  # case counts
        "tests/test_ab.py::test_b",  # a pattern is the whole id, not a part of it
        "tests/test_a.py::test_bb",  # ... nor its start: the third
        "tests/plugin/test_real_gpu.py::test_z",  # a glob inside
    ]
    got = judge([Skip(i, "r") for i in ids], expected)
    assert [v.expected.source if v.expected else None for v in got] == [
        "f:1",
        "f:3",
        "f:2",
        None,
        None,
        None,
        "f:3",
        "f:4",
    ]


def test_the_summary_names_every_skipped_test_undeclared_first() -> None:
    exp = Expected("tests/test_a.py::*", "no GPU on CI", "e2e/expected-skips.txt:3")
    verdicts = judge(
        [
            Skip("tests/test_a.py::test_one", "needs a GPU"),
            Skip("tests/test_a.py::test_two[x]", "needs a GPU"),
            Skip("tests/test_b.py::test_three", "needs root"),
            Skip("tests/test_c.py", "no cc"),
        ],
        [exp],
    )
    assert skips.summary_lines(verdicts) == [
        "SKIPPED, NOT DECLARED tests/test_b.py::test_three: needs root",
        "SKIPPED, NOT DECLARED tests/test_c.py: no cc",
        "SKIPPED tests/test_a.py::{test_one, test_two[x]}: needs a GPU"
        " [expected: no GPU on CI (e2e/expected-skips.txt:3)]",
    ]
    message = skips.undeclared_message(verdicts)
    assert message[0].startswith("2 skipped test(s) not declared expected")
    assert ENV in "\n".join(message) and "e2e/expected-skips.txt" in "\n".join(message)
    assert skips.undeclared_message(judge([Skip("tests/test_a.py::test_one", "r")], [exp])) == []


# ------------------------------------------------------------------ pytest runs with the gate

GATED_CONFTEST = f"""
import sys
from pathlib import Path

sys.path.insert(0, {str(REPO / "e2e")!r})
from harness import skips


def pytest_configure(config):
    here = Path(__file__).parent
    skips.register(config, file=here / "expected-skips.txt", base=here)
"""

TESTS = """
import pytest


def test_runs():
    pass


def test_needs_gpu():
    pytest.skip("no GPU here")


@pytest.mark.skipif(True, reason="not root")
def test_needs_root():
    pass


@pytest.mark.xfail(reason="known bug")
def test_known_bug():
    assert False
"""


def run_gated(
    tmp_path: Path, tests: dict[str, str], declared: str = "", env: str | None = None
) -> tuple[int, str]:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # rootdir here, not a parent's config
    (tmp_path / "conftest.py").write_text(GATED_CONFTEST)
    (tmp_path / "expected-skips.txt").write_text(declared)
    for name, text in tests.items():
        (tmp_path / name).write_text(textwrap.dedent(text))
    environ = {k: v for k, v in os.environ.items() if k not in (ENV, "PYTEST_ADDOPTS")}
    if env is not None:
        environ[ENV] = env
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc.returncode, proc.stdout + proc.stderr


def test_an_undeclared_skip_fails_a_passing_run_and_is_named(tmp_path: Path) -> None:
    rc, out = run_gated(tmp_path, {"test_gpu.py": TESTS}, env="test_gpu.py::test_needs_root not root")
    assert rc == 1, out
    assert "SKIPPED, NOT DECLARED test_gpu.py::test_needs_gpu: no GPU here" in out
    assert (
        "SKIPPED test_gpu.py::test_needs_root: not root [expected: not root ($DRA_GPU_EXPECTED_SKIPS)]" in out
    )
    assert "1 skipped test(s) not declared expected" in out
    assert "test_known_bug" not in out.split("skipped:", 1)[1]  # an xfail ran: not a skip
    assert "1 passed, 2 skipped, 1 xfailed" in out


def test_declared_skips_pass_and_are_still_named(tmp_path: Path) -> None:
    declared = "# why\ntest_gpu.py::test_needs_gpu  no GPU on this machine\n"
    rc, out = run_gated(tmp_path, {"test_gpu.py": TESTS}, declared=declared, env="test_gpu.py::*root")
    assert rc == 0, out
    assert "SKIPPED test_gpu.py::test_needs_gpu: no GPU here [expected: no GPU on this machine" in out
    assert "expected-skips.txt:2)]" in out
    assert f"test_gpu.py::test_needs_root: not root [expected: {skips.ENV_REASON}" in out
    assert "not declared" not in out


def test_a_whole_file_skipped_at_collection_fails_unless_declared(tmp_path: Path) -> None:
    """As the e2e tier run as non-root: nothing runs, everything skips."""
    files = {
        "test_cluster.py": """
            import pytest
            pytest.skip("no KUBECONFIG and not root", allow_module_level=True)
            def test_pods(): pass
        """
    }
    rc, out = run_gated(tmp_path, {**files, "test_local.py": "def test_local(): pass\n"})
    assert rc == 1, out
    assert "SKIPPED, NOT DECLARED test_cluster.py: no KUBECONFIG and not root" in out
    (tmp_path / "test_local.py").unlink()
    # Nothing collected but declared skips: pytest's "no tests collected" (5) becomes a pass.
    rc, out = run_gated(tmp_path, files, env="test_cluster.py not root")
    assert rc == 0, out
    assert "SKIPPED test_cluster.py: no KUBECONFIG and not root [expected: not root" in out


def test_a_declaration_without_a_reason_stops_the_run(tmp_path: Path) -> None:
    rc, out = run_gated(tmp_path, {"test_x.py": "def test_x():\n    pass\n"}, declared="test_x.py::*\n")
    assert rc == 4, out  # pytest's usage error: no test ran
    assert "expected-skips.txt:1: pattern 'test_x.py::*' has no reason" in out


def test_a_run_that_already_failed_keeps_its_own_exit_status(tmp_path: Path) -> None:
    tests = """
        import pytest
        def test_a(): pytest.skip("undeclared")
        def test_b(): pytest.exit("stopped", 2)
    """
    rc, out = run_gated(tmp_path, {"test_x.py": tests})
    assert rc == 2, out  # pytest's "interrupted", not the gate's 1
    assert "SKIPPED, NOT DECLARED test_x.py::test_a: undeclared" in out


@pytest.mark.parametrize("target", ["tests/test_expected_skips.py", "e2e/tests/test_real_gpu_check.py"])
def test_both_tiers_register_the_gate(target: str) -> None:
    """The unit tier's and the e2e tier's conftest.py load it (collection only: no test runs)."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--co", "-q", "-p", "no:cacheprovider", "--trace-config", target],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "skips.SkipGate object" in proc.stdout, proc.stdout[-3000:]
