"""Print what NVML answers to every call discovery makes, raw, one line per call.

`python -m dra_gpu.node.nvml_probe [--profile NAME|PATH] [--driver-root DIR]` on a GPU machine
shows what a real driver returns (values, error classes, quirks), so the simulated NVML can be
checked against it (`--profile`: the simulated node's own library, through the same path).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from collections.abc import Callable
from typing import Any


def _show(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    if isinstance(value, ctypes.Structure):
        return {name: _show(getattr(value, name)) for name, *_ in value._fields_}
    if isinstance(value, ctypes.Array):
        return [_show(v) for v in value]
    if isinstance(value, ctypes._SimpleCData):
        return f"{type(value).__name__}({value.value})"
    if isinstance(value, list | tuple):
        return [_show(v) for v in value]
    if isinstance(value, int | float | str | bool) or value is None:
        return value
    return type(value).__name__


def probe(nv: Any) -> None:
    def call(label: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            result = fn(*args)
            print(f"{label} = {json.dumps(_show(result))}")
            return result
        except Exception as exc:
            print(f"{label} ! {type(exc).__name__}: {exc}")
            return None

    nv.nvmlInit()
    try:
        call("nvmlSystemGetDriverVersion", nv.nvmlSystemGetDriverVersion)
        call("nvmlSystemGetCudaDriverVersion", nv.nvmlSystemGetCudaDriverVersion)
        count = call("nvmlDeviceGetCount", nv.nvmlDeviceGetCount) or 0
        for i in range(count):
            h = call(f"[{i}] nvmlDeviceGetHandleByIndex", nv.nvmlDeviceGetHandleByIndex, i)
            if h is None:
                continue
            for name in (
                "nvmlDeviceGetName",
                "nvmlDeviceGetUUID",
                "nvmlDeviceGetMinorNumber",
                "nvmlDeviceGetIndex",
                "nvmlDeviceGetBrand",
                "nvmlDeviceGetArchitecture",
                "nvmlDeviceGetCudaComputeCapability",
                "nvmlDeviceGetMemoryInfo",
                "nvmlDeviceGetPciInfo",
                "nvmlDeviceGetNumaNodeId",
                "nvmlDeviceGetAttributes",
                "nvmlDeviceGetMigMode",
                "nvmlDeviceGetMaxMigDeviceCount",
                "nvmlDeviceIsMigDeviceHandle",
            ):
                call(f"[{i}] {name}", getattr(nv, name), h)
            for link in (0, 1, 17, 18, 35):
                call(f"[{i}] nvmlDeviceGetNvLinkState({link})", nv.nvmlDeviceGetNvLinkState, h, link)
                call(
                    f"[{i}] nvmlDeviceGetNvLinkRemotePciInfo({link})",
                    nv.nvmlDeviceGetNvLinkRemotePciInfo,
                    h,
                    link,
                )
                call(
                    f"[{i}] nvmlDeviceGetNvLinkRemoteDeviceType({link})",
                    nv.nvmlDeviceGetNvLinkRemoteDeviceType,
                    h,
                    link,
                )
            call(
                f"[{i}] nvmlDeviceGetMigDeviceHandleByIndex(0)", nv.nvmlDeviceGetMigDeviceHandleByIndex, h, 0
            )
            call(
                f"[{i}] nvmlDeviceGetGpuInstanceProfileInfo(3_SLICE)",
                nv.nvmlDeviceGetGpuInstanceProfileInfo,
                h,
                2,
            )
            call(
                f"[{i}] nvmlDeviceGetGpuInstanceProfileInfoById(9)",
                nv.nvmlDeviceGetGpuInstanceProfileInfoById,
                h,
                9,
            )
            info = nv.c_nvmlGpuFabricInfoV_t()
            info.version = nv.nvmlGpuFabricInfo_v2
            if (
                call(
                    f"[{i}] nvmlDeviceGetGpuFabricInfoV",
                    nv.nvmlDeviceGetGpuFabricInfoV,
                    h,
                    ctypes.byref(info),
                )
                is not None
            ):
                print(f"[{i}] fabricInfo = {json.dumps(_show(info))}")
            call(
                f"[{i}] nvmlDeviceGetTopologyCommonAncestor(self)",
                nv.nvmlDeviceGetTopologyCommonAncestor,
                h,
                h,
            )
    finally:
        nv.nvmlShutdown()


def main(argv: list[str] | None = None) -> int:
    import tempfile
    from pathlib import Path

    from dra_gpu.discovery.nvml_discovery import NvmlUnavailableError
    from dra_gpu.node.backend import open_backend
    from dra_gpu.node.profiles import NodePreparationError

    p = argparse.ArgumentParser(prog="python -m dra_gpu.node.nvml_probe")
    p.add_argument("--profile", help="probe a simulated node (its simulated driver's NVML)")
    p.add_argument("--driver-root", help="the driver installation whose NVML to load (default: /)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="dra-gpu-probe-") as scratch:
        try:
            backend = open_backend(
                args.profile, Path(args.driver_root) if args.driver_root else None, Path(scratch)
            )
        except (NvmlUnavailableError, NodePreparationError) as exc:
            print(str(exc), file=sys.stderr)
            return 2
        nv = backend.nvml
        try:
            probe(nv)
        except nv.NVMLError as exc:
            print(f"NVML is not available: {exc}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
