"""The simulated libnvidia-ml.so.1's node state across processes: MIG instances made through the
product's own MIG code outlive the process that made them, and events injected from outside reach
an NVML event set. Each NVML user is a child process (see simnode_support)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from simnode import inject

from tests.simnode_support import (
    PRELUDE,
    REPO,
    devdir_for,
    libcache,  # noqa: F401 - fixture
    library,
    needs_root,
    needs_toolchain,
    nvml_h,  # noqa: F401 - fixture
    run_child,
)

pytestmark = [needs_toolchain, needs_root]

MIG_SETUP = """
from dra_gpu.model.inventory import MigPlacement, MigProfile
from dra_gpu.plugin.mig_lifecycle import MigError, MigInstances
P3G = MigProfile("3g.40gb", 9, 3, 4, (0, 4), 40448 << 20, 60)
mi = MigInstances(pynvml)
parent = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(0))
def nvml_error(fn, *a):
    try:
        fn(*a)
    except MigError as exc:
        return type(exc.nvml_error).__name__
"""

CREATE = (
    MIG_SETUP
    + """
at4 = MigPlacement(P3G, 4)
gi = mi.create_gpu_instance(parent, at4)
ci = mi.create_compute_instance(parent, gi, at4)
dev = mi.mig_device(parent, gi, ci, at4)
out({
    "gi": gi, "ci": ci, "uuid": dev.uuid,
    "overlap": nvml_error(mi.create_gpu_instance, parent, at4),
    "instances": mi.instances(parent),
})
"""
)

INSPECT_AND_DESTROY = (
    MIG_SETUP
    + """
uuid = sys.argv[2]
mig = pynvml.nvmlDeviceGetHandleByUUID(uuid)
res = {
    "instances": mi.instances(parent),
    "name": pynvml.nvmlDeviceGetName(mig),
    "memory": pynvml.nvmlDeviceGetMemoryInfo(mig).total,
    "parent": pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig)),
    "processes": mi.processes(parent, int(sys.argv[3])),
}
res["busy"] = nvml_error(mi.destroy, parent, int(sys.argv[3]), 9, 4)
open(sys.argv[4], "w").close()  # tell the test to clear the processes, then go on
while os.path.exists(sys.argv[4]):
    pass
res["destroyed"] = mi.destroy(parent, int(sys.argv[3]), 9, 4)
res["again"] = mi.destroy(parent, int(sys.argv[3]), 9, 4)
out(res)
"""
)


def test_mig_instances_made_by_the_product_outlive_the_process(libcache: Path, tmp_path: Path) -> None:  # noqa: F811
    lib = library(libcache, "dgx-h100-mig")
    dev = devdir_for(tmp_path / "dev", "dgx-h100-mig")
    made = run_child(lib, dev, CREATE)
    assert (made["gi"], made["ci"]) == (1, 0)
    assert made["uuid"].startswith("MIG-")
    assert made["overlap"] == "NVMLError_InsufficientResources"  # the slices are taken
    assert [(i.gi_id, i.profile_id, i.start, i.size, i.ci_ids) for i in made["instances"]] == [
        (1, 9, 4, 4, (0,))
    ]
    state = (dev / ".nvidia-sim" / "state").read_text()
    assert f"ci {made['instances'][0].parent_uuid} 1 0 0 {made['uuid']}" in state

    # A second process (a restarted plugin) sees the instance, and destroys it once idle.
    inject.set_processes(dev, made["uuid"], [4242])
    flag = tmp_path / "busy-seen"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os\n" + PRELUDE + textwrap.dedent(INSPECT_AND_DESTROY),
            str(lib),
            made["uuid"],
            str(made["gi"]),
            str(flag),
        ],
        env={"PATH": "/usr/bin:/bin", "DRA_GPU_SIM_DEV_DIR": str(dev), "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        for _ in range(600):
            if flag.exists() or proc.poll() is not None:
                break
            subprocess.run(["sleep", "0.05"], check=True)
        inject.set_processes(dev, made["uuid"], [])
        flag.unlink(missing_ok=True)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr.decode()[-3000:]
    import pickle

    seen = pickle.loads(stdout)
    assert [(i.gi_id, i.start) for i in seen["instances"]] == [(1, 4)]
    assert seen["name"] == "NVIDIA H100 80GB HBM3 MIG 3g.40gb"
    assert seen["memory"] == 40448 << 20
    assert seen["processes"] == [4242]
    assert seen["busy"] == "NVMLError_InUse"  # a compute instance with processes stays
    assert (seen["destroyed"], seen["again"]) == (True, False)

    # A third process: the GPU is empty again.
    gone = run_child(lib, dev, MIG_SETUP + "out(mi.instances(parent))\n")
    assert gone == []


EVENTS = """
import json
def say(**kw):
    print(json.dumps(kw), flush=True)
def wait_go():
    sys.stdin.readline()
pynvml.nvmlInit()
gpu = pynvml.nvmlDeviceGetHandleByIndex(0)
mask = (pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeDoubleBitEccError
        | pynvml.nvmlEventTypeGpuUnavailableError | pynvml.nvmlEventTypeGpuRecoveryAction)
supported = pynvml.nvmlDeviceGetSupportedEventTypes(gpu)
es = pynvml.nvmlEventSetCreate()
pynvml.nvmlDeviceRegisterEvents(gpu, mask, es)
def wait(ms):
    try:
        e = pynvml.nvmlEventSetWait_v2(es, ms)
        return {"type": e.eventType, "data": e.eventData, "gi": e.gpuInstanceId, "ci": e.computeInstanceId,
                "uuid": pynvml.nvmlDeviceGetUUID(e.device)}
    except pynvml.NVMLError as exc:
        return {"error": exc.value}
say(step="registered", supported=supported)
wait_go()
say(step="xid", first=wait(10000), second=wait(10000), then=wait(200))
wait_go()
recovery = wait(10000)
(field,) = pynvml.nvmlDeviceGetFieldValues(gpu, [pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION])
say(step="recovery", event=recovery, field=[field.nvmlReturn, field.value.uiVal])
wait_go()
try:
    pynvml.nvmlDeviceGetMemoryInfo(gpu)
    memory = "ok"
except pynvml.NVMLError as exc:
    memory = exc.value
say(step="lost", wait=wait(10000), memory=memory,
    other=pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(1)).total > 0)
"""


def test_injected_events_reach_an_event_set_in_another_process(libcache: Path, tmp_path: Path) -> None:  # noqa: F811
    lib = library(libcache, "dgx-h100")
    dev = devdir_for(tmp_path / "dev", "dgx-h100")
    from simnode.profiles import load_profile

    uuids = [g.uuid for g in load_profile("dgx-h100").gpus]
    inject.inject_xid(dev, uuids[0], 31)  # before the set exists: never delivered to it
    proc = subprocess.Popen(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(EVENTS), str(lib)],
        env={"PATH": "/usr/bin:/bin", "DRA_GPU_SIM_DEV_DIR": str(dev), "PYTHONPATH": str(REPO)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None

    def step() -> dict:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line, proc.stderr.read() if proc.stderr else ""  # type: ignore[union-attr]
        return dict(json.loads(line))

    def go() -> None:
        proc.stdin.write("go\n")  # type: ignore[union-attr]
        proc.stdin.flush()  # type: ignore[union-attr]

    try:
        assert step()["supported"] == 0x8000 | 0x4000 | 0x8 | 0x2 | 0x1
        inject.inject_xid(dev, uuids[1], 48)  # a GPU the set is not registered for
        inject.inject_xid(dev, uuids[0], 79)
        inject.inject_xid(dev, uuids[0], 94, gi=2, ci=0)
        go()
        xid = step()
        assert xid["first"] == {
            "type": 8,
            "data": 79,
            "gi": inject.NO_ID,
            "ci": inject.NO_ID,
            "uuid": uuids[0],
        }
        assert xid["second"] == {"type": 8, "data": 94, "gi": 2, "ci": 0, "uuid": uuids[0]}
        assert xid["then"] == {"error": 10}  # NVML_ERROR_TIMEOUT
        inject.set_recovery_action(dev, uuids[0], inject.RECOVERY_GPU_RESET)
        go()
        recovery = step()
        assert recovery["event"] == {
            "type": 0x8000,
            "data": 0,
            "gi": inject.NO_ID,
            "ci": inject.NO_ID,
            "uuid": uuids[0],
        }
        assert recovery["field"] == [0, inject.RECOVERY_GPU_RESET]
        inject.set_gpu_lost(dev, uuids[0])
        go()
        lost = step()
        assert lost["wait"] == {"error": 15}  # NVML_ERROR_GPU_IS_LOST
        assert lost["memory"] == 15
        assert lost["other"] is True  # the other GPUs answer as before
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
    assert inject.prune_events(dev, older_than_s=0) == 5
    assert os.listdir(dev / ".nvidia-sim" / "events") == []


RACE = """
pynvml.nvmlInit()
gpu = pynvml.nvmlDeviceGetHandleByIndex(0)
got = []
for _ in range(6):
    try:
        gi = pynvml.nvmlDeviceCreateGpuInstance(gpu, 19)  # 1g.10gb, wherever it fits
        info = pynvml.nvmlGpuInstanceGetInfo(gi)
        got.append((info.id, info.placement.start))
    except pynvml.NVMLError as exc:
        got.append(exc.value)
out(got)
"""


def test_processes_creating_at_once_never_share_an_instance(libcache: Path, tmp_path: Path) -> None:  # noqa: F811
    import pickle

    lib = library(libcache, "dgx-h100-mig")
    dev = devdir_for(tmp_path / "dev", "dgx-h100-mig")
    env = {"PATH": "/usr/bin:/bin", "DRA_GPU_SIM_DEV_DIR": str(dev), "PYTHONPATH": str(REPO)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", PRELUDE + textwrap.dedent(RACE), str(lib)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for _ in range(2)
    ]
    results = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr.decode()[-3000:]
        results += pickle.loads(stdout)
    made = [r for r in results if isinstance(r, tuple)]
    assert len(made) == 7  # an H100 holds seven 1g.10gb instances ...
    assert sorted(gi for gi, _ in made) == list(range(1, 8))  # ... each with its own id
    assert sorted(start for _, start in made) == list(range(7))  # ... and memory slice
    assert sorted(r for r in results if not isinstance(r, tuple)) == [23] * 5  # INSUFFICIENT_RESOURCES


def test_premade_instances_are_the_boot_state_and_can_be_destroyed(libcache: Path, tmp_path: Path) -> None:  # noqa: F811
    lib = library(libcache, "dgx-a100-mig", "580.95.05")
    dev = devdir_for(tmp_path / "dev", "dgx-a100-mig")
    destroy = (
        MIG_SETUP + "out((mi.destroy(parent, 1, 9, 0), mi.destroy(parent, 2, 14, 4), mi.instances(parent)))\n"
    )
    destroyed, wrong_record, left = run_child(lib, dev, destroy)
    assert (destroyed, wrong_record) == (True, False)  # GI 2 is a 3g.40gb at 4: not the recorded one
    assert [(i.gi_id, i.profile_id, i.start) for i in left] == [(2, 9, 4)]
    discover = """
from dra_gpu.discovery.nvml_discovery import discover
out([[(m.gpu_instance_id, m.profile, m.uuid) for m in g.mig_devices] for g in discover(pynvml, "n").gpus])
"""
    seen = run_child(lib, dev, discover)
    assert seen[0] == [(2, "3g.40gb", "MIG-b1412001-0001-5294-8a3a-7080a115670c")]
    assert [len(m) for m in seen] == [1, 5, 3, 0, 0, 0, 0, 0]  # the other GPUs keep theirs
