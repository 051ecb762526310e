#!/usr/bin/env python3
"""The NVML answers dra-gpu depends on, read through a driver root's own libnvidia-ml.so.1.

    nvml_probe.py LIBRARY [--json OUT]

LIBRARY is loaded by full path (as the plugin loads it); every call goes through NVML's C interface
with ctypes, so the return codes are NVML's own; when `pynvml` is importable it is bound to the same
loaded object (its `CDLL("libnvidia-ml.so.1")` is answered by the SONAME already loaded) and
cross-checks the driver version, the device count and GetAttributes on a whole GPU. Read-only: no
NVML setter is called. Python stdlib only (the function table comes from the checkout's
sim/simnode/exports.py and dra_gpu/discovery/nvml_compat.py, read by path without their
packages' dependencies).

Prints one block per answer and `RESULT nvml: ok|FAIL <reason>`; with --json writes what later
sections need (driver version, GPUs: index, minor, uuid, name).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parents[2]
SUCCESS, NOT_SUPPORTED, NOT_FOUND, TIMEOUT, FUNCTION_NOT_FOUND = 0, 3, 6, 10, 13
FI_RECOVERY_ACTION = 230  # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION
EVENT_TYPES = {
    0x1: "SingleBitEccError",
    0x2: "DoubleBitEccError",
    0x4: "PState",
    0x8: "XidCriticalError",
    0x10: "Clock",
    0x80: "PowerSourceChange",
    0x100: "MigConfigChange",
    0x200: "SingleBitEccErrorStorm",
    0x400: "DramRetirementEvent",
    0x800: "DramRetirementFailure",
    0x1000: "NonFatalPoisonError",
    0x2000: "FatalPoisonError",
    0x4000: "GpuUnavailableError",
    0x8000: "GpuRecoveryAction",
}
RECOVERY_ACTIONS = {0: "NONE", 1: "GPU_RESET", 2: "NODE_REBOOT", 3: "DRAIN_P2P", 4: "DRAIN_AND_RESET"}
COMPUTE_MODES = {0: "DEFAULT", 1: "EXCLUSIVE_THREAD", 2: "PROHIBITED", 3: "EXCLUSIVE_PROCESS"}
FABRIC_STATES = {0: "NOT_SUPPORTED", 1: "NOT_STARTED", 2: "IN_PROGRESS", 3: "COMPLETED"}


class Attributes(ctypes.Structure):  # nvmlDeviceAttributes_t
    _fields_ = [
        ("multiprocessorCount", ctypes.c_uint),
        ("sharedCopyEngineCount", ctypes.c_uint),
        ("sharedDecoderCount", ctypes.c_uint),
        ("sharedEncoderCount", ctypes.c_uint),
        ("sharedJpegCount", ctypes.c_uint),
        ("sharedOfaCount", ctypes.c_uint),
        ("gpuInstanceSliceCount", ctypes.c_uint),
        ("computeInstanceSliceCount", ctypes.c_uint),
        ("memorySizeMB", ctypes.c_ulonglong),
    ]


class FieldValue(ctypes.Structure):  # nvmlFieldValue_t
    _fields_ = [
        ("fieldId", ctypes.c_uint),
        ("scopeId", ctypes.c_uint),
        ("timestamp", ctypes.c_longlong),
        ("latencyUsec", ctypes.c_longlong),
        ("valueType", ctypes.c_int),
        ("nvmlReturn", ctypes.c_int),
        ("value", ctypes.c_ulonglong),  # the union nvmlValue_t (8 bytes); read as its uiVal / ullVal
    ]


class EventData(ctypes.Structure):  # nvmlEventData_t
    _fields_ = [
        ("device", ctypes.c_void_p),
        ("eventType", ctypes.c_ulonglong),
        ("eventData", ctypes.c_ulonglong),
        ("gpuInstanceId", ctypes.c_uint),
        ("computeInstanceId", ctypes.c_uint),
    ]


class FabricInfoV2(ctypes.Structure):  # nvmlGpuFabricInfo_v2_t
    _fields_ = [
        ("version", ctypes.c_uint),
        ("clusterUuid", ctypes.c_ubyte * 16),
        ("status", ctypes.c_int),
        ("cliqueId", ctypes.c_uint),
        ("state", ctypes.c_ubyte),
        ("healthMask", ctypes.c_uint),
    ]


FABRIC_V2 = ctypes.sizeof(FabricInfoV2) | (2 << 24)  # NVML_STRUCT_VERSION(GpuFabricInfo, 2)


def _by_path(name: str, rel: str) -> ModuleType | None:
    """A module of the checkout read by its path (its package's __init__ and deps not imported)."""
    try:
        spec = importlib.util.spec_from_file_location(name, REPO / rel)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        return mod
    except Exception as exc:
        print(f"  (cannot read {rel}: {exc})")
        return None


class Nvml:
    def __init__(self, path: str) -> None:
        self.lib = ctypes.CDLL(path)
        self.lib.nvmlErrorString.restype = ctypes.c_char_p

    def has(self, name: str) -> bool:
        try:
            getattr(self.lib, name)
            return True
        except AttributeError:
            return False

    def call(self, name: str, *args: Any) -> int:
        if not self.has(name):
            return FUNCTION_NOT_FOUND
        return int(getattr(self.lib, name)(*args))

    def err(self, rc: int) -> str:
        if rc == FUNCTION_NOT_FOUND:
            return "13 (function not found in the library)"
        text = self.lib.nvmlErrorString(rc)
        return f"{rc} ({text.decode() if text else '?'})"

    def string(self, name: str, *args: Any, size: int = 96) -> tuple[int, str]:
        buf = ctypes.create_string_buffer(size)
        rc = self.call(name, *args, buf, ctypes.c_uint(size))
        return rc, buf.value.decode(errors="replace")


def decode_events(mask: int) -> str:
    names = [name for bit, name in EVENT_TYPES.items() if mask & bit]
    other = mask & ~sum(EVENT_TYPES)
    return ", ".join(names + ([hex(other)] if other else [])) or "none"


def functions_section(nv: Nvml, version: str, fails: list[str]) -> None:
    exports = _by_path("_rgc_exports", "sim/simnode/exports.py")
    compat = _by_path("_rgc_nvml_compat", "dra_gpu/discovery/nvml_compat.py")
    if exports is None:
        fails.append("the product's NVML function table is not readable")
        return
    first: dict[str, int] = dict(exports.FIRST_DRIVER)
    fallbacks: dict[str, Any] = dict(compat.FALLBACKS) if compat else {}
    try:
        major = int(version.split(".")[0])
    except ValueError:
        major = 0
    names = list(exports.FUNCTIONS)
    missing = [n for n in names if not nv.has(n)]
    print(
        f"  product NVML functions (sim/simnode/exports.py): {len(names) - len(missing)} of "
        f"{len(names)} resolve (dlsym)"
    )
    for name in missing:
        since = first.get(name)
        fb = fallbacks.get(name)
        how = f"; product falls back: {fb.instead}" if fb else ""
        if since is not None and major and major < since:
            print(f"    missing {name}: first in driver {since}, expected missing on {major}{how}")
        else:
            print(f"    MISSING {name}: expected in driver {major}{how}")
            if fb is None:
                fails.append(f"{name} missing without a fallback")
    present_late = [n for n in names if n in first and nv.has(n) and major and major < first[n]]
    for name in present_late:
        print(f"    note: {name} resolves although first expected in driver {first[name]}")


def probe(path: str, out_json: str | None) -> int:
    fails: list[str] = []
    result: dict[str, Any] = {"library": path, "gpus": []}
    try:
        nv = Nvml(path)
    except OSError as exc:
        print(f"  cannot load {path}: {exc}")
        print(f"RESULT nvml: FAIL cannot load {path}")
        return 1
    print(f"  library: {path} (loaded by full path with ctypes)")
    binding = "ctypes only"
    pynvml: Any = None
    try:
        import pynvml as _pynvml

        pynvml = _pynvml
        with pynvml.libLoadLock:
            if pynvml.nvmlLib is None:
                pynvml.nvmlLib = ctypes.CDLL("libnvidia-ml.so.1")  # the SONAME just loaded
        if pynvml.nvmlLib._handle == nv.lib._handle:
            version = getattr(pynvml, "__version__", None)
            if version is None:
                try:
                    from importlib.metadata import version as dist_version

                    version = dist_version("nvidia-ml-py")
                except Exception:
                    version = "?"
            binding = f"ctypes, and pynvml {version} bound to the same object"
        else:
            binding = "ctypes only (pynvml is bound to another libnvidia-ml.so.1)"
            pynvml = None
    except Exception as exc:
        binding = f"ctypes only (pynvml not usable: {exc})"
        pynvml = None
    print(f"  binding: {binding}")

    rc = nv.call("nvmlInit_v2")
    print(f"  nvmlInit_v2: {nv.err(rc)}")
    if rc != SUCCESS:
        functions_section(nv, "0", fails)
        print(f"RESULT nvml: FAIL nvmlInit_v2 answered {nv.err(rc)}")
        return 1
    rc, version = nv.string("nvmlSystemGetDriverVersion")
    print(f"  nvmlSystemGetDriverVersion: {version if rc == SUCCESS else nv.err(rc)}")
    result["driverVersion"] = version if rc == SUCCESS else None
    rc, nvml_version = nv.string("nvmlSystemGetNVMLVersion")
    print(f"  nvmlSystemGetNVMLVersion: {nvml_version if rc == SUCCESS else nv.err(rc)}")
    cuda = ctypes.c_int()
    rc = nv.call("nvmlSystemGetCudaDriverVersion_v2", ctypes.byref(cuda))
    cuda_text = f"{cuda.value // 1000}.{cuda.value % 1000 // 10}" if rc == SUCCESS else nv.err(rc)
    print(f"  nvmlSystemGetCudaDriverVersion_v2: {cuda_text}")
    functions_section(nv, version, fails)

    count = ctypes.c_uint()
    rc = nv.call("nvmlDeviceGetCount_v2", ctypes.byref(count))
    print(f"  nvmlDeviceGetCount_v2: {count.value if rc == SUCCESS else nv.err(rc)}")
    if rc != SUCCESS or count.value == 0:
        fails.append("no GPU")
    attr_whole: list[int] = []
    waits: list[int] = []
    for i in range(count.value if rc == SUCCESS else 0):
        dev = ctypes.c_void_p()
        rc = nv.call("nvmlDeviceGetHandleByIndex_v2", ctypes.c_uint(i), ctypes.byref(dev))
        if rc != SUCCESS:
            print(f"  GPU {i}: handle: {nv.err(rc)}")
            fails.append(f"GPU {i}: no handle")
            continue
        _, name = nv.string("nvmlDeviceGetName", dev)
        _, uuid = nv.string("nvmlDeviceGetUUID", dev)
        minor = ctypes.c_uint()
        nv.call("nvmlDeviceGetMinorNumber", dev, ctypes.byref(minor))
        result["gpus"].append({"index": i, "minor": minor.value, "uuid": uuid, "name": name})
        print(f"  GPU {i}: {name} {uuid} minor {minor.value}")
        if i >= 2:
            print("    (identity only: the answers are read for the first two GPUs)")
            continue
        attrs = Attributes()
        rc = nv.call("nvmlDeviceGetAttributes_v2", dev, ctypes.byref(attrs))
        attr_whole.append(rc)
        print(
            f"    nvmlDeviceGetAttributes_v2 (whole GPU): {nv.err(rc)}"
            + (f", multiprocessorCount {attrs.multiprocessorCount}" if rc == SUCCESS else "")
        )
        current, pending = ctypes.c_uint(), ctypes.c_uint()
        rc = nv.call("nvmlDeviceGetMigMode", dev, ctypes.byref(current), ctypes.byref(pending))
        mig_on = rc == SUCCESS and current.value == 1
        print(
            "    nvmlDeviceGetMigMode: "
            + (f"current {current.value}, pending {pending.value}" if rc == SUCCESS else nv.err(rc))
        )
        mode = ctypes.c_int()
        rc = nv.call("nvmlDeviceGetComputeMode", dev, ctypes.byref(mode))
        print(
            "    nvmlDeviceGetComputeMode: "
            + (COMPUTE_MODES.get(mode.value, str(mode.value)) if rc == SUCCESS else nv.err(rc))
        )
        numa = ctypes.c_int()
        rc = nv.call("nvmlDeviceGetNumaNodeId", dev, ctypes.byref(numa))
        print(f"    nvmlDeviceGetNumaNodeId: {numa.value if rc == SUCCESS else nv.err(rc)}")
        fabric = FabricInfoV2(version=FABRIC_V2)
        rc = nv.call("nvmlDeviceGetGpuFabricInfoV", dev, ctypes.byref(fabric))
        if rc == SUCCESS:
            cluster = bytes(fabric.clusterUuid).hex()
            state = FABRIC_STATES.get(fabric.state, fabric.state)
            print(
                f"    nvmlDeviceGetGpuFabricInfoV (v2): state {state}, status {nv.err(fabric.status)}, "
                f"clique {fabric.cliqueId}, cluster {cluster}"
            )
        else:
            print(f"    nvmlDeviceGetGpuFabricInfoV (v2): {nv.err(rc)}")
        types = ctypes.c_ulonglong()
        rc = nv.call("nvmlDeviceGetSupportedEventTypes", dev, ctypes.byref(types))
        print(
            "    nvmlDeviceGetSupportedEventTypes: "
            + (f"{hex(types.value)} ({decode_events(types.value)})" if rc == SUCCESS else nv.err(rc))
        )
        field = FieldValue(fieldId=FI_RECOVERY_ACTION)
        rc = nv.call("nvmlDeviceGetFieldValues", dev, ctypes.c_int(1), ctypes.byref(field))
        if rc == SUCCESS and field.nvmlReturn == SUCCESS:
            action = field.value & 0xFFFFFFFF
            text = f"{action} ({RECOVERY_ACTIONS.get(action, '?')})"
        else:
            text = nv.err(rc) if rc != SUCCESS else f"field answered {nv.err(field.nvmlReturn)}"
        print(f"    GetFieldValues NVML_FI_DEV_GET_GPU_RECOVERY_ACTION ({FI_RECOVERY_ACTION}): {text}")
        if i == 0 and rc == SUCCESS:
            waits.append(event_wait(nv, dev, types.value))
        if mig_on:
            mig_devices(nv, dev, fails)
    if attr_whole and any(rc != NOT_SUPPORTED for rc in attr_whole):
        fails.append("GetAttributes_v2 on a whole GPU did not answer NOT_SUPPORTED")
    if waits and waits[0] not in (TIMEOUT, SUCCESS):
        fails.append(f"nvmlEventSetWait_v2 answered {nv.err(waits[0])}, not a timeout")
    if pynvml is not None:
        cross_check(pynvml, version, count.value, fails)
    nv.call("nvmlShutdown")
    result["failures"] = fails
    if out_json:
        Path(out_json).write_text(json.dumps(result, indent=2) + "\n")
    print("RESULT nvml: " + (f"FAIL {'; '.join(fails)}" if fails else "ok"))
    return 1 if fails else 0


def event_wait(nv: Nvml, dev: ctypes.c_void_p, supported: int) -> int:
    """An event set for the GPU's XID / ECC / unavailable / recovery events; a 200 ms wait times out."""
    wanted = supported & (0x2 | 0x8 | 0x4000 | 0x8000)
    es = ctypes.c_void_p()
    rc = nv.call("nvmlEventSetCreate", ctypes.byref(es))
    if rc != SUCCESS:
        print(f"    nvmlEventSetCreate: {nv.err(rc)}")
        return rc
    rc = nv.call("nvmlDeviceRegisterEvents", dev, ctypes.c_ulonglong(wanted), es)
    print(f"    nvmlDeviceRegisterEvents ({decode_events(wanted)}): {nv.err(rc)}")
    data = EventData()
    rc = nv.call("nvmlEventSetWait_v2", es, ctypes.byref(data), ctypes.c_uint(200))
    if rc == SUCCESS:
        event = decode_events(data.eventType)
        print(f"    nvmlEventSetWait_v2 (200 ms): an event: {event} data {data.eventData}")
    else:
        expected = " (timed out, as expected)" if rc == TIMEOUT else ""
        print(f"    nvmlEventSetWait_v2 (200 ms): {nv.err(rc)}{expected}")
    nv.call("nvmlEventSetFree", es)
    return rc


def mig_devices(nv: Nvml, dev: ctypes.c_void_p, fails: list[str]) -> None:
    most = ctypes.c_uint()
    rc = nv.call("nvmlDeviceGetMaxMigDeviceCount", dev, ctypes.byref(most))
    found = 0
    for j in range(most.value if rc == SUCCESS else 0):
        mig = ctypes.c_void_p()
        rc = nv.call("nvmlDeviceGetMigDeviceHandleByIndex", dev, ctypes.c_uint(j), ctypes.byref(mig))
        if rc != SUCCESS:
            continue
        found += 1
        _, uuid = nv.string("nvmlDeviceGetUUID", mig)
        attrs = Attributes()
        rc = nv.call("nvmlDeviceGetAttributes_v2", mig, ctypes.byref(attrs))
        detail = (
            (
                f"multiprocessorCount {attrs.multiprocessorCount}, memorySizeMB {attrs.memorySizeMB}, "
                f"gpuInstanceSliceCount {attrs.gpuInstanceSliceCount}"
            )
            if rc == SUCCESS
            else ""
        )
        print(f"    MIG device {j} {uuid}: nvmlDeviceGetAttributes_v2: {nv.err(rc)} {detail}")
        if rc != SUCCESS:
            fails.append(f"GetAttributes_v2 on MIG device {uuid}: {nv.err(rc)}")
    if not found:
        print("    MIG mode on, no MIG device exists: GetAttributes_v2 on a MIG device not read")


def cross_check(pynvml: Any, version: str, count: int, fails: list[str]) -> None:
    try:
        pynvml.nvmlInit()
        got = pynvml.nvmlSystemGetDriverVersion()
        got = got.decode() if isinstance(got, bytes) else got
        n = pynvml.nvmlDeviceGetCount()
        try:
            pynvml.nvmlDeviceGetAttributes_v2(pynvml.nvmlDeviceGetHandleByIndex(0))
            attr = "SUCCESS"
        except pynvml.NVMLError as exc:
            attr = type(exc).__name__
        pynvml.nvmlShutdown()
    except Exception as exc:
        print(f"  pynvml cross-check: {type(exc).__name__}: {exc}")
        fails.append(f"pynvml: {exc}")
        return
    same = got == version and n == count
    print(
        f"  pynvml cross-check: driver {got}, {n} GPUs, GetAttributes_v2(GPU 0) -> {attr}"
        + ("" if same else " (DIFFERS from ctypes)")
    )
    if not same:
        fails.append("pynvml and ctypes disagree")


def main() -> int:
    ap = argparse.ArgumentParser(description="NVML answers through a driver root's libnvidia-ml.so.1")
    ap.add_argument("library")
    ap.add_argument("--json")
    args = ap.parse_args()
    return probe(args.library, args.json)


if __name__ == "__main__":
    sys.exit(main())
