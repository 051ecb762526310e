"""The hook program's probe (`cdi_hook`) and what the driver files make of it, with small shell
scripts in place of NVIDIA's program: its answers in urfave/cli's v2 and v3 formats, and the ways
a program can be unusable (missing, failing, silent, hanging)."""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

import pytest

from dra_gpu.plugin.cdi_hook import (
    CdiHookError,
    argv_prefix,
    parse_subcommands,
    parse_version,
    probe,
    probe_for_driver_files,
)
from dra_gpu.plugin.driver_files import DriverFiles, container_edits
from tests.driver_root import DEB, make_root
from tests.fake_cdi_hook import HELP_V2, HELP_V3, fake_hook

V = "570.133.20"


def test_reads_the_version_and_the_hooks_of_both_help_formats(tmp_path: Path) -> None:
    new = probe(str(fake_hook(tmp_path / "new", HELP_V3, "NVIDIA CDI Hook version 1.20.2\ncommit: module")))
    assert new.version == "1.20.2"
    assert new.subcommands == {
        "update-ldcache",
        "create-symlinks",
        "enable-cuda-compat",
        "disable-device-node-modification",
        "apply-cuda-memory-limits",
    }
    assert new.missing_optional() == []
    old = probe(str(fake_hook(tmp_path / "old", HELP_V2)))
    assert old.version == "1.17.8"
    assert old.subcommands == {"update-ldcache", "create-symlinks", "chmod", "enable-cuda-compat"}
    assert not old.supports("disable-device-node-modification")
    assert old.missing_optional() == ["disable-device-node-modification"]


def test_parsing_aliases_and_text_outside_the_commands() -> None:
    assert parse_version("NVIDIA Container Toolkit CLI version v1.18.0\ncommit: abc") == "1.18.0"
    assert parse_version("no version here") is None
    text = "COMMANDS:\n   create-symlinks, cs  make links\n   update-ldcache\n\nOPTIONS:\n   --x  y\n"
    assert parse_subcommands(text) == {"create-symlinks", "cs", "update-ldcache"}
    assert parse_subcommands("USAGE:\n   hook [command]\n") == frozenset()


def test_nvidia_ctk_is_asked_for_its_hook_command(tmp_path: Path) -> None:
    ctk = probe(
        str(fake_hook(tmp_path, HELP_V3, "NVIDIA Container Toolkit CLI version 1.20.2", "nvidia-ctk"))
    )
    assert ctk.supports("disable-device-node-modification")
    assert argv_prefix(ctk.path) == ["nvidia-ctk", "hook"]


def test_runs_with_a_small_fixed_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NVIDIA_CTK_DEBUG", "true")
    hook = fake_hook(tmp_path, HELP_V2, body='[ -n "$NVIDIA_CTK_DEBUG" ] && { echo leaked >&2; exit 9; }')
    assert probe(str(hook)).version == "1.17.8"


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda d: str(d / "nowhere" / "nvidia-cdi-hook"), "no such file"),
        (lambda d: "nvidia-cdi-hook", "not an absolute path"),
        (lambda d: str(fake_hook(d, HELP_V2, body="echo broken >&2; exit 4")), "exited 4: broken"),
        (lambda d: str(fake_hook(d, HELP_V2, version="NVIDIA CDI Hook")), "printed no version"),
        (lambda d: str(fake_hook(d, "USAGE:\n   hook\n")), "listed no hook"),
    ],
    ids=["missing", "relative", "fails", "no-version", "no-commands"],
)
def test_an_unusable_program_is_an_error_naming_its_path(tmp_path: Path, make, words: str) -> None:  # type: ignore[no-untyped-def]
    path = make(tmp_path)
    with pytest.raises(CdiHookError, match=words) as err:
        probe(path)
    assert path in str(err.value)


def test_one_that_cannot_be_executed_is_an_error(tmp_path: Path) -> None:
    hook = fake_hook(tmp_path, HELP_V2)
    hook.chmod(0o644)
    if os.access(hook, os.X_OK):  # root may execute anything with an x bit; none is left here
        pytest.skip("this user can execute a file without an execute bit")
    with pytest.raises(CdiHookError, match=f"{hook}: cannot run"):
        probe(str(hook))


def test_a_hanging_program_is_stopped_with_its_children(tmp_path: Path) -> None:
    marker = tmp_path / "child-still-running"
    # The child outlives the shell unless its whole process group is killed.
    hook = fake_hook(tmp_path, HELP_V2, body=f"(sleep 3; touch {marker}) & sleep 30")
    start = time.monotonic()
    with pytest.raises(CdiHookError, match=r"did not finish within 0.5 s"):
        probe(str(hook), timeout=0.5)
    assert time.monotonic() - start < 2.5
    time.sleep(3.5)
    assert not marker.exists(), "the hung program's child was left running"


def test_a_program_without_a_needed_hook_is_refused(tmp_path: Path) -> None:
    no_ldcache = HELP_V2.replace(
        "   update-ldcache      Update ldcache in a container by running ldconfig\n", ""
    )
    with pytest.raises(CdiHookError, match="has no update-ldcache hook") as err:
        probe_for_driver_files(str(fake_hook(tmp_path, no_ldcache)))
    assert "version 1.17.8" in str(err.value)


# ---------------------------------------------------------------- the driver files' spec

needs_cc = pytest.mark.skipif(
    shutil.which("cc") is None, reason="the driver root's libraries need a C compiler"
)


def hook_names(edits: dict) -> list[str]:  # type: ignore[type-arg]
    return [h["args"][1] for h in edits.get("hooks", [])]


@needs_cc
def test_an_older_program_gets_only_the_hooks_it_has_and_the_start_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = make_root(tmp_path / "root", V)
    old = fake_hook(tmp_path / "old", HELP_V2)
    with caplog.at_level(logging.INFO, logger="dra_gpu.plugin.driver_files"):
        files = DriverFiles(root, V, hook_path=str(old))
    assert files.hook is not None and files.hook.version == "1.17.8"
    assert hook_names(files.edits()) == ["create-symlinks", "enable-cuda-compat", "update-ldcache"]
    (said,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"CDI hook {old} version 1.17.8 has no disable-device-node-modification" in said
    assert "left out of every claim's spec" in said

    new = fake_hook(tmp_path / "new", HELP_V3, "NVIDIA CDI Hook version 1.20.2")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dra_gpu.plugin.driver_files"):
        files = DriverFiles(root, V, hook_path=str(new))
    assert hook_names(files.edits()) == [
        "create-symlinks",
        "enable-cuda-compat",
        "update-ldcache",
        "disable-device-node-modification",
    ]
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


@needs_cc
def test_an_unusable_program_stops_the_start(tmp_path: Path) -> None:
    root = make_root(tmp_path / "root", V)
    hook = fake_hook(tmp_path, HELP_V2, body="exit 1")
    with pytest.raises(CdiHookError, match=str(hook)):
        DriverFiles(root, V, hook_path=str(hook))


@needs_cc
def test_without_create_symlinks_the_links_are_mounted_instead(tmp_path: Path) -> None:
    found_root = make_root(tmp_path / "root", V)
    from dra_gpu.discovery.driver_install import discover_installation

    found = discover_installation(found_root, V)
    edits = container_edits(found, "/usr/bin/nvidia-cdi-hook", frozenset({"update-ldcache"}))
    assert hook_names(edits) == ["update-ldcache"]
    mounted = {m["containerPath"] for m in edits["mounts"]}
    assert f"/{DEB}/libcuda.so.1" in mounted
