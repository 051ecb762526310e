"""The plugin SIGKILLed at each failpoint (in a forked child, so the kill is real), then started
again over the same directories and GPUs, with the kubelet's retry: the claim is prepared once,
no CDI spec, record, MPS daemon, compute mode or MIG instance is left behind, the CDI and plugin
directories hold only the live claim's spec and the checkpoint (a kill between a write's temp file
and its rename leaves the temp file: the start removes it), and unprepare leaves nothing. The
same cases run against the real cluster in e2e/tests/test_faults.py."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from dra_gpu.common import failpoints
from dra_gpu.plugin.checkpoint import COMPLETED
from plugin.conftest import PluginCore, assert_only_live_files, claim, gpu_names, prepare_claim, temp_files
from plugin.test_dynamic_mig_prepare import GPU0, Node, start_node
from plugin.test_sharing import alive, compute_mode, mps_config, ref_of
from tests.driver_root import make_root

EXCLUSIVE_PROCESS, DEFAULT = 3, 0
UID = "eeeeeeee-0000-4000-8000-000000000001"

# (failpoint, claim kind): every failpoint, each with a claim that reaches it.
CASES = [
    (failpoints.CHECKPOINT_AFTER_TEMP, "gpu"),
    (failpoints.CDI_SPEC_AFTER_TEMP, "gpu"),
    (failpoints.CHECKPOINT_AFTER_TEMP, "mps"),
    (failpoints.PREPARE_AFTER_STARTED, "gpu"),
    (failpoints.PREPARE_AFTER_CDI_SPEC, "gpu"),
    (failpoints.PREPARE_AFTER_COMPLETED, "gpu"),
    (failpoints.PREPARE_AFTER_STARTED, "mps"),
    (failpoints.MPS_AFTER_COMPUTE_MODE, "mps"),
    (failpoints.MPS_AFTER_DAEMON_START, "mps"),
    (failpoints.PREPARE_AFTER_CDI_SPEC, "mps"),
    (failpoints.UNPREPARE_AFTER_SHARING, "mps"),
    (failpoints.MIG_AFTER_GPU_INSTANCE, "mig"),
    (failpoints.MIG_AFTER_COMPUTE_INSTANCE, "mig"),
    (failpoints.PREPARE_AFTER_CDI_SPEC, "mig"),
    (failpoints.UNPREPARE_AFTER_INSTANCES, "mig"),
]
UNPREPARE = (failpoints.UNPREPARE_AFTER_SHARING, failpoints.UNPREPARE_AFTER_INSTANCES)
IN_A_WRITE = (failpoints.CHECKPOINT_AFTER_TEMP, failpoints.CDI_SPEC_AFTER_TEMP)
# A record and a spec written together (prepare.py): a kill after one of them may or may not land
# while the other's temp file is open. Which directory that temp file may be in, per case:
# a sharing claim's "started" record with its spec; any claim's spec with its record ("completed",
# or for a sharing claim "started").
CONCURRENT_WRITE = {
    (failpoints.PREPARE_AFTER_STARTED, "mps"): "cdi",
    (failpoints.PREPARE_AFTER_CDI_SPEC, "gpu"): "checkpoint",
    (failpoints.PREPARE_AFTER_CDI_SPEC, "mps"): "checkpoint",
    (failpoints.PREPARE_AFTER_CDI_SPEC, "mig"): "checkpoint",
}


def test_every_failpoint_has_a_case() -> None:
    assert {fp for fp, _ in CASES} == set(failpoints.ALL)


def killed_at(failpoint: str, step: Callable[[], Awaitable[object]]) -> None:
    """Run `step` in a child process with the failpoint set to kill; it must die there."""
    pid = os.fork()
    if pid == 0:  # the child: a plugin process
        os.environ[failpoints.ENV] = f"{failpoint}=kill"
        failpoints.enable()  # the plugin's --enable-failpoints
        try:
            asyncio.run(step())
        finally:
            os._exit(0)  # only if the failpoint was not reached
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, f"not killed: {status}"


def mps_pids(mps_root: Path) -> list[int]:
    return [
        int(p.read_text())
        for p in mps_root.glob("*/pipe/nvidia-cuda-mps-control.pid")
        if p.read_text().strip() and alive(int(p.read_text()))
    ]


@pytest.fixture(scope="module")
def h100_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from simnode.profiles import load_profile

    return make_root(tmp_path_factory.mktemp("driver") / "root", load_profile("dgx-h100-mig").driver_version)


@pytest.mark.skipif(shutil.which("cc") is None, reason="the simulated driver needs cc")
@pytest.mark.parametrize(("failpoint", "kind"), CASES, ids=[f"{fp}-{k}" for fp, k in CASES])
def test_killed_at_a_failpoint_then_restarted_leaves_nothing(
    failpoint: str, kind: str, core: PluginCore, tmp_path: Path, h100_root: Path
) -> None:
    g0 = gpu_names(core)[0]
    gpu_uuid = next(g.uuid for g in core.inventory.gpus if g.device_name == g0)
    if kind == "mig":
        node: PluginCore | Node = start_node(tmp_path / "h100", h100_root)
        c = claim(UID, [f"{GPU0}-mig-3g40gb-4"])
    else:
        node = core
        c = claim(UID, [g0], config=mps_config(40, None) if kind == "mps" else None)
    node.add(c)
    ref = ref_of(c)

    if failpoint in UNPREPARE:
        asyncio.run(prepare_claim(node.preparer, ref))
        killed_at(failpoint, lambda: node.preparer.unprepare(ref))
    else:
        killed_at(failpoint, lambda: prepare_claim(node.preparer, ref))
    left = temp_files(node.cdi.dir, node.checkpoint.path.parent)
    if (failpoint, kind) in CONCURRENT_WRITE:
        # The kill may land in the other write: its temp file only, and only there.
        other = {"cdi": node.cdi.dir, "checkpoint": node.checkpoint.path.parent}[
            CONCURRENT_WRITE[failpoint, kind]
        ]
        assert all(p.parent == other for p in left), left
    else:
        assert bool(left) == (failpoint in IN_A_WRITE), left  # the kill interrupted a write, or none
    again = node.restart()
    assert again.preparer.reconcile().get("tempsRemoved", 0) == len(left)
    assert_only_live_files(again)  # type: ignore[arg-type]
    if failpoint not in UNPREPARE:
        # The kubelet's retry: prepared once, with the devices asked for, and nothing else.
        devices = asyncio.run(prepare_claim(again.preparer, ref))
        assert [d.device_name for d in devices] == [
            c["status"]["allocation"]["devices"]["results"][0]["device"]
        ]
        assert set(again.cdi.owned()) == {UID}
        records = again.checkpoint.records()
        assert [(r.uid, r.state) for r in records] == [(UID, COMPLETED)]
        held = Counter(n for r in records for n in r.device_names)
        assert all(n == 1 for n in held.values())
        if kind == "mps":
            assert len(mps_pids(core.mps_root)) == 1 and compute_mode(core, gpu_uuid) == EXCLUSIVE_PROCESS
        assert_only_live_files(again)  # type: ignore[arg-type]
        if isinstance(again, Node):
            (inst,) = again.live()
            (m,) = records[0].mig_instances
            assert (m["giId"], m["uuid"]) == (inst.gi_id, inst.uuid)
    asyncio.run(again.preparer.unprepare(ref))  # (again, for an unprepare case: the kubelet's retry)
    assert again.cdi.owned() == {} and again.checkpoint.records() == []
    assert_only_live_files(again)  # type: ignore[arg-type]
    assert mps_pids(core.mps_root) == [] and compute_mode(core, gpu_uuid) == DEFAULT
    if isinstance(again, Node):
        assert again.live() == []
