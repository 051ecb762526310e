"""Sharing applied on the GPU: an MPS claim gets its own control daemon (the simulated driver's
real program, asked through its pipe), its GPUs in exclusive-process mode; restarts re-adopt the
daemon, nothing is orphaned, and unprepare restores the GPU."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pynvml
import pytest
from simnode.fake import discover_node
from simnode.fake_nvml import FakeNvml
from simnode.profiles import load_profile

from dra_gpu.kubeletplugin.driver import ClaimRef
from dra_gpu.model.config import API_VERSION, decode
from dra_gpu.plugin.compute_mode import DEFAULT, EXCLUSIVE_PROCESS, ComputeModes
from dra_gpu.plugin.driver_programs import DriverProgram
from dra_gpu.plugin.memory_limits import DRIVER as DRIVER_LIMIT
from dra_gpu.plugin.memory_limits import Enforcement, MemoryLimits
from dra_gpu.plugin.plan import PrepareError
from dra_gpu.plugin.sharing import SharedDevice, Sharing, SharingError
from plugin.conftest import (
    DRIVER,
    NODE,
    PROFILE,
    ClaimStore,
    PluginCore,
    claim,
    gpu_names,
    make_core,
    mig_names,
    prepare_claim,
    stop_daemons,
)
from tests.driver_root import DEB, make_root
from tests.fake_node import create_simulated

pytestmark = pytest.mark.skipif(
    subprocess.run(["which", "cc"], capture_output=True).returncode != 0, reason="needs cc"
)


def uid() -> str:
    return str(uuid.uuid4())


def ref_of(c: dict) -> ClaimRef:
    m = c["metadata"]
    return ClaimRef(m["namespace"], m["uid"], m["name"])


def mps_config(pct: int | None = 50, limit: str | None = "10Gi", kind: str = "GpuConfig") -> list[dict]:
    mps: dict = {}
    if pct is not None:
        mps["defaultActiveThreadPercentage"] = pct
    if limit is not None:
        mps["defaultPinnedDeviceMemoryLimit"] = limit
    params = {"apiVersion": API_VERSION, "kind": kind, "sharing": {"strategy": "MPS", "mps": mps}}
    return [{"source": "FromClaim", "requests": [], "opaque": {"driver": DRIVER, "parameters": params}}]


def ask(core: PluginCore, pipe_dir: str, *commands: str) -> list[str]:
    """What a client in the container would be told through the claim's pipe dir."""
    binary = core.driver_root / "usr/bin/nvidia-cuda-mps-control"
    out = subprocess.run(
        [str(binary)],
        input="".join(f"{c}\n" for c in commands),
        env={"CUDA_MPS_PIPE_DIRECTORY": pipe_dir},
        capture_output=True,
        text=True,
        timeout=5,
        check=False,
    )
    return out.stdout.splitlines()


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def compute_mode(core: PluginCore, uuid_: str) -> int:
    state = core.root / "devroot" / "nvidia-state.json"
    if not state.exists():
        return DEFAULT
    return int(json.loads(state.read_text())["computeModes"].get(uuid_, DEFAULT))


def daemon_pid(pipe: Path) -> int:
    """The pid of the control daemon (`-d`) whose pipe directory is `pipe`, from /proc."""
    want = f"CUDA_MPS_PIPE_DIRECTORY={pipe}".encode()
    for p in Path("/proc").iterdir():
        try:
            env = (p / "environ").read_bytes().split(b"\0")
            argv = (p / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if want in env and b"-d" in argv and alive(int(p.name)):
            return int(p.name)
    raise AssertionError(f"no MPS control daemon of {pipe}")


def daemon_of(core: PluginCore, c: dict) -> tuple[str, int]:
    """The claim's pipe dir (from its CDI spec, as the container gets it) and daemon pid."""
    spec = json.loads(core.cdi.path(c["metadata"]["uid"]).read_text())
    (mount,) = [
        m
        for d in spec["devices"]
        for m in d["containerEdits"].get("mounts", [])
        if m["containerPath"] == "/tmp/nvidia-mps"
    ]
    client = mount["hostPath"]
    return client, daemon_pid(Path(client).parent / "pipe")


def test_mps_claim_runs_its_daemon_with_the_limits_and_unprepare_stops_it(core: PluginCore) -> None:
    g0 = gpu_names(core)[0]
    gpu = next(g for g in core.inventory.gpus if g.device_name == g0)
    c = claim(uid(), [g0], config=mps_config(50, "10Gi"))
    core.add(c)
    asyncio.run(prepare_claim(core.preparer, ref_of(c)))
    pipe, pid = daemon_of(core, c)
    assert alive(pid)
    assert ask(
        core, pipe, "get_default_active_thread_percentage", f"get_default_device_pinned_mem_limit {gpu.uuid}"
    ) == ["50.0", "10240M"]
    spec = json.loads(core.cdi.path(c["metadata"]["uid"]).read_text())
    assert "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps" in spec["devices"][0]["containerEdits"]["env"]
    assert compute_mode(core, gpu.uuid) == EXCLUSIVE_PROCESS
    assert pipe.startswith(str(core.mps_root))

    asyncio.run(core.preparer.unprepare(ref_of(c)))
    assert not alive(pid)
    assert not Path(pipe).exists()
    assert compute_mode(core, gpu.uuid) == DEFAULT


def test_mps_on_a_mig_device_runs_its_daemon_and_leaves_the_compute_mode(core: PluginCore) -> None:
    """The driver refuses a compute mode on a MIG device (NOT_SUPPORTED before NVML 13.2): MPS on
    one runs its daemon without setting any, and the daemon survives a dead-daemon check."""
    m0 = mig_names(core)[0]
    _, mig = core.preparer.planner.devices[m0]
    assert mig is not None
    c = claim(uid(), [m0], config=mps_config(25, None, kind="MigDeviceConfig"))
    core.add(c)
    asyncio.run(prepare_claim(core.preparer, ref_of(c)))
    pipe, pid = daemon_of(core, c)
    assert ask(core, pipe, "get_default_active_thread_percentage") == ["25.0"]
    assert compute_mode(core, mig.uuid) == DEFAULT
    os.kill(pid, signal.SIGKILL)
    asyncio.run(prepare_claim(core.preparer, ref_of(c)))  # restarts the daemon, sets no compute mode
    pipe, _ = daemon_of(core, c)
    assert ask(core, pipe, "get_default_active_thread_percentage") == ["25.0"]
    asyncio.run(core.preparer.unprepare(ref_of(c)))
    assert compute_mode(core, mig.uuid) == DEFAULT


def test_a_dead_daemon_is_restarted_before_a_repeated_prepare_returns(core: PluginCore) -> None:
    c = claim(uid(), gpu_names(core)[:1], config=mps_config(30, None))
    core.add(c)
    asyncio.run(prepare_claim(core.preparer, ref_of(c)))
    pipe, pid = daemon_of(core, c)
    os.kill(pid, signal.SIGKILL)
    asyncio.run(prepare_claim(core.preparer, ref_of(c)))
    _, new_pid = daemon_of(core, c)
    assert new_pid != pid and alive(new_pid)
    assert ask(core, pipe, "get_default_active_thread_percentage") == ["30.0"]


def test_restart_readopts_running_daemons_restarts_dead_ones_and_stops_orphans(core: PluginCore) -> None:
    g0, g1, g2 = gpu_names(core)[:3]
    running, dead, half = (claim(uid(), [g], config=mps_config(40, None)) for g in (g0, g1, g2))
    for c in (running, dead, half):
        core.add(c)
        asyncio.run(prepare_claim(core.preparer, ref_of(c)))
    _, running_pid = daemon_of(core, running)
    dead_pipe, dead_pid = daemon_of(core, dead)
    half_pipe, half_pid = daemon_of(core, half)
    os.kill(dead_pid, signal.SIGKILL)
    core.checkpoint.remove(half["metadata"]["uid"])  # a crash before its record was written
    restarted = core.restart()
    counts = restarted.preparer.reconcile()
    assert counts["daemonsRestarted"] == 1 and counts["daemonsStopped"] == 1
    assert alive(running_pid)  # re-adopted, not restarted
    assert ask(restarted, dead_pipe, "get_default_active_thread_percentage") == ["40.0"]
    assert not alive(half_pid) and not Path(half_pipe).exists()


def test_the_sweeper_stops_the_daemon_of_a_claim_gone_behind_the_kubelets_back(core: PluginCore) -> None:
    c = claim(uid(), gpu_names(core)[:1], config=mps_config(60, None))
    core.add(c)
    asyncio.run(prepare_claim(core.preparer, ref_of(c)))
    _, pid = daemon_of(core, c)
    del core.claims[("default", c["metadata"]["name"])]
    clock = [0.0]
    asyncio.run(core.preparer.sweep(1, now=lambda: clock[0]))
    clock[0] += 2
    asyncio.run(core.preparer.sweep(1, now=lambda: clock[0]))
    assert not alive(pid)
    assert core.preparer.sharing is not None and core.preparer.sharing.mps.owned() == []


def test_a_daemon_that_cannot_start_fails_prepare_and_leaves_nothing(core: PluginCore) -> None:
    g0 = gpu_names(core)[0]
    gpu = next(g for g in core.inventory.gpus if g.device_name == g0)
    assert core.preparer.sharing is not None
    core.preparer.sharing.mps.locate = lambda: DriverProgram(None)
    c = claim(uid(), [g0], config=mps_config())
    core.add(c)
    with pytest.raises(PrepareError, match="nvidia-cuda-mps-control not found"):
        asyncio.run(prepare_claim(core.preparer, ref_of(c)))
    assert core.checkpoint.records() == []
    assert not core.cdi.path(c["metadata"]["uid"]).exists()
    assert compute_mode(core, gpu.uuid) == DEFAULT


def test_mps_limits_are_refused_below_compute_capability_7() -> None:
    config = decode(
        {
            "apiVersion": API_VERSION,
            "kind": "GpuConfig",
            "sharing": {"strategy": "MPS", "mps": {"defaultActiveThreadPercentage": 50}},
        }
    )
    dev = SharedDevice("gpu-0", "GPU-1", config, "claim x: results[0]", compute_capability=(6, 1))
    sharing = Sharing(mps=None, modes=None)  # type: ignore[arg-type]
    with pytest.raises(SharingError, match=r"results\[0\]: sharing.mps.defaultActiveThreadPercentage: .*6.1"):
        sharing.plan("uid", [dev])


def test_a_gpu_set_differently_for_another_claim_is_a_conflict() -> None:
    mine = {"computeModes": {"GPU-1": {"mode": EXCLUSIVE_PROCESS}}}
    theirs = {"computeModes": {"GPU-1": {"mode": DEFAULT, "previous": DEFAULT}}}
    problem = Sharing.conflict(mine, [("ns/other", theirs)])
    assert problem is not None and "ns/other" in problem and "Default" in problem


def timeslicing(interval: str) -> list[dict]:
    params = {
        "apiVersion": API_VERSION,
        "kind": "GpuConfig",
        "sharing": {"strategy": "TimeSlicing", "timeSlicing": {"interval": interval}},
    }
    return [{"source": "FromClaim", "requests": [], "opaque": {"driver": DRIVER, "parameters": params}}]


def smi_calls(core: PluginCore) -> list[str]:
    calls = core.root / "devroot" / "dev" / "nvidia-smi.calls"
    return calls.read_text().splitlines() if calls.exists() else []


def test_time_slicing_sets_mode_and_slice_and_unprepare_restores_both(core: PluginCore) -> None:
    g0 = gpu_names(core)[0]
    gpu = next(g for g in core.inventory.gpus if g.device_name == g0)
    state = core.root / "devroot" / "nvidia-state.json"
    state.write_text(json.dumps({"computeModes": {gpu.uuid: EXCLUSIVE_PROCESS}}))  # set by someone
    c = claim(uid(), [g0], config=timeslicing("Long"))
    core.add(c)
    asyncio.run(prepare_claim(core.preparer, ref_of(c)))
    assert compute_mode(core, gpu.uuid) == DEFAULT
    assert smi_calls(core) == [f"compute-policy -i {gpu.uuid} --set-timeslice 3"]
    asyncio.run(core.preparer.unprepare(ref_of(c)))
    assert compute_mode(core, gpu.uuid) == EXCLUSIVE_PROCESS  # what it was before
    assert smi_calls(core)[-1] == f"compute-policy -i {gpu.uuid} --set-timeslice 0"


def test_a_gpu_with_another_time_slice_for_another_claim_is_a_conflict() -> None:
    mine = {"timeSlices": {"GPU-1": {"interval": "Long", "level": 3}}}
    theirs = {"timeSlices": {"GPU-1": {"interval": "Short", "level": 1}}}
    problem = Sharing.conflict(mine, [("ns/other", theirs)])
    assert problem is not None and "ns/other" in problem and "interval Long" in problem
    assert Sharing.conflict(mine, [("ns/other", mine)]) is None  # the same setting can be shared


def share(c: dict, share_id: str, consumed: dict[str, str]) -> dict:
    (result,) = c["status"]["allocation"]["devices"]["results"]
    result["shareID"] = share_id
    result["consumedCapacity"] = consumed
    return c


def test_memory_shares_of_one_gpu_get_their_own_cdi_devices_and_daemons_with_the_consumed_limits(
    core: PluginCore,
) -> None:
    g0 = gpu_names(core)[0]
    gpu = next(g for g in core.inventory.gpus if g.device_name == g0)
    s1, s2 = str(uuid.uuid4()), str(uuid.uuid4())
    a = share(claim(uid(), [g0]), s1, {"memory": "40Gi", "computeShare": "30"})
    b = share(claim(uid(), [g0]), s2, {"memory": "20Gi", "computeShare": "0"})
    for c in (a, b):
        core.add(c)
        asyncio.run(prepare_claim(core.preparer, ref_of(c)))
    spec_a = json.loads(core.cdi.path(a["metadata"]["uid"]).read_text())
    assert [d["name"] for d in spec_a["devices"]] == [f"{a['metadata']['uid']}-{g0}-{s1}"]
    pipe_a, pid_a = daemon_of(core, a)
    pipe_b, pid_b = daemon_of(core, b)
    assert pipe_a != pipe_b
    limit = f"get_default_device_pinned_mem_limit {gpu.uuid}"
    assert ask(core, pipe_a, "get_default_active_thread_percentage", limit) == ["30.0", "40960M"]
    assert ask(core, pipe_b, "get_default_active_thread_percentage", limit) == ["100.0", "20480M"]
    assert compute_mode(core, gpu.uuid) == DEFAULT  # the shares' servers run side by side
    asyncio.run(core.preparer.unprepare(ref_of(a)))
    assert not alive(pid_a) and alive(pid_b)


def test_time_slicing_cannot_enforce_a_memory_share(core: PluginCore) -> None:
    c = share(
        claim(uid(), gpu_names(core)[:1], config=timeslicing("Long")), str(uuid.uuid4()), {"memory": "8Gi"}
    )
    core.add(c)
    with pytest.raises(PrepareError, match="TimeSlicing cannot enforce a memory share"):
        asyncio.run(prepare_claim(core.preparer, ref_of(c)))
    assert core.checkpoint.records() == []


def test_the_sweeper_restarts_a_dead_daemon_of_a_live_claim(core: PluginCore) -> None:
    c = claim(uid(), gpu_names(core)[:1], config=mps_config(70, None))
    core.add(c)
    asyncio.run(prepare_claim(core.preparer, ref_of(c)))
    pipe, pid = daemon_of(core, c)
    os.kill(pid, signal.SIGKILL)
    asyncio.run(core.preparer.sweep(60))
    _, new_pid = daemon_of(core, c)
    assert new_pid != pid and alive(new_pid)
    assert ask(core, pipe, "get_default_active_thread_percentage") == ["70.0"]


def test_a_daemon_that_runs_but_does_not_answer_is_kept_for_the_grace_then_restarted(
    core: PluginCore,
) -> None:
    """A tenant holding the daemon's one control session leaves the plugin unanswered (measured with
    NVIDIA's daemons, test_mps_real_daemon.py); a stopped daemon stands for it here. The sweeper
    keeps it, and the tenant's clients with it, until it has been silent for the grace; a dead one
    is restarted at once (the tests above)."""
    assert core.preparer.sharing is not None
    core.preparer.sharing.mps.command_timeout = 0.5
    c = claim(uid(), gpu_names(core)[:1], config=mps_config(60, None))
    core.add(c)
    asyncio.run(prepare_claim(core.preparer, ref_of(c)))
    pipe, pid = daemon_of(core, c)
    os.kill(pid, signal.SIGSTOP)
    try:
        asyncio.run(core.preparer.sweep(60))
        assert daemon_of(core, c)[1] == pid and alive(pid)  # kept: silent, but it runs
        core.preparer.sharing.silent_grace = 0.0
        asyncio.run(core.preparer.sweep(60))
        _, new_pid = daemon_of(core, c)
        assert new_pid != pid and not alive(pid)  # taken as wedged: restarted
        assert ask(core, pipe, "get_default_active_thread_percentage") == ["60.0"]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_a_claim_with_an_mps_device_and_a_share_gets_two_distinct_daemons(core: PluginCore) -> None:
    g0, g1 = gpu_names(core)[:2]
    c = claim(uid(), [g0, g1], requests=["a", "b"], config=mps_config(40, None))
    c["status"]["allocation"]["devices"]["results"][1].update(
        shareID=str(uuid.uuid4()), consumedCapacity={"memory": "8Gi", "computeShare": "20"}
    )
    core.add(c)
    asyncio.run(prepare_claim(core.preparer, ref_of(c)))
    record = core.checkpoint.get(c["metadata"]["uid"])
    assert record is not None
    ids = [d["id"] for d in record.raw["sharing"]["mps"]]
    assert len(set(ids)) == 2, ids
    spec = json.loads(core.cdi.path(c["metadata"]["uid"]).read_text())
    pipes = [
        m["hostPath"]
        for d in spec["devices"]
        for m in d["containerEdits"]["mounts"]
        if m["containerPath"] == "/tmp/nvidia-mps"
    ]
    assert len(set(pipes)) == 2
    answers = sorted(ask(core, p, "get_default_active_thread_percentage")[0] for p in pipes)
    assert answers == ["20.0", "40.0"]


def test_a_limit_the_daemon_answers_differently_is_a_drift_and_is_set_again(tmp_path: Path) -> None:
    from dra_gpu.plugin.mps import MpsDaemon, MpsDaemons, MpsError

    daemons = MpsDaemons(tmp_path, lambda: DriverProgram(None), isolate=False)
    daemon = MpsDaemon("x", ["GPU-1"], 50, {"GPU-1": "1024M"})
    limits = {
        "get_default_active_thread_percentage": "100.0",
        "get_default_device_pinned_mem_limit GPU-1": "1G",
    }
    sent: list[str] = []

    def control(_id: str, commands: list[str]) -> str:
        sent.extend(commands)
        for c in commands:
            if c.startswith("set_default_active_thread_percentage"):
                limits["get_default_active_thread_percentage"] = c.split()[-1] + ".0"
        return "".join(limits.get(c, "") + "\n" for c in commands)

    daemons.control = control  # type: ignore[method-assign]
    changed = ["get_default_active_thread_percentage answered '100.0', expected 50"]
    assert daemons.drift(daemon) == changed
    assert daemons.check(daemon) == changed
    assert "set_default_active_thread_percentage 50" in sent and daemons.drift(daemon) == []
    limits["get_default_device_pinned_mem_limit GPU-1"] = "unlimited-ish"
    assert daemons.drift(daemon) == []  # an answer not understood is logged, not a drift
    daemons.control = lambda _id, commands: "100.0\n"  # type: ignore[method-assign]
    with pytest.raises(MpsError, match="cannot be restored"):
        daemons.check(daemon)


@pytest.fixture
def host_libc_core(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PluginCore]:
    """A node whose driver root is a host's `/`: its library directory also holds the host's C
    library (here one no program can load), next to the driver's libraries."""
    inventory = discover_node(NODE, PROFILE)
    assert inventory.driver_version
    root = make_root(tmp_path_factory.mktemp("host") / "root", inventory.driver_version)
    (root / DEB / "libc.so.6").write_bytes(b"")  # the host's glibc, unusable by the image's loader
    # nvidia-smi notes what it was run with.
    (root / "usr/bin/nvidia-smi").write_text(
        '#!/bin/sh\necho "$* preload=$LD_PRELOAD libpath=$LD_LIBRARY_PATH"'
        ' >> "$DRA_GPU_SIM_DEV_DIR/nvidia-smi.calls"\n'
    )
    create_simulated(inventory, tmp_path / "devroot")
    c = make_core(tmp_path, inventory, ClaimStore(), root)
    yield c
    stop_daemons(c.mps_root)


def test_driver_programs_run_with_the_hosts_c_library_in_the_driver_root(host_libc_core: PluginCore) -> None:
    """Driver root `/`: the MPS daemon and nvidia-smi still run (nothing of the driver root is on
    their loader path); each gets its one driver library by full path."""
    core = host_libc_core
    libdir = core.driver_root / "usr/lib/x86_64-linux-gnu"
    g0, g1 = gpu_names(core)[:2]
    c = claim(uid(), [g0], config=mps_config(40, None))
    core.add(c)
    asyncio.run(prepare_claim(core.preparer, ref_of(c)))
    pipe, pid = daemon_of(core, c)
    assert ask(core, pipe, "get_default_active_thread_percentage") == ["40.0"]
    env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv)
    assert "LD_LIBRARY_PATH" not in env
    assert Path(env["LD_PRELOAD"]).resolve() == (libdir / "libcuda.so.1").resolve()
    # The daemon starts nvidia-cuda-mps-server by name: the driver's MPS binaries come first.
    assert env["PATH"].split(":")[0] == str(core.driver_root / "usr/bin")
    asyncio.run(core.preparer.unprepare(ref_of(c)))

    gpu = next(g for g in core.inventory.gpus if g.device_name == g1)
    t = claim(uid(), [g1], config=timeslicing("Short"))
    core.add(t)
    asyncio.run(prepare_claim(core.preparer, ref_of(t)))
    (call,) = smi_calls(core)
    args, preload = call.split(" preload=")
    assert args == f"compute-policy -i {gpu.uuid} --set-timeslice 1"
    assert preload.endswith(" libpath=")  # nothing on the loader's search path
    assert Path(preload.removesuffix(" libpath=")).resolve() == (libdir / "libnvidia-ml.so.1").resolve()


HOOK_PATH = "/usr/local/nvidia/toolkit/nvidia-cdi-hook"


def driver_limits() -> MemoryLimits:
    """A node whose driver holds cgroups to their limits (what `memory_limits.detect` decides on a
    580+ driver, cgroup v2 and a hook program; tests/plugin/test_memory_limits.py checks that)."""
    return MemoryLimits(
        Enforcement(DRIVER_LIMIT, "the hook sets it"),
        hook_path=HOOK_PATH,
        host_driver_root="/run/nvidia/driver",
        hook_env={"DRA_GPU_SIM_DEV_DIR": "/sim/dev"},
    )


def share_edits(core: PluginCore, c: dict) -> dict:
    (device,) = json.loads(core.cdi.path(c["metadata"]["uid"]).read_text())["devices"]
    return device["containerEdits"]


def memory_limit_of(core: PluginCore, c: dict) -> dict | None:
    record = core.checkpoint.get(c["metadata"]["uid"])
    assert record is not None
    (device,) = record.devices
    return device.memory_limit


def test_where_the_driver_can_a_share_carries_nvidias_hook_and_its_size_in_mib(core: PluginCore) -> None:
    assert core.preparer.sharing is not None
    core.preparer.sharing.memory_limits = driver_limits()
    g0 = gpu_names(core)[0]
    gpu = next(g for g in core.inventory.gpus if g.device_name == g0)
    a = share(claim(uid(), [g0]), str(uuid.uuid4()), {"memory": "40Gi", "computeShare": "30"})
    core.add(a)
    asyncio.run(prepare_claim(core.preparer, ref_of(a)))
    edits = share_edits(core, a)
    env = dict(e.split("=", 1) for e in edits["env"])
    assert env["NVIDIA_GPU_MEMORY_LIMIT"] == env["NVIDIA_GPU_MEMORY_REQUEST"] == "40960"
    assert edits["hooks"] == [
        {
            "hookName": "createRuntime",
            "path": HOOK_PATH,
            "args": [
                "nvidia-cdi-hook",
                "apply-cuda-memory-limits",
                "--driver-root",
                "/run/nvidia/driver",
                "--gpu-id",
                gpu.uuid,
            ],
            "env": ["NVIDIA_CTK_DEBUG=false", "DRA_GPU_SIM_DEV_DIR=/sim/dev"],
        }
    ]
    assert memory_limit_of(core, a) == {"enforcedBy": "driver", "reason": "the hook sets it"}
    # The MPS daemon still runs with the share's limits (compute share, pinned memory).
    pipe, _ = daemon_of(core, a)
    assert ask(core, pipe, f"get_default_device_pinned_mem_limit {gpu.uuid}") == ["40960M"]


def test_without_driver_limits_a_share_has_no_hook_and_is_recorded_cooperative(core: PluginCore) -> None:
    g0 = gpu_names(core)[0]
    a = share(claim(uid(), [g0]), str(uuid.uuid4()), {"memory": "20Gi"})
    core.add(a)
    asyncio.run(prepare_claim(core.preparer, ref_of(a)))
    edits = share_edits(core, a)
    assert "hooks" not in edits
    assert not any(e.startswith("NVIDIA_GPU_MEMORY_") for e in edits["env"])
    limit = memory_limit_of(core, a)
    assert limit is not None and limit["enforcedBy"] == "cooperative"


def test_driver_held_shares_of_different_sizes_in_one_claim_are_refused(core: PluginCore) -> None:
    """One container may be given every device of its claim, and NVIDIA's hook reads one limit
    for the whole container: refused, not left to the MPS limits a client can bypass."""
    assert core.preparer.sharing is not None
    core.preparer.sharing.memory_limits = driver_limits()
    g0, g1 = gpu_names(core)[:2]
    c = claim(uid(), [g0, g1])
    sizes = ("40Gi", "20Gi")
    for result, size in zip(c["status"]["allocation"]["devices"]["results"], sizes, strict=True):
        result["shareID"], result["consumedCapacity"] = str(uuid.uuid4()), {"memory": size}
    core.add(c)
    with pytest.raises(PrepareError) as err:
        asyncio.run(prepare_claim(core.preparer, ref_of(c)))
    assert str(err.value) == (
        f"claim {ref_of(c)}: status.allocation.devices.results[0].consumedCapacity.memory is 40Gi "
        "and status.allocation.devices.results[1].consumedCapacity.memory is 20Gi: NVIDIA's"
        " apply-cuda-memory-limits hook holds every GPU of a container to one "
        "container-wide NVIDIA_GPU_MEMORY_LIMIT, so a container given both would hold one share's "
        "GPU to the other's size; on this node the memory shares of one claim must be of one size"
    )
    assert core.checkpoint.records() == [] and not core.cdi.path(c["metadata"]["uid"]).exists()


def test_a_pod_reserving_two_claims_held_to_different_sizes_gets_the_second_refused(core: PluginCore) -> None:
    """Across claims: the kubelet prepares a pod's claims one by one, and CDI gives a container
    one NVIDIA_GPU_MEMORY_LIMIT whatever its devices (the later device's). A claim held to 20Gi
    whose pod also reserves a claim held to 40Gi is refused, naming the other claim and the pod;
    the same sizes, or another pod, are prepared."""
    assert core.preparer.sharing is not None
    core.preparer.sharing.memory_limits = driver_limits()
    g0, g1, g2, g3 = gpu_names(core)[:4]

    def held(gpu: str, size: str, pod: str) -> dict:
        c = share(claim(uid(), [gpu]), str(uuid.uuid4()), {"memory": size})
        c["status"]["reservedFor"] = [{"resource": "pods", "name": pod, "uid": f"uid-{pod}"}]
        core.add(c)
        return c

    first = held(g0, "40Gi", "p")
    asyncio.run(prepare_claim(core.preparer, ref_of(first)))
    record = core.checkpoint.get(first["metadata"]["uid"])
    assert record is not None and record.sharing is not None
    assert (record.sharing["driverMemoryLimitMiB"], record.sharing["pods"]) == (40960, ["uid-p"])
    second = held(g1, "20Gi", "p")
    with pytest.raises(PrepareError) as err:
        asyncio.run(prepare_claim(core.preparer, ref_of(second)))
    assert str(err.value).startswith(
        f"claim {ref_of(second)}: its memory share is held to 20480 MiB and claim {ref_of(first)}'s "
        "to 40960 MiB, and pod uid-p reserves both: NVIDIA's apply-cuda-memory-limits hook holds"
    ), err.value
    assert core.checkpoint.get(second["metadata"]["uid"]) is None
    assert not core.cdi.path(second["metadata"]["uid"]).exists()
    for ok in (held(g2, "40Gi", "p"), held(g3, "20Gi", "q")):  # same size; another pod
        asyncio.run(prepare_claim(core.preparer, ref_of(ok)))
        assert core.cdi.path(ok["metadata"]["uid"]).exists()


def test_unprepare_restores_no_compute_mode_on_a_gpu_gone_from_the_node(tmp_path: Path) -> None:
    """A claim prepared on a GPU the node no longer has (removed, or another node's driver root
    after a restart): its unprepare succeeds instead of failing for ever; other errors still fail."""
    nvml = FakeNvml(load_profile(PROFILE), root=tmp_path, state_file=tmp_path / "nvidia-state.json")
    sharing = Sharing(mps=None, modes=ComputeModes(nvml))  # type: ignore[arg-type]
    gone = "GPU-00000000-0000-0000-0000-00000000dead"
    record = {"computeModes": {gone: {"mode": EXCLUSIVE_PROCESS, "previous": DEFAULT}}}
    sharing.release(record, [])
    present = discover_node(NODE, PROFILE).gpus[0].uuid
    nvml.fail_next("nvmlDeviceGetComputeMode", pynvml.NVML_ERROR_NO_PERMISSION)
    with pytest.raises(SharingError, match="cannot read the compute mode"):
        sharing.release({"computeModes": {present: {"mode": EXCLUSIVE_PROCESS, "previous": DEFAULT}}}, [])
