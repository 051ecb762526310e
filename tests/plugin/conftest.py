"""A prepared-to-serve plugin core on a simulated node, in a temporary directory."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import referencing
from simnode.fake import discover_node

from dra_gpu.common.durable import temp_target
from dra_gpu.kubeletplugin.claims import ClaimFetcher, ClaimLookup
from dra_gpu.kubeletplugin.driver import ClaimRef
from dra_gpu.model.inventory import Inventory
from dra_gpu.node.catalog import DeviceCatalog
from dra_gpu.plugin.cdi import CdiSpecs
from dra_gpu.plugin.checkpoint import COMPLETED, Checkpoint
from dra_gpu.plugin.device_nodes import DeviceNodes
from dra_gpu.plugin.driver_files import DriverFiles
from dra_gpu.plugin.prepare import Preparer
from dra_gpu.plugin.record import PreparedDevice
from tests.driver_root import make_root
from tests.fake_node import create_simulated, fake_sharing

DRIVER = "gpu.dra-gpu.io"
NODE = "node-a"
PROFILE = "dgx-a100-mig"
SCHEMA_DIR = Path(__file__).parents[1] / "data" / "cdi-schema"


class ClaimStore(dict[tuple[str, str], dict[str, Any]]):
    """ResourceClaims as the apiserver would return them, keyed by (namespace, name).

    The prepare logic is exercised here without an apiserver; the same paths run against a real
    one in e2e/tests.
    """

    async def get_claim(self, namespace: str, name: str) -> dict[str, Any] | None:
        claim = self.get((namespace, name))
        return json.loads(json.dumps(claim)) if claim is not None else None

    async def list_claims(self, keep: Callable[[dict[str, Any]], bool] | None = None) -> list[dict[str, Any]]:
        return [json.loads(json.dumps(c)) for c in self.values() if keep is None or keep(c)]


async def prepare_claim(
    preparer: Preparer, ref: ClaimRef, cache: ClaimLookup | None = None
) -> list[PreparedDevice]:
    """A prepare as the kubelet-plugin layer makes it: the claim read (the watch's `cache`, else the
    preparer's claim source), its UID checked, then the driver's prepare."""
    return await preparer.prepare(ref, await ClaimFetcher(preparer.claims, cache).fetch(ref))


def claim(
    uid: str,
    devices: list[str],
    name: str | None = None,
    namespace: str = "default",
    requests: list[str] | None = None,
    config: list[dict[str, Any]] | None = None,
    node: str = NODE,
    driver: str = DRIVER,
) -> dict[str, Any]:
    requests = requests or ["gpu"] * len(devices)
    return {
        "metadata": {"name": name or f"claim-{uid[:8]}", "namespace": namespace, "uid": uid},
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {"request": r, "driver": driver, "pool": node, "device": d}
                        for r, d in zip(requests, devices, strict=True)
                    ],
                    "config": config or [],
                }
            }
        },
    }


@dataclass
class PluginCore:
    root: Path
    inventory: Inventory
    claims: ClaimStore
    checkpoint: Checkpoint
    cdi: CdiSpecs
    preparer: Preparer
    driver_root: Path

    def add(self, c: dict[str, Any]) -> None:
        self.claims[(c["metadata"]["namespace"], c["metadata"]["name"])] = c

    mps_root: Path = Path("/nonexistent")

    def restart(self, device_metadata: bool | None = None) -> PluginCore:
        """A new plugin process over the same directories (same boot); `device_metadata`: its
        flag (None: this one's)."""
        return make_core(
            self.root,
            self.inventory,
            self.claims,
            self.driver_root,
            boot_id=self.checkpoint.boot_id,
            mps_root=self.mps_root,
            device_metadata=self.preparer.metadata.enabled if device_metadata is None else device_metadata,
        )


def make_core(
    root: Path,
    inventory: Inventory,
    claims: ClaimStore,
    driver_root: Path,
    boot_id: str = "boot-1",
    mps_root: Path | None = None,
    device_metadata: bool = False,
) -> PluginCore:
    checkpoint = Checkpoint(root / "plugin" / "checkpoint.json", boot_id=boot_id)
    cdi = CdiSpecs(root / "cdi", DRIVER)
    driver_files = DriverFiles(driver_root, inventory.driver_version)
    # MPS pipe dirs hold a UNIX socket: a short root keeps its path under 108 bytes.
    mps_root = mps_root or Path(tempfile.mkdtemp(prefix="mps-", dir="/tmp"))
    sharing = fake_sharing(mps_root, driver_files, PROFILE, root / "devroot")
    preparer = Preparer(
        DRIVER,
        NODE,
        DeviceCatalog.build(inventory),
        checkpoint,
        cdi,
        DeviceNodes(root / "devroot"),
        claims,
        driver_files,
        sharing,
        device_metadata=device_metadata,
    )
    return PluginCore(root, inventory, claims, checkpoint, cdi, preparer, driver_root, mps_root)


def temp_files(*directories: Path) -> list[Path]:
    """The temp files of `durable.write_temp` in `directories`: each one a write that was under
    way (between making its temp file and the rename) when its process died."""
    return [p for d in directories if d.is_dir() for p in sorted(d.iterdir()) if temp_target(p.name)]


def slow_renames(pause: float = 0.002) -> None:
    """In a child that `kill_in_a_write` aims at: each rename of a temp file over its target waits
    `pause` seconds first, as on a slow disk. Without fsync a write is over in microseconds, too
    short for most kills to land in it; the state a kill leaves there (the temp file written, not
    renamed) is the one a crash inside a real write leaves."""
    real = os.replace

    def replace(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        if temp_target(os.path.basename(os.fsdecode(src))):
            time.sleep(pause)
        real(src, dst, *args, **kwargs)

    os.replace = replace  # type: ignore[assignment]


def kill_in_a_write(pid: int, directories: Iterable[Path], delay: float = 0.0, timeout: float = 5.0) -> None:
    """SIGKILL `pid` `delay` seconds after one of its writes into `directories` begins (a temp
    file appears where there was none: its rename is still ahead), or at `timeout`. Whether the kill
    did land in the write is what the temp files left behind tell (`temp_files`): on busy cores
    the write may still finish before the signal."""
    dirs = list(directories)

    def writing() -> bool:
        return any(temp_target(e.name) for d in dirs if d.is_dir() for e in os.scandir(d))

    deadline = time.monotonic() + timeout
    for wanted in (False, True):
        while writing() != wanted and time.monotonic() < deadline:
            time.sleep(0.0002)
    time.sleep(delay)
    os.kill(pid, signal.SIGKILL)


def assert_only_live_files(core: PluginCore) -> None:
    """After a start's reconcile: the CDI directory holds exactly the completed claims' spec files
    and the plugin directory exactly the checkpoint's boot mark and the checkpoint (none yet if
    nothing was ever recorded); no temp file, nothing else. (The unit tests' plugin directory holds
    nothing more; on a node it also holds the sockets, the health taint book, the MPS root and
    checkpoints moved aside as corrupt: e2e/tests/test_faults.py.)"""
    completed = {r.uid for r in core.checkpoint.records() if r.state == COMPLETED}
    cdi_dir, plugin_dir = core.cdi.dir, core.checkpoint.path.parent
    in_cdi = sorted(os.listdir(cdi_dir)) if cdi_dir.is_dir() else []
    assert in_cdi == sorted(core.cdi.path(uid).name for uid in completed), f"{cdi_dir}: {in_cdi}"
    in_plugin = sorted(os.listdir(plugin_dir)) if plugin_dir.is_dir() else []
    both = sorted([core.checkpoint.path.name, core.checkpoint.boot_mark.name])
    allowed = [both] if core.checkpoint.records() else [[core.checkpoint.boot_mark.name], both]
    assert in_plugin in allowed, f"{plugin_dir}: {in_plugin}"


def stop_daemons(mps_root: Path) -> None:
    """Leave no MPS daemon of a test behind: kill each process whose pipe directory is under the
    root, unmount the daemons' tmpfs, remove the root."""
    if not mps_root.is_dir():
        return
    prefix = f"CUDA_MPS_PIPE_DIRECTORY={mps_root}/".encode()
    for p in Path("/proc").iterdir():
        with contextlib.suppress(ValueError, OSError):
            if any(e.startswith(prefix) for e in (p / "environ").read_bytes().split(b"\0")):
                os.kill(int(p.name), signal.SIGKILL)
    for top in mps_root.iterdir():
        if os.path.ismount(top):
            subprocess.run(["umount", "-l", str(top)], check=False)
    shutil.rmtree(mps_root, ignore_errors=True)


@pytest.fixture(scope="session")
def driver_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The driver installation of the simulated node's driver version (built once)."""
    inventory = discover_node(NODE, "dgx-a100-mig")
    assert inventory.driver_version
    return make_root(tmp_path_factory.mktemp("driver") / "root", inventory.driver_version)


@pytest.fixture
def core(tmp_path: Path, driver_root: Path) -> Iterator[PluginCore]:
    inventory = discover_node(NODE, PROFILE)
    create_simulated(inventory, tmp_path / "devroot")
    c = make_core(tmp_path, inventory, ClaimStore(), driver_root)
    yield c
    stop_daemons(c.mps_root)
    # The checkpoint encodes each unchanged entry once: no test's flow may have changed an entry
    # in place behind it.
    assert_encoding_is_current(c.checkpoint)


def assert_encoding_is_current(checkpoint: Checkpoint) -> None:
    full = json.dumps(checkpoint._data, sort_keys=True, separators=(",", ":"))
    assert checkpoint._canonical() == full


def gpu_names(core: PluginCore) -> list[str]:
    return [g.device_name for g in core.inventory.gpus if not g.mig_enabled]


def mig_names(core: PluginCore) -> list[str]:
    return [g.mig_device_name(m) for g in core.inventory.gpus for m in g.mig_devices]


def validate_cdi(spec: dict[str, Any]) -> None:
    """Validate against the upstream CDI JSON schema (vendored in tests/data/cdi-schema)."""
    defs = json.loads((SCHEMA_DIR / "defs.json").read_text())
    schema = json.loads((SCHEMA_DIR / "schema.json").read_text())
    registry = referencing.Registry().with_resource(
        "defs.json", referencing.Resource.from_contents(defs, referencing.jsonschema.DRAFT7)
    )
    jsonschema.Draft7Validator(schema, registry=registry).validate(spec)
