"""Human-readable views of an Inventory: the device table, the NVLink matrix, the domains."""

from __future__ import annotations

from dra_gpu.kube.values import format_quantity
from dra_gpu.model.attributes import cuda_major_minor
from dra_gpu.model.inventory import Inventory


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def device_table(inv: Inventory) -> str:
    rows = [["DEVICE", "TYPE", "IDX", "PRODUCT", "MEMORY", "SM", "PCI", "NUMA", "UUID / PROFILE"]]
    for gpu in sorted(inv.gpus, key=lambda g: g.index):
        rows.append(
            [
                gpu.device_name,
                "gpu (dynamic mig)" if gpu.dynamic_mig else "gpu (mig mode)" if gpu.mig_enabled else "gpu",
                str(gpu.index),
                gpu.product_name,
                format_quantity(gpu.memory_bytes) if gpu.memory_bytes else "-",
                str(gpu.multiprocessors or "-"),
                gpu.pci_bus_id,
                "-" if gpu.numa_node is None else str(gpu.numa_node),
                gpu.uuid,
            ]
        )
        for profile in gpu.mig_profiles if gpu.dynamic_mig else []:
            starts = ",".join(map(str, profile.placements))
            rows.append(
                [
                    gpu.mig_name(profile.name, profile.placements[0]).rsplit("-", 1)[0] + f"-{{{starts}}}",
                    "mig (dynamic)",
                    str(gpu.index),
                    f"  {profile.name}",
                    format_quantity(profile.memory_bytes),
                    str(profile.multiprocessors),
                    gpu.pci_bus_id,
                    "-" if gpu.numa_node is None else str(gpu.numa_node),
                    f"made at prepare, placements {starts}",
                ]
            )
        for mig in gpu.mig_devices:
            rows.append(
                [
                    gpu.mig_device_name(mig),
                    "mig",
                    f"{gpu.index}/{mig.gpu_instance_id}",
                    f"  {mig.profile}",
                    format_quantity(mig.memory_bytes),
                    str(mig.multiprocessors),
                    gpu.pci_bus_id,
                    "-" if gpu.numa_node is None else str(gpu.numa_node),
                    mig.uuid,
                ]
            )
    return _table(rows)


def link_matrix(inv: Inventory) -> str:
    """Like `nvidia-smi topo -m`: NV<links> between NVLink peers, else the PCIe distance."""
    gpus = sorted(inv.gpus, key=lambda g: g.index)
    by_bus = {g.pci_bus_id: g for g in gpus}
    # Links through an NVSwitch count as the smaller of the two GPUs' switch link counts.
    direct: dict[tuple[int, int], int] = {}
    switch_links: dict[int, int] = {}
    switch_sets: dict[int, set[str]] = {}
    for g in gpus:
        for link in g.nvlinks:
            peer = by_bus.get(link.remote_pci_bus_id)
            if peer is not None:
                direct[(g.index, peer.index)] = direct.get((g.index, peer.index), 0) + 1
            elif not link.remote_is_gpu:
                switch_links[g.index] = switch_links.get(g.index, 0) + 1
                switch_sets.setdefault(g.index, set()).add(link.remote_pci_bus_id)
    header = [""] + [f"GPU{g.index}" for g in gpus] + ["NVLINK DOMAIN"]
    rows = [header]
    for a in gpus:
        row = [f"GPU{a.index}"]
        for b in gpus:
            if a.index == b.index:
                row.append("X")
            elif (a.index, b.index) in direct:
                row.append(f"NV{direct[(a.index, b.index)]}")
            elif switch_sets.get(a.index, set()) & switch_sets.get(b.index, set()):
                row.append(f"NV{min(switch_links[a.index], switch_links[b.index])}")
            else:
                row.append(inv.pcie_topology.get((a.index, b.index), "SYS"))
        row.append(a.nvlink_domain or "- (MIG mode)")
        rows.append(row)
    return _table(rows)


def domain_list(inv: Inventory) -> str:
    lines = []
    for domain, members in inv.domains().items():
        idx = ",".join(str(g.index) for g in members)
        lines.append(f"{domain}: {len(members)} GPU{'s' if len(members) != 1 else ''} [{idx}]")
    return "\n".join(lines) or "(no whole GPUs)"


def render(inv: Inventory) -> str:
    versions = f"driver {inv.driver_version or '?'}"
    if inv.cuda_driver_version:
        major, minor = cuda_major_minor(inv.cuda_driver_version)
        versions += f", CUDA {major}.{minor}"
    parts = [f"Node {inv.node_name}: {len(inv.gpus)} GPUs ({versions})", "", device_table(inv)]
    if inv.gpus:
        parts += ["", "NVLink matrix (NV<n>: n links, or PCIe: PIX/PXB/PHB/NODE/SYS)", link_matrix(inv)]
    parts += ["", "NVLink domains", domain_list(inv)]
    if inv.skipped:
        parts += ["", "Left out", *inv.skipped]
    return "\n".join(parts)
