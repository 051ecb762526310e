"""The report's table and JSON, exit codes, and `dra-gpu doctor` end to end without a cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dra_gpu.cli import main
from dra_gpu.common.exit_codes import EXIT_INVALID
from dra_gpu.doctor.report import Status, exit_code, fail, guarded, ok, render_json, render_table, skip, warn
from tests.simnode_support import needs_root, needs_toolchain, nvml_h  # noqa: F401 - a fixture


def test_table_has_a_fix_line_under_each_problem() -> None:
    results = [ok("a/one", "fine"), warn("a/two", "meh", "do this"), fail("a/three", "bad", "do that")]
    table = render_table(results)
    lines = table.splitlines()
    assert lines[0].split() == ["CHECK", "STATUS", "DETAIL"]
    assert any("fix: do that" in line for line in lines) and any("fix: do this" in line for line in lines)
    assert lines[-1] == "1 OK, 1 WARN, 1 FAIL, 0 SKIP"
    assert exit_code(results) == 1 and exit_code(results[:2]) == 0


def test_json_report() -> None:
    doc = json.loads(render_json([ok("a", "x"), skip("b", "no NVML")]))
    assert doc["exitCode"] == 0 and doc["summary"]["SKIP"] == 1
    assert doc["checks"][1] == {"check": "b", "status": "SKIP", "detail": "no NVML", "fix": ""}


def test_guarded_turns_an_exception_into_a_fail() -> None:
    def boom() -> list[object]:
        raise KeyError("spec")

    (r,) = guarded("x", boom)  # type: ignore[arg-type]
    assert r.status is Status.FAIL and "KeyError" in r.detail


def test_not_a_gpu_node_and_no_cluster_fails_in_a_few_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    rc = main(["doctor", "--dev-root", str(tmp_path), "-o", "json"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == EXIT_INVALID and doc["exitCode"] == EXIT_INVALID
    assert [c["status"] for c in doc["checks"]] == ["FAIL", "SKIP", "SKIP"]
    assert (
        doc["checks"][-1]["check"] == "cluster/api-server" and "no kubeconfig" in doc["checks"][-1]["detail"]
    )


def test_unreachable_api_server_is_a_fail_without_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1"}}],
                "users": [{"name": "u", "user": {"token": "x"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    rc = main(["doctor", "--only", "cluster", "--kubeconfig", str(kubeconfig), "--timeout", "3"])
    out, err = capsys.readouterr()
    assert rc == 1, out
    assert "cluster/api-server" in out and "FAIL" in out and "Traceback" not in out + err


def test_unusable_kubeconfig_is_skipped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["doctor", "--only", "cluster", "--kubeconfig", str(tmp_path / "missing")])
    out = capsys.readouterr().out
    assert rc == 0 and "SKIP" in out and "no usable kubeconfig" in out


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["doctor", "--only", "everything"])
    assert exc.value.code == 2
    assert main(["doctor", "--timeout", "0"]) == 2


def test_the_plugin_and_the_controller_never_import_doctor() -> None:
    root = Path(__file__).resolve().parents[2] / "dra_gpu"
    for package in ("plugin", "controller"):
        for path in (root / package).rglob("*.py"):
            assert "dra_gpu.doctor" not in path.read_text(encoding="utf-8"), path


@needs_toolchain
@needs_root
@pytest.mark.usefixtures("nvml_h")
def test_doctor_on_a_simulated_node_runs_its_simulated_driver(tmp_path: Path) -> None:
    """`dra-gpu doctor --profile` as a user runs it: NVML is the simulated driver's library; the
    device nodes and MIG capability files are those the plugin's node has under --dev-root."""
    from simnode.node import prepare_simulated_node

    dev_root = tmp_path / "plugin" / "simulated-root"
    node = prepare_simulated_node("dgx-a100-mig", dev_root)  # what the plugin does at start
    env = {**os.environ, **node.env()}
    probe = [sys.executable, "-m", "dra_gpu.node.nvml_probe", "--driver-root", str(node.driver_root)]
    nvml = subprocess.run(probe, env=env, capture_output=True, text=True, timeout=60)
    assert nvml.returncode == 0 and "nvmlDeviceGetCount = 8" in nvml.stdout, nvml.stderr
    out = subprocess.run(
        [sys.executable, "-m", "dra_gpu.cli", "doctor", "--only", "node", "--profile", "dgx-a100-mig",
         "--plugin-dir", str(tmp_path / "plugin"), "--cdi-dir", str(tmp_path / "cdi"), "-o", "json"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    results = {r["check"]: r for r in json.loads(out.stdout)["checks"]}
    assert results["node/nvml"]["status"] == "OK", results["node/nvml"]
    assert "8 GPUs, 10 MIG devices, driver 570.124.06" in results["node/nvml"]["detail"]
    assert results["node/device-nodes"]["status"] == "OK", results["node/device-nodes"]
    assert "MIG capabilities of 10 MIG devices" in results["node/device-nodes"]["detail"]
    assert results["node/driver-files"]["status"] == "OK", results["node/driver-files"]
    (dev_root / "proc/driver/nvidia/capabilities/gpu0/mig/gi1/access").unlink()
    again = subprocess.run(out.args, capture_output=True, text=True, timeout=120)
    results = {r["check"]: r for r in json.loads(again.stdout)["checks"]}
    assert results["node/device-nodes"]["status"] == "FAIL"
