"""What a simulated node's kernel would report, injected from outside the NVML process.

The simulated libnvidia-ml.so.1 reads these files under its device-node directory (the node's
`$DRA_GPU_SIM_DEV_DIR`, default /dev); any process that can write there can inject:

    .nvidia-sim/events/<ns>-<pid>-<n>.event   one event: "<gpu-uuid> <type> <data> <gi> <ci>";
                                               delivered by nvmlEventSetWait(_v2) to every event
                                               set created before it and registered for the type
    .nvidia-sim/lost/<gpu-uuid>               the GPU fell off the bus (NVML_ERROR_GPU_IS_LOST)
    .nvidia-sim/recovery/<gpu-uuid>           NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (a number)
    .nvidia-sim/processes/<uuid>              pids running on a GPU or MIG device, one a line

Every file is written to a temporary name and renamed into place, so a reader never sees half an
event. Event files are boot-scoped like the device directory; `prune_events` removes old ones.
"""

from __future__ import annotations

import itertools
import os
import re
import tempfile
import time
from pathlib import Path

SIM_DIR = ".nvidia-sim"
NO_ID = 0xFFFFFFFF  # gpuInstanceId / computeInstanceId of an event not attributable to MIG

# nvmlEventType* (nvml.h)
EVENT_SINGLE_BIT_ECC = 0x1
EVENT_DOUBLE_BIT_ECC = 0x2
EVENT_XID = 0x8
EVENT_GPU_UNAVAILABLE = 0x4000
EVENT_RECOVERY_ACTION = 0x8000
# nvmlDeviceGpuRecoveryAction_t (nvml.h)
RECOVERY_NONE = 0
RECOVERY_GPU_RESET = 1
RECOVERY_NODE_REBOOT = 2
RECOVERY_DRAIN_P2P = 3
RECOVERY_DRAIN_AND_RESET = 4
RECOVERY_SYSTEM_REBOOT = 7  # the largest the NVML 13 header names

_UUID_RE = re.compile(r"^(GPU|MIG)-[0-9a-fA-F-]{36}$")
_counter = itertools.count()


def sim_dir(devdir: Path | str) -> Path:
    return Path(devdir) / SIM_DIR


def _check_uuid(uuid: str) -> str:
    if not _UUID_RE.match(uuid):
        raise ValueError(f"{uuid!r} is not a GPU or MIG device UUID (GPU-xxxxxxxx-xxxx-...)")
    return uuid


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def inject_event(
    devdir: Path | str, gpu_uuid: str, event_type: int, data: int = 0, gi: int = NO_ID, ci: int = NO_ID
) -> Path:
    """Deliver one NVML event of `gpu_uuid` (a whole GPU's UUID); returns the event file.
    `data` is the XID of an XID event; nvml.h says eventData is 0 for any other event."""
    _check_uuid(gpu_uuid)
    if event_type <= 0 or event_type & (event_type - 1):
        raise ValueError(f"event type {event_type:#x} must be one nvmlEventType bit")
    if event_type != EVENT_XID and data:
        raise ValueError(f"event type {event_type:#x}: eventData is 0 for events other than XIDs")
    name = f"{time.time_ns():020d}-{os.getpid()}-{next(_counter):06d}.event"
    path = sim_dir(devdir) / "events" / name
    _write_atomic(path, f"{gpu_uuid} {event_type} {int(data)} {int(gi)} {int(ci)}\n")
    return path


def inject_xid(devdir: Path | str, gpu_uuid: str, xid: int, gi: int = NO_ID, ci: int = NO_ID) -> Path:
    """An XID error (nvmlEventTypeXidCriticalError, eventData = the XID); MIG-scoped with gi/ci."""
    if xid <= 0:
        raise ValueError(f"XID {xid} must be positive")
    return inject_event(devdir, gpu_uuid, EVENT_XID, xid, gi, ci)


def inject_double_bit_ecc(devdir: Path | str, gpu_uuid: str) -> Path:
    return inject_event(devdir, gpu_uuid, EVENT_DOUBLE_BIT_ECC)


def inject_gpu_unavailable(devdir: Path | str, gpu_uuid: str) -> Path:
    return inject_event(devdir, gpu_uuid, EVENT_GPU_UNAVAILABLE)


def set_recovery_action(devdir: Path | str, gpu_uuid: str, action: int, *, event: bool = True) -> None:
    """NVML_FI_DEV_GET_GPU_RECOVERY_ACTION of the GPU from now on; with `event`, also the
    nvmlEventTypeGpuRecoveryAction event the driver sends with it (its eventData is 0: the
    action is read through the field)."""
    _check_uuid(gpu_uuid)
    if not RECOVERY_NONE <= action <= RECOVERY_SYSTEM_REBOOT:
        raise ValueError(f"recovery action {action} is not an nvmlDeviceGpuRecoveryAction_t (0-7)")
    _write_atomic(sim_dir(devdir) / "recovery" / gpu_uuid, f"{action}\n")
    if event and action != RECOVERY_NONE:
        inject_event(devdir, gpu_uuid, EVENT_RECOVERY_ACTION)


def set_gpu_lost(devdir: Path | str, gpu_uuid: str, lost: bool = True) -> None:
    """A lost GPU answers NVML_ERROR_GPU_IS_LOST to every call on it, event waits included."""
    path = sim_dir(devdir) / "lost" / _check_uuid(gpu_uuid)
    if lost:
        _write_atomic(path, "lost\n")
    else:
        path.unlink(missing_ok=True)


def set_processes(devdir: Path | str, uuid: str, pids: list[int]) -> None:
    """The pids NVML lists as running on a GPU or MIG device (busy devices refuse destruction)."""
    path = sim_dir(devdir) / "processes" / _check_uuid(uuid)
    if pids:
        _write_atomic(path, "".join(f"{int(p)}\n" for p in pids))
    else:
        path.unlink(missing_ok=True)


def prune_events(devdir: Path | str, older_than_s: float = 600.0) -> int:
    """Remove event files older than `older_than_s`; returns how many."""
    events = sim_dir(devdir) / "events"
    cutoff = time.time_ns() - int(older_than_s * 1e9)
    removed = 0
    for path in events.glob("*.event") if events.is_dir() else []:
        stamp = path.name.split("-", 1)[0]
        if stamp.isdigit() and int(stamp) < cutoff:
            path.unlink(missing_ok=True)
            removed += 1
    return removed
