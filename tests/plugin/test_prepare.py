"""Prepare / unprepare: devices, CDI specs, checkpoint phases, conflicts, configs, recovery."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import stat
import uuid
from pathlib import Path

import pytest

from dra_gpu.kubeletplugin.driver import ClaimError, ClaimRef
from dra_gpu.model.config import API_VERSION
from dra_gpu.plugin.checkpoint import COMPLETED, STARTED, Checkpoint
from dra_gpu.plugin.plan import PrepareError
from plugin.conftest import DRIVER, NODE, PluginCore, claim, gpu_names, mig_names, prepare_claim, validate_cdi
from tests.fake_node import SIM_CAPS_MAJOR, SIM_UVM_MAJOR


def ref_of(c: dict) -> ClaimRef:
    m = c["metadata"]
    return ClaimRef(m["namespace"], m["uid"], m["name"])


def uid() -> str:
    return str(uuid.uuid4())


def prepare(core: PluginCore, c: dict):
    return asyncio.run(prepare_claim(core.preparer, ref_of(c)))


def test_prepare_writes_a_valid_cdi_spec_and_a_completed_record(core: PluginCore) -> None:
    g0, g1 = gpu_names(core)[:2]
    c = claim(uid(), [g0, g1], requests=["gpus/h100", "gpus/h100"])
    core.add(c)
    devices = prepare(core, c)
    u = c["metadata"]["uid"]
    assert [d.device_name for d in devices] == [g0, g1]
    assert all(d.request_names == ["gpus"] for d in devices)  # subrequest suffix stripped
    assert devices[0].cdi_device_ids == [f"k8s.{DRIVER}/claim={u}-{g0}"]
    spec = json.loads(core.cdi.path(u).read_text())
    validate_cdi(spec)
    assert spec["cdiVersion"] == "0.5.0"  # device names start with the UID; hostPath is used
    assert spec["kind"] == f"k8s.{DRIVER}/claim"
    assert [d["name"] for d in spec["devices"]] == [f"{u}-{g0}", f"{u}-{g1}"]
    gpus = {g.device_name: g for g in core.inventory.gpus}
    node = spec["devices"][0]["containerEdits"]["deviceNodes"][0]
    assert node["path"] == f"/dev/nvidia{gpus[g0].minor}"
    assert stat.S_ISCHR(os.stat(node["hostPath"]).st_mode)
    env = spec["containerEdits"]["env"]
    assert f"DRA_GPU_VISIBLE_DEVICES={gpus[g0].uuid},{gpus[g1].uuid}" in env
    # NVIDIA's "no devices" (env and volume-mount device list), so an NVIDIA runtime on the node
    # does not inject the claim's GPUs (or all GPUs) a second time.
    assert "NVIDIA_VISIBLE_DEVICES=void" in env
    void = [m for m in spec["containerEdits"]["mounts"] if m["containerPath"].endswith("/void")]
    assert [(m["hostPath"], m["containerPath"]) for m in void] == [
        ("/dev/null", "/var/run/nvidia-container-devices/void")
    ]
    control = [n["path"] for n in spec["containerEdits"]["deviceNodes"]]
    assert control == ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset"]
    # The driver's user space: the running version's libraries at their path and SONAME.
    version = core.inventory.driver_version
    mounts = {m["containerPath"]: m["hostPath"] for m in spec["containerEdits"]["mounts"]}
    libcuda = str(core.driver_root / f"usr/lib/x86_64-linux-gnu/libcuda.so.{version}")
    assert mounts["/usr/lib/x86_64-linux-gnu/libcuda.so.1"] == libcuda
    assert mounts["/usr/local/nvidia/lib64/libnvidia-ml.so.1"].endswith(f"libnvidia-ml.so.{version}")
    assert mounts["/usr/bin/nvidia-smi"] == str(core.driver_root / "usr/bin/nvidia-smi")
    rec = core.checkpoint.get(u)
    assert rec is not None and rec.state == COMPLETED
    # The record keeps the claim's own part; the driver's files are added to the file only.
    assert rec.cdi_spec is not None
    assert [m["hostPath"] for m in rec.cdi_spec["containerEdits"]["mounts"]] == ["/dev/null"]  # void
    assert core.cdi.compose(rec.cdi_spec, core.preparer.driver_files.edits()) == spec
    assert oct(core.cdi.path(u).stat().st_mode & 0o777) == "0o644"
    assert not list(core.cdi.dir.glob(".*.tmp"))


def test_mig_device_gets_parent_and_capability_nodes(core: PluginCore) -> None:
    name = mig_names(core)[0]
    c = claim(uid(), [name], requests=["mig"])
    core.add(c)
    prepare(core, c)
    spec = json.loads(core.cdi.path(c["metadata"]["uid"]).read_text())
    validate_cdi(spec)
    paths = [n["path"] for n in spec["devices"][0]["containerEdits"]["deviceNodes"]]
    assert paths[0] == "/dev/nvidia0"
    assert len(paths) == 3 and all(p.startswith("/dev/nvidia-caps/nvidia-cap") for p in paths[1:])
    mig = core.inventory.gpus[0].mig_devices[0]
    assert f"DRA_GPU_VISIBLE_DEVICES={mig.uuid}" in spec["containerEdits"]["env"]


def test_mig_capability_nodes_need_no_host_node(core: PluginCore) -> None:
    """NVML makes no /dev/nvidia-caps nodes on the host: the spec carries them by number (major
    of nvidia-caps in /proc/devices, minor and mode from the capability's access file)."""
    shutil.rmtree(core.root / "devroot/dev/nvidia-caps")
    gpu = core.inventory.gpus[0]
    mig = gpu.mig_devices[0]
    caps = core.root / "devroot/proc/driver/nvidia/capabilities" / f"gpu{gpu.minor}" / "mig"
    gi_access = caps / f"gi{mig.gpu_instance_id}" / "access"
    ci_access = caps / f"gi{mig.gpu_instance_id}" / f"ci{mig.compute_instance_id}" / "access"
    gi_access.write_text("DeviceFileMinor: 21\nDeviceFileMode: 292\nDeviceFileModify: 1\n")
    ci_access.write_text("DeviceFileMinor: 22\nDeviceFileMode: 256\nDeviceFileModify: 1\n")
    c = claim(uid(), [mig_names(core)[0]], requests=["mig"])
    core.add(c)
    prepare(core, c)
    spec = json.loads(core.cdi.path(c["metadata"]["uid"]).read_text())
    validate_cdi(spec)
    assert spec["cdiVersion"] == "0.5.0"  # device names starting with a digit; type/major/minor: 0.3.0
    _, gi_node, ci_node = spec["devices"][0]["containerEdits"]["deviceNodes"]
    assert gi_node == {
        "path": "/dev/nvidia-caps/nvidia-cap21",
        "type": "c",
        "major": SIM_CAPS_MAJOR,
        "minor": 21,
        "permissions": "rw",
        "fileMode": 0o444,
    }
    assert (ci_node["path"], ci_node["minor"], ci_node["fileMode"]) == (
        "/dev/nvidia-caps/nvidia-cap22",
        22,
        0o400,
    )


def test_mig_without_caps_in_the_kernels_device_list_fails_prepare_saying_so(core: PluginCore) -> None:
    proc = _proc_devices(core)
    proc.write_text("\n".join(line for line in proc.read_text().splitlines() if "nvidia-caps" not in line))
    c = claim(uid(), [mig_names(core)[0]], requests=["mig"])
    core.add(c)
    with pytest.raises(PrepareError, match=f"no nvidia-caps character device in {proc}"):
        prepare(core, c)
    _nothing_written(core, c["metadata"]["uid"])


def test_a_mig_capability_file_is_looked_at_on_every_prepare(core: PluginCore) -> None:
    """Read once, its minor is reused; a file that changed is read again, one that is gone (the
    instance was destroyed) fails the prepare naming it."""
    name = mig_names(core)[0]
    gpu = core.inventory.gpus[0]
    mig = gpu.mig_devices[0]
    access = (
        core.root
        / "devroot/proc/driver/nvidia/capabilities"
        / f"gpu{gpu.minor}"
        / "mig"
        / f"gi{mig.gpu_instance_id}"
        / "access"
    )

    def gi_node() -> str:
        c = claim(uid(), [name], requests=["mig"])
        core.add(c)
        prepare(core, c)
        spec = json.loads(core.cdi.path(c["metadata"]["uid"]).read_text())
        asyncio.run(core.preparer.unprepare(ref_of(c)))
        return str(spec["devices"][0]["containerEdits"]["deviceNodes"][1]["path"])

    first = gi_node()
    assert gi_node() == first
    moved = core.root / "devroot/dev/nvidia-caps/nvidia-cap90"
    os.mknod(moved, 0o666 | stat.S_IFCHR, os.makedev(508, 90))
    access.write_text("DeviceFileMinor: 90\nDeviceFileMode: 292\nDeviceFileModify: 1\n")
    assert gi_node() == "/dev/nvidia-caps/nvidia-cap90"
    access.unlink()
    c = claim(uid(), [name], requests=["mig"])
    core.add(c)
    with pytest.raises(PrepareError, match=f"MIG device {mig.uuid}: cannot read {access}"):
        prepare(core, c)


def test_prepare_is_idempotent_and_writes_nothing_the_second_time(core: PluginCore) -> None:
    c = claim(uid(), gpu_names(core)[:1])
    core.add(c)
    first = prepare(core, c)
    u = c["metadata"]["uid"]
    stamps = (core.cdi.path(u).stat().st_mtime_ns, core.checkpoint.path.stat().st_mtime_ns)
    # The record answers: the claim the layer read is not looked at again (here: no allocation).
    again = asyncio.run(core.preparer.prepare(ref_of(c), {"metadata": {"uid": u}}))
    assert again == first
    assert (core.cdi.path(u).stat().st_mtime_ns, core.checkpoint.path.stat().st_mtime_ns) == stamps


def test_device_of_another_prepared_claim_is_refused(core: PluginCore) -> None:
    g = gpu_names(core)[0]
    a, b = claim(uid(), [g], name="trainer"), claim(uid(), [g], name="intruder")
    core.add(a)
    core.add(b)
    prepare(core, a)
    with pytest.raises(PrepareError) as err:
        prepare(core, b)
    assert "default/intruder" in str(err.value) and "default/trainer" in str(err.value)
    assert g in str(err.value)
    assert core.checkpoint.get(b["metadata"]["uid"]) is None
    assert not core.cdi.path(b["metadata"]["uid"]).exists()


@pytest.mark.parametrize(
    "how",
    ["deleted", "replaced", "allocated elsewhere"],
)
def test_a_device_whose_holder_is_gone_from_the_api_goes_to_the_new_claim(core: PluginCore, how: str) -> None:
    """The kubelet's unprepare was lost while the plugin was down: the old claim's record still
    holds the device the scheduler has since given to another claim. Prepare releases it at once
    (the sweeper would only after its grace) and the new claim gets the device."""
    g, other_gpu = gpu_names(core)[:2]
    old, new = claim(uid(), [g], name="finished"), claim(uid(), [g], name="next")
    core.add(old)
    core.add(new)
    prepare(core, old)
    if how == "deleted":
        del core.claims[("default", "finished")]
    elif how == "replaced":
        core.add(claim(uid(), [other_gpu], name="finished"))
    else:
        core.add(claim(old["metadata"]["uid"], [other_gpu], name="finished"))
    assert [d.device_name for d in prepare(core, new)] == [g]
    assert core.checkpoint.get(old["metadata"]["uid"]) is None
    assert not core.cdi.path(old["metadata"]["uid"]).exists()
    assert sorted(core.cdi.owned()) == [new["metadata"]["uid"]]


def test_a_holder_that_cannot_be_looked_up_keeps_its_device(
    core: PluginCore, monkeypatch: pytest.MonkeyPatch
) -> None:
    g = gpu_names(core)[0]
    old, new = claim(uid(), [g], name="finished"), claim(uid(), [g], name="next")
    core.add(old)
    core.add(new)
    prepare(core, old)
    del core.claims[("default", "finished")]
    store_get = core.claims.get_claim

    async def apiserver_down_for_the_holder(namespace: str, name: str):
        if name == "finished":
            raise OSError("connection refused")
        return await store_get(namespace, name)

    monkeypatch.setattr(core.claims, "get_claim", apiserver_down_for_the_holder)
    with pytest.raises(PrepareError, match=f"device {g} is already prepared for claim default/finished"):
        prepare(core, new)
    assert core.checkpoint.get(old["metadata"]["uid"]) is not None
    assert core.cdi.path(old["metadata"]["uid"]).exists()


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda c: c["status"].clear(), "is not allocated"),
        (lambda c: c["metadata"].update(uid="00000000-0000-0000-0000-000000000000"), "got replaced"),
        (
            lambda c: c["status"]["allocation"]["devices"]["results"][0].update(pool="node-b"),
            r"is not on this node \(node-a\)",
        ),
        (
            lambda c: c["status"]["allocation"]["devices"]["results"][0].update(device="gpu-9999"),
            "device gpu-9999 is not published by this node",
        ),
        (
            lambda c: c["status"]["allocation"]["devices"]["results"][0].update(driver="other.io"),
            "has no devices of driver gpu.dra-gpu.io",
        ),
    ],
)
def test_bad_claims_are_refused_with_a_reason(core: PluginCore, mutate, message: str) -> None:
    c = claim(uid(), gpu_names(core)[:1])
    ref = ref_of(c)
    mutate(c)
    core.add(c)
    with pytest.raises(ClaimError, match=message):  # a PrepareError, or the layer's refusal
        asyncio.run(prepare_claim(core.preparer, ref))
    assert core.checkpoint.records() == []


def test_missing_claim_is_refused(core: PluginCore) -> None:
    with pytest.raises(ClaimError, match="default/ghost not found"):
        asyncio.run(prepare_claim(core.preparer, ClaimRef("default", uid(), "ghost")))


def mps(pct: int) -> dict:
    return {
        "apiVersion": API_VERSION,
        "kind": "GpuConfig",
        "sharing": {"strategy": "MPS", "mps": {"defaultActiveThreadPercentage": pct}},
    }


def test_config_precedence_class_then_claim_last_wins(core: PluginCore) -> None:
    g0, g1 = gpu_names(core)[:2]
    config = [
        {"source": "FromClaim", "requests": ["b"], "opaque": {"driver": DRIVER, "parameters": mps(30)}},
        {"source": "FromClass", "requests": [], "opaque": {"driver": DRIVER, "parameters": mps(10)}},
        {"source": "FromClaim", "requests": [], "opaque": {"driver": "other.io", "parameters": {}}},
    ]
    c = claim(uid(), [g0, g1], requests=["a", "b"], config=config)
    core.add(c)
    prepare(core, c)
    spec = json.loads(core.cdi.path(c["metadata"]["uid"]).read_text())
    envs = [d["containerEdits"]["env"] for d in spec["devices"]]
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=10" in envs[0]  # the class default
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=30" in envs[1]  # the claim's, for request b


def test_invalid_config_names_the_field_path(core: PluginCore) -> None:
    config = [{"source": "FromClaim", "requests": [], "opaque": {"driver": DRIVER, "parameters": mps(150)}}]
    c = claim(uid(), gpu_names(core)[:1], config=config)
    core.add(c)
    with pytest.raises(
        PrepareError,
        match=r"config\[0\].opaque.parameters.sharing.mps."
        r"defaultActiveThreadPercentage: must be between 1 and 100",
    ):
        prepare(core, c)


def test_gpu_config_for_a_mig_device_is_refused(core: PluginCore) -> None:
    config = [
        {"source": "FromClaim", "requests": ["mig"], "opaque": {"driver": DRIVER, "parameters": mps(50)}}
    ]
    c = claim(uid(), mig_names(core)[:1], requests=["mig"], config=config)
    core.add(c)
    with pytest.raises(PrepareError, match="GpuConfig cannot configure a MIG device"):
        prepare(core, c)


def test_unprepare_removes_spec_and_record_and_unknown_claims_succeed(core: PluginCore) -> None:
    c = claim(uid(), gpu_names(core)[:1])
    core.add(c)
    prepare(core, c)
    asyncio.run(core.preparer.unprepare(ref_of(c)))
    assert not core.cdi.path(c["metadata"]["uid"]).exists()
    assert core.checkpoint.get(c["metadata"]["uid"]) is None
    asyncio.run(core.preparer.unprepare(ref_of(c)))  # again: still fine
    asyncio.run(core.preparer.unprepare(ClaimRef("x", uid(), "never-seen")))


def test_concurrent_claims_and_repeated_calls(core: PluginCore) -> None:
    names = gpu_names(core) + mig_names(core)
    claims = [claim(uid(), [n]) for n in names]
    for c in claims:
        core.add(c)

    async def run() -> list:
        calls = [prepare_claim(core.preparer, ref_of(c)) for c in claims]
        calls += [prepare_claim(core.preparer, ref_of(claims[0])) for _ in range(5)]  # same claim, 5x
        return await asyncio.gather(*calls)

    results = asyncio.run(run())
    assert [r[0].device_name for r in results[: len(names)]] == names
    assert all(r == results[0] for r in results[len(names) :])
    assert len(core.cdi.owned()) == len(names)
    assert core.preparer.prepared_device_count() == len(names)


def test_racing_claims_for_one_device_prepare_exactly_one(core: PluginCore) -> None:
    g = gpu_names(core)[0]
    claims = [claim(uid(), [g]) for _ in range(8)]
    for c in claims:
        core.add(c)

    async def run() -> list:
        return await asyncio.gather(
            *(prepare_claim(core.preparer, ref_of(c)) for c in claims), return_exceptions=True
        )

    results = asyncio.run(run())
    assert sum(not isinstance(r, Exception) for r in results) == 1
    assert all(isinstance(r, PrepareError) for r in results if isinstance(r, Exception))
    assert len(core.cdi.owned()) == 1


def test_failed_spec_write_rolls_back_and_leaks_nothing(core: PluginCore) -> None:
    g = gpu_names(core)[0]
    c = claim(uid(), [g])
    core.add(c)
    core.cdi.dir.parent.mkdir(parents=True, exist_ok=True)
    core.cdi.dir.write_text("not a directory")  # every spec write now fails
    with pytest.raises(PrepareError, match="cannot write CDI spec"):
        prepare(core, c)
    assert core.checkpoint.get(c["metadata"]["uid"]) is None
    core.cdi.dir.unlink()
    other = claim(uid(), [g])
    core.add(other)
    assert prepare(core, other)[0].device_name == g  # the device was not leaked


def test_restart_reconciles_checkpoint_and_cdi_dir(core: PluginCore) -> None:
    g0, g1, g2 = gpu_names(core)[:3]
    done, lost, half = claim(uid(), [g0]), claim(uid(), [g1]), claim(uid(), [g2])
    for c in (done, lost, half):
        core.add(c)
        prepare(core, c)
    core.cdi.path(lost["metadata"]["uid"]).unlink()  # a spec that vanished
    rec = core.checkpoint.get(half["metadata"]["uid"])
    assert rec is not None
    core.checkpoint.put(half["metadata"]["uid"], {**rec.raw, "state": STARTED})  # crash mid-prepare
    orphan = core.cdi.path(uid())
    orphan.write_text("{}")  # a spec no claim owns
    restarted = core.restart()
    counts = restarted.preparer.reconcile()
    assert counts == {"rolledBack": 1, "rebuilt": 1, "removed": 1}
    assert restarted.cdi.path(lost["metadata"]["uid"]).exists()
    assert not restarted.cdi.path(half["metadata"]["uid"]).exists()
    assert restarted.checkpoint.get(half["metadata"]["uid"]) is None
    assert not orphan.exists()
    assert prepare(restarted, done)[0].device_name == g0  # still prepared after the restart


def test_start_removes_its_own_stale_temp_files_and_nothing_else(core: PluginCore) -> None:
    """Temp files a kill left mid-write (the specs' in the CDI directory, the checkpoint's and the
    health taint book's in the plugin directory) go at the start's reconcile; another program's
    files of any name stay, and so do directories and links of our temp files' naming."""
    c = claim(uid(), gpu_names(core)[:1])
    core.add(c)
    prepare(core, c)
    cdi_dir, plugin_dir = core.cdi.dir, core.checkpoint.path.parent
    ours = [
        cdi_dir / f".{core.cdi.path(uid()).name}.a1b2c3d_.tmp",
        cdi_dir / f".{core.cdi.path(c['metadata']['uid']).name}.zz9_0abc.tmp",
        plugin_dir / ".checkpoint.json.k3j4h5g6.tmp",
        plugin_dir / ".health-taints.json.q1w2e3r4.tmp",
    ]
    foreign = [
        cdi_dir / ".nvidia.yaml.a1b2c3d4.tmp",  # another program's spec, our naming of temps
        cdi_dir / ".k8s.gpu.dra-gpu.io-claim_x.yaml.a1b2c3d4.tmp",  # not a name of ours
        cdi_dir / ".k8s.gpu.dra-gpu.io-claim_x.json.tmp",  # no random part: not mkstemp's
        cdi_dir / "vendor.json",
        plugin_dir / ".checkpoint.json.k3j4h5g6.swp",
        plugin_dir / ".other.json.k3j4h5g6.tmp",
        plugin_dir / "notes",
    ]
    for p in ours + foreign:
        p.write_text("x")
    a_dir = plugin_dir / ".checkpoint.json.d1r2e3c4.tmp"
    a_dir.mkdir()
    a_link = cdi_dir / f".{core.cdi.path(uid()).name}.l1n2k3s4.tmp"
    a_link.symlink_to(plugin_dir / "notes")
    restarted = core.restart()
    assert restarted.preparer.reconcile()["tempsRemoved"] == len(ours)
    assert not any(p.exists() for p in ours)
    assert all(p.exists() for p in foreign) and a_dir.is_dir() and a_link.is_symlink()
    assert prepare(restarted, c)[0].device_name == gpu_names(core)[0]


def test_sweeper_unprepares_claims_gone_for_the_grace_period(core: PluginCore) -> None:
    c = claim(uid(), gpu_names(core)[:1])
    core.add(c)
    prepare(core, c)
    del core.claims[("default", c["metadata"]["name"])]
    clock = [100.0]

    async def sweep() -> list:
        return await core.preparer.sweep(30, now=lambda: clock[0])

    assert asyncio.run(sweep()) == []  # gone, but not for long enough
    clock[0] += 31
    assert asyncio.run(sweep()) == [ref_of(c)]
    assert core.checkpoint.get(c["metadata"]["uid"]) is None


def test_checkpoint_from_another_boot_is_discarded(core: PluginCore, tmp_path: Path) -> None:
    c = claim(uid(), gpu_names(core)[:1])
    core.add(c)
    prepare(core, c)
    assert Checkpoint(core.checkpoint.path, boot_id="boot-1").get(c["metadata"]["uid"])
    assert Checkpoint(core.checkpoint.path, boot_id="boot-2").records() == []


def test_node_name_is_the_pool(core: PluginCore) -> None:
    c = claim(uid(), gpu_names(core)[:1])
    core.add(c)
    assert prepare(core, c)[0].pool_name == NODE


def _nothing_written(core: PluginCore, u: str) -> None:
    assert core.checkpoint.get(u) is None
    assert not core.cdi.path(u).exists()
    assert not list(core.cdi.dir.glob(".*.tmp")) if core.cdi.dir.exists() else True


def test_a_driver_version_mismatch_fails_prepare_naming_both_versions(
    core: PluginCore, tmp_path: Path
) -> None:
    from dra_gpu.plugin.driver_files import DriverFiles
    from tests.driver_root import make_root

    old = make_root(tmp_path / "old-driver", "550.54.15")
    core.preparer.driver_files = DriverFiles(old, core.inventory.driver_version)
    c = claim(uid(), gpu_names(core)[:1])
    core.add(c)
    with pytest.raises(PrepareError, match=r"version mismatch.*kernel module is 570\.124\.06.*550\.54\.15"):
        prepare(core, c)
    _nothing_written(core, c["metadata"]["uid"])


def test_a_missing_control_node_fails_prepare_naming_it(core: PluginCore) -> None:
    path = core.root / "devroot" / "dev" / "nvidiactl"
    path.unlink()
    c = claim(uid(), gpu_names(core)[:1])
    core.add(c)
    with pytest.raises(PrepareError, match=f"device node {path} is missing.*retried"):
        prepare(core, c)
    _nothing_written(core, c["metadata"]["uid"])


def _proc_devices(core: PluginCore) -> Path:
    return core.root / "devroot" / "proc" / "devices"


def test_uvm_nodes_need_no_host_node_while_the_module_is_loaded(core: PluginCore) -> None:
    """The host has no /dev/nvidia-uvm yet (nothing ran nvidia-modprobe -u), but the module is
    loaded: the container gets both uvm nodes by the kernel's numbers."""
    for node in ("nvidia-uvm", "nvidia-uvm-tools"):
        (core.root / "devroot" / "dev" / node).unlink()
    c = claim(uid(), gpu_names(core)[:1])
    core.add(c)
    prepare(core, c)
    spec = json.loads(core.cdi.path(c["metadata"]["uid"]).read_text())
    validate_cdi(spec)
    nodes = {n["path"]: n for n in spec["containerEdits"]["deviceNodes"]}
    major = SIM_UVM_MAJOR
    assert nodes["/dev/nvidia-uvm"] == {
        "path": "/dev/nvidia-uvm",
        "type": "c",
        "major": major,
        "minor": 0,
        "permissions": "rw",
    }
    assert (nodes["/dev/nvidia-uvm-tools"]["major"], nodes["/dev/nvidia-uvm-tools"]["minor"]) == (major, 1)


def test_uvm_module_not_loaded_fails_prepare_naming_the_host_side_fix(core: PluginCore) -> None:
    """A container cannot load nvidia-uvm: prepare says to load it on the host at boot."""
    proc = _proc_devices(core)
    proc.write_text("\n".join(line for line in proc.read_text().splitlines() if "nvidia-uvm" not in line))
    (core.root / "devroot" / "dev" / "nvidia-uvm").unlink()
    c = claim(uid(), gpu_names(core)[:1])
    core.add(c)
    with pytest.raises(
        PrepareError, match=r"nvidia-uvm kernel module is not loaded.*`modprobe nvidia-uvm`.*retried"
    ):
        prepare(core, c)
    _nothing_written(core, c["metadata"]["uid"])


def test_a_missing_gpu_node_fails_prepare_naming_it(core: PluginCore) -> None:
    g = gpu_names(core)[0]
    minor = next(x.minor for x in core.inventory.gpus if x.device_name == g)
    (core.root / "devroot" / "dev" / f"nvidia{minor}").unlink()
    c = claim(uid(), [g])
    core.add(c)
    with pytest.raises(PrepareError, match=f"nvidia{minor} is missing.*nvidia-modprobe -c {minor}"):
        prepare(core, c)
    _nothing_written(core, c["metadata"]["uid"])
