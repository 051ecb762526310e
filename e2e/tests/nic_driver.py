"""A minimal network DRA driver for the e2e: NICs on PCIe roots of the test's choosing, beside
dra-gpu's GPUs, for claims that ask for a GPU and a NIC on one root (GPUDirect RDMA).

Upstream's example driver (sigs.k8s.io/dra-example-driver v0.4.0) cannot serve here: its `net`
profile publishes NICs with fixed attributes (index, uuid, model, driverVersion), none of them
`resource.kubernetes.io/pcieRoot`, and every NIC shared (allowMultipleAllocations). So this is one
on dra-gpu's own GPU-free kubelet-plugin layer (dra_gpu.kubeletplugin): it publishes one slice of
NICs, each with `resource.kubernetes.io/pcieRoot`, registers with the kubelet as a real plugin and
answers NodePrepareResources for its devices (the kubelet calls every driver of a claim's
allocation, and the pod starts only once each has answered) with a CDI spec per claim that puts
`NIC_PCIE_ROOT_<nic>=<root>` into the container. Nothing is moved into the pod: there is no NIC.

    python e2e/tests/nic_driver.py --node-name NODE --kubeconfig PATH --plugin-dir DIR \
        --registry-dir DIR --cdi-dir DIR --ready-file PATH --nic nic0=pci0000:16 ...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dra_gpu.kube.api import Kube
from dra_gpu.kubeletplugin.driver import ClaimError, ClaimRef, DeviceHealth
from dra_gpu.kubeletplugin.helper import KubeletPluginHelper, Sockets
from dra_gpu.kubeletplugin.metrics import PluginMetrics

DRIVER = "nic.example.com"
PCIE_ROOT = "resource.kubernetes.io/pcieRoot"
CDI_KIND = f"{DRIVER}/nic"

log = logging.getLogger("nic-driver")


@dataclass(frozen=True)
class PreparedNic:
    request_names: Sequence[str]
    pool_name: str
    device_name: str
    cdi_device_ids: Sequence[str]
    share_id: str | None = None


@dataclass
class NicDriver:
    """The dra_gpu.kubeletplugin Driver of the NICs: a slice of them, a CDI spec per claim."""

    node: str
    nics: dict[str, str]  # device name -> its PCIe root
    cdi_dir: Path
    prepared: dict[str, list[PreparedNic]] = field(default_factory=dict)  # by claim UID

    def resource_slices(self, generation: int) -> list[dict[str, Any]]:
        devices = [
            {"name": name, "attributes": {PCIE_ROOT: {"string": root}, "model": {"string": "e2e-nic"}}}
            for name, root in self.nics.items()
        ]
        return [
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceSlice",
                "metadata": {"name": f"{self.node}-{DRIVER}"},
                "spec": {
                    "driver": DRIVER,
                    "nodeName": self.node,
                    "pool": {"name": self.node, "generation": generation, "resourceSliceCount": 1},
                    "devices": devices,
                },
            }
        ]

    def _spec_path(self, uid: str) -> Path:
        return self.cdi_dir / f"{DRIVER}-{uid}.json"

    async def prepare(self, ref: ClaimRef, claim: Mapping[str, Any]) -> Sequence[PreparedNic]:
        if ref.uid in self.prepared:
            return self.prepared[ref.uid]
        allocation = (claim.get("status") or {}).get("allocation") or {}
        results = [
            r for r in (allocation.get("devices") or {}).get("results") or [] if r.get("driver") == DRIVER
        ]
        if not results:
            raise ClaimError(f"claim {ref} has no device of {DRIVER} allocated")
        devices, spec_devices = [], []
        for r in results:
            name = str(r["device"])
            if r.get("pool") != self.node or name not in self.nics:
                raise ClaimError(f"claim {ref}: {r.get('pool')}/{name} is not a NIC of this node")
            cdi_name = f"{ref.uid}-{name}"
            spec_devices.append(
                {"name": cdi_name, "containerEdits": {"env": [f"NIC_PCIE_ROOT_{name}={self.nics[name]}"]}}
            )
            devices.append(PreparedNic([str(r["request"])], self.node, name, [f"{CDI_KIND}={cdi_name}"]))
        path = self._spec_path(ref.uid)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"cdiVersion": "0.5.0", "kind": CDI_KIND, "devices": spec_devices}))
        os.replace(tmp, path)
        self.prepared[ref.uid] = devices
        log.info("prepared claim=%s nics=%s", ref, ",".join(d.device_name for d in devices))
        return devices

    async def unprepare(self, claim: ClaimRef) -> None:
        self._spec_path(claim.uid).unlink(missing_ok=True)
        if self.prepared.pop(claim.uid, None) is not None:
            log.info("unprepared claim=%s", claim)

    def prepared_device_count(self) -> int:
        return sum(len(d) for d in self.prepared.values())

    def device_health(self) -> list[DeviceHealth]:
        return []

    def slice_fields_dropped(self, fields: frozenset[str]) -> None:
        pass


async def serve(args: argparse.Namespace) -> None:
    nics = dict(n.split("=", 1) for n in args.nic)
    driver = NicDriver(args.node_name, nics, Path(args.cdi_dir))
    Path(args.cdi_dir).mkdir(parents=True, exist_ok=True)
    kube = await Kube.connect(args.kubeconfig)
    sockets = Sockets.for_driver(DRIVER, Path(args.plugin_dir), Path(args.registry_dir))
    helper = KubeletPluginHelper(DRIVER, args.node_name, driver, kube, sockets, PluginMetrics())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await helper.start()
    log.info("serving driver=%s node=%s nics=%s", DRIVER, args.node_name, nics)
    try:
        await asyncio.wait_for(helper.registration.registered.wait(), timeout=60)
        Path(args.ready_file).write_text("registered\n")
        log.info("registered with the kubelet")
        await stop.wait()
    finally:
        await helper.stop()
        await kube.close()
        log.info("stopped")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--node-name", required=True)
    p.add_argument("--kubeconfig", required=True)
    p.add_argument("--plugin-dir", required=True)
    p.add_argument("--registry-dir", required=True)
    p.add_argument("--cdi-dir", required=True)
    p.add_argument("--ready-file", required=True, help="written once the kubelet confirmed the registration")
    p.add_argument("--nic", action="append", required=True, metavar="NAME=ROOT", help="a NIC on a PCIe root")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    asyncio.run(serve(p.parse_args()))


if __name__ == "__main__":
    main()
