"""`node/cdi-hook`: doctor reports the hook program's version and hooks, and what a claim's spec
loses with an older one (stand-in programs of tests/fake_cdi_hook.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dra_gpu.cli import main
from dra_gpu.doctor.cdi_hook_check import check_cdi_hook
from dra_gpu.doctor.report import Result, Status
from dra_gpu.doctor.settings import NodeCheckSettings
from tests.fake_cdi_hook import HELP_V2, HELP_V3, fake_hook

NEW = "NVIDIA CDI Hook version 1.20.2\ncommit: module"


def check(tmp: Path, hook: Path | None, memory_shares: bool = False) -> Result:
    settings = NodeCheckSettings(
        node_name="node-a",
        driver="gpu.dra-gpu.io",
        profile=None,
        plugin_dir=tmp / "plugin",
        registry_dir=tmp / "registry",
        cdi_dir=tmp / "cdi",
        dev_root=tmp / "root",
        driver_root=tmp / "driver",
        memory_shares=memory_shares,
        cdi_hook_path=str(hook) if hook else None,
    )
    (result,) = check_cdi_hook(settings)
    return result


def test_a_current_program_is_ok_with_its_version_and_hooks(tmp_path: Path) -> None:
    hook = fake_hook(tmp_path / "new", HELP_V3, NEW)
    result = check(tmp_path, hook, memory_shares=True)
    assert result.status is Status.OK
    assert f"{hook}: version 1.20.2" in result.detail
    assert "disable-device-node-modification" in result.detail and "apply-cuda-memory-limits" in result.detail


def test_an_older_program_warns_what_claims_go_without(tmp_path: Path) -> None:
    result = check(tmp_path, fake_hook(tmp_path / "old", HELP_V2))
    assert result.status is Status.WARN
    assert "version 1.17.8" in result.detail
    assert "left out of claims' specs: without disable-device-node-modification" in result.detail
    assert "1.18.0 or newer" in result.fix


def test_memory_shares_need_the_memory_limits_hook(tmp_path: Path) -> None:
    lacking = HELP_V3.replace("   apply-cuda-memory-limits", "   something-else")
    hook = fake_hook(tmp_path, lacking, NEW)
    assert check(tmp_path, hook).status is Status.OK
    result = check(tmp_path, hook, memory_shares=True)
    assert result.status is Status.WARN
    assert "without apply-cuda-memory-limits memory shares are held only by their MPS daemon" in result.detail


def test_an_unusable_program_fails_naming_its_path(tmp_path: Path) -> None:
    hook = fake_hook(tmp_path, HELP_V2, body="exit 2")
    result = check(tmp_path, hook)
    assert result.status is Status.FAIL
    assert str(hook) in result.detail and "exited 2" in result.detail
    no_ldcache = HELP_V2.replace("   update-ldcache ", "   something-else ")
    result = check(tmp_path, fake_hook(tmp_path / "b", no_ldcache))
    assert result.status is Status.FAIL and "lacks update-ldcache" in result.detail


def test_no_hook_path_is_nothing_to_fix(tmp_path: Path) -> None:
    result = check(tmp_path, None)
    assert result.status is Status.OK and "no --cdi-hook-path" in result.detail


def test_doctor_takes_the_plugins_hook_path_from_its_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    hook = fake_hook(tmp_path / "old", HELP_V2)
    monkeypatch.setenv("NVIDIA_CDI_HOOK_PATH", str(hook))
    argv = ["doctor", "--only", "node", "--profile", "hgx-2x4", "--plugin-dir", str(tmp_path / "p")]
    main([*argv, "--cdi-dir", str(tmp_path / "cdi"), "-o", "json"])
    results = {r["check"]: r for r in json.loads(capsys.readouterr().out)["checks"]}
    assert results["node/cdi-hook"]["status"] == "WARN"
    assert f"{hook}: version 1.17.8" in results["node/cdi-hook"]["detail"]
