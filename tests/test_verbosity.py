"""Verbosity as klog's -v: the flag's forms before and after the subcommand, its bounds, the
environment variable, the one map from N to a logging level, and which lines each level shows."""

from __future__ import annotations

import argparse
import itertools
import logging
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from dra_gpu import cli
from dra_gpu.common.exit_codes import EXIT_OK, EXIT_USAGE
from dra_gpu.common.log_format import MAX_VERBOSITY, V, verbosity_of

CLASS = """apiVersion: resource.k8s.io/v1
kind: DeviceClass
metadata: {name: gpu.example.com}
spec:
  selectors: [{cel: {expression: 'device.driver == "gpu.dra-gpu.io"'}}]
"""


def parsed(*argv: str) -> int | None:
    return cli._parser(controller_only=True).parse_args(list(argv)).verbosity  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("argv", "level"),
    [
        (["validate", "-f", "x"], None),  # not given: $DRA_GPU_VERBOSITY, else 0
        (["-v", "3", "validate", "-f", "x"], 3),
        (["-v=3", "validate", "-f", "x"], 3),
        (["--v=7", "validate", "-f", "x"], 7),
        (["--v", "7", "validate", "-f", "x"], 7),
        (["--verbosity", "10", "validate", "-f", "x"], 10),
        (["--verbosity=0", "validate", "-f", "x"], 0),
        (["validate", "-f", "x", "-v", "2"], 2),
        (["validate", "-f", "x", "-v=2"], 2),
        (["validate", "-f", "x", "--v=2"], 2),
        (["validate", "-f", "x", "--verbosity", "5"], 5),
        (["-v=2", "validate", "-f", "x", "-v=6"], 6),  # after the command wins
        (["-v=6", "validate", "-f", "x"], 6),  # not given after: the one before stands
        # A bare -v, the debug switch it was (scripts, `dra-gpu -v doctor`): 4.
        (["-v", "validate", "-f", "x"], 4),
        (["validate", "-f", "x", "-v"], 4),
        (["validate", "-v", "-f", "x"], 4),
        (["--verbose", "validate", "-f", "x"], 4),
        (["validate", "-f", "x", "--verbose"], 4),
    ],
)
def test_the_flags_forms(argv: list[str], level: int | None) -> None:
    assert parsed(*argv) == level


def test_the_flag_of_every_node_command_too() -> None:
    args = cli._parser().parse_args(["inventory", "--profile", "hgx-2x4", "-v", "5"])
    assert (args.command, args.verbosity, args.profile) == ("inventory", 5, "hgx-2x4")
    args = cli._parser().parse_args(["-v", "health", "status"])
    assert (args.command, args.verbosity) == ("health", 4)


def test_a_bare_v_is_rewritten_only_where_no_number_follows() -> None:
    assert cli.bare_verbosity(["-v", "explain", "-v", "2", "-v", "--", "-v"]) == [
        "-v=4",
        "explain",
        "-v",
        "2",
        "-v=4",
        "--",
        "-v",
    ]


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["-v=11", "validate", "-f", "x"], "argument -v/--v/--verbosity: '11' is not a verbosity level 0."),
        (["validate", "-f", "x", "--v=-1"], "argument -v/--v/--verbosity: '-1' is not a verbosity level"),
        (["-v", "-1", "validate", "-f", "x"], "'-1' is not a verbosity level 0..10"),
        (["--verbosity", "high", "validate", "-f", "x"], "'high' is not a verbosity level 0..10"),
        (["validate", "-f", "x", "--verbosity=2.5"], "'2.5' is not a verbosity level 0..10"),
        (["-vv", "validate", "-f", "x"], "'v' is not a verbosity level 0..10 (-v=N as klog's; -vv is not"),
    ],
)
def test_a_level_outside_0_to_10_is_a_usage_error_naming_flag_and_value(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == EXIT_USAGE
    assert said in capsys.readouterr().err


def test_the_environment_variable_and_the_flag_over_it() -> None:
    assert cli.resolve_verbosity(None, {}) == 0
    assert cli.resolve_verbosity(None, {"DRA_GPU_VERBOSITY": ""}) == 0
    assert cli.resolve_verbosity(None, {"DRA_GPU_VERBOSITY": " 3 "}) == 3
    assert cli.resolve_verbosity(0, {"DRA_GPU_VERBOSITY": "3"}) == 0
    with pytest.raises(argparse.ArgumentTypeError, match=r"'12' is not a verbosity level 0\.\.10"):
        cli.resolve_verbosity(None, {"DRA_GPU_VERBOSITY": "12"})


def test_a_bad_environment_variable_is_a_usage_error_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "class.yaml").write_text(CLASS)
    monkeypatch.setenv("DRA_GPU_VERBOSITY", "11")
    assert cli.main(["validate", "-f", str(tmp_path / "class.yaml")]) == EXIT_USAGE
    assert "$DRA_GPU_VERBOSITY: '11' is not a verbosity level 0..10" in capsys.readouterr().err
    # The flag wins: the variable is not read.
    assert cli.main(["validate", "-f", str(tmp_path / "class.yaml"), "-v=0"]) == EXIT_OK


def test_the_one_map_from_n_to_a_logging_level() -> None:
    levels = [V(n) for n in range(MAX_VERBOSITY + 1)]
    assert levels[0] == logging.INFO and levels[4] == logging.DEBUG
    assert levels[1:4] == [logging.INFO - 1, logging.INFO - 2, logging.INFO - 3]
    assert levels[5:] == [logging.DEBUG - n for n in range(1, 7)]
    assert all(a > b > logging.NOTSET for a, b in itertools.pairwise(levels))
    assert [verbosity_of(level) for level in levels] == list(range(MAX_VERBOSITY + 1))
    assert verbosity_of(logging.WARNING) == verbosity_of(logging.ERROR) == 0
    assert verbosity_of(15) == 4  # a library's level between debug and info shows as debug does
    assert verbosity_of(1) == MAX_VERBOSITY
    assert logging.getLevelName(V(2)) == "V2" and logging.getLevelName(V(4)) == "DEBUG"
    for bad in (-1, MAX_VERBOSITY + 1):
        with pytest.raises(ValueError, match=r"not 0\.\.10"):
            V(bad)


@pytest.mark.parametrize("threshold", range(MAX_VERBOSITY + 1))
def test_v_n_shows_the_lines_of_n_and_below(threshold: int) -> None:
    log = logging.Logger("dra_gpu.test_verbosity", level=V(threshold))
    shown = [n for n in range(MAX_VERBOSITY + 1) if log.isEnabledFor(V(n))]
    assert shown == list(range(threshold + 1))
    assert log.isEnabledFor(logging.DEBUG) == (threshold >= 4)
    assert log.isEnabledFor(logging.INFO) and log.isEnabledFor(logging.WARNING)


def test_the_libraries_lines_by_verbosity() -> None:
    assert [cli.library_level(n) for n in (1, 3, 4, 9, 10)] == [
        logging.WARNING,
        logging.WARNING,
        logging.INFO,
        logging.INFO,
        logging.NOTSET,  # the root's V(10): everything
    ]


def test_each_kubelet_call_at_v2(caplog: pytest.LogCaptureFixture) -> None:
    from dra_gpu.kubeletplugin import node_service

    response = SimpleNamespace(claims={"a": SimpleNamespace(error=""), "b": SimpleNamespace(error="no")})
    with caplog.at_level(V(3), logger=node_service.__name__):
        node_service._summary("prepare", response, time.perf_counter())
    (rec,) = caplog.records
    assert rec.levelno == V(2) and rec.getMessage().startswith(
        "kubelet call operation=prepare claims=2 failed=1 seconds="
    )
    caplog.clear()
    with caplog.at_level(V(1), logger=node_service.__name__):
        node_service._summary("unprepare", response, time.perf_counter())
    assert not caplog.records
