"""What FakeNvml and its mixins share: the handles it gives out, the error raising pynvml does, and
the call wrapper that checks init state and the profile's injected errors before every NVML call.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import pynvml

from simnode.fake_mig import Instance, MigStateError
from simnode.profiles import NODE_FAILURE_ENV, NVML_ERROR_CODES, GpuSpec

F = TypeVar("F", bound=Callable[..., Any])

log = logging.getLogger(__name__)

MAX_MIG_DEVICES = 7
HOPPER = 9
# Full-GI compute-instance profile index by compute slices (NVML_COMPUTE_INSTANCE_PROFILE_*).
CI_PROFILE_BY_SLICES = {1: 0, 2: 1, 3: 2, 4: 3, 7: 4, 8: 5, 6: 6}


def parse_failures(text: str) -> dict[str, int]:
    """`nvmlFunction=ErrorName,...` (names as in a profile's nvmlErrors) -> one-shot failures."""
    out: dict[str, int] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        fn, _, err = item.partition("=")
        if not fn.startswith("nvml") or err not in NVML_ERROR_CODES:
            raise ValueError(
                f"{NODE_FAILURE_ENV}: {item!r} is not nvmlFunction=Error "
                f"(errors: {', '.join(sorted(NVML_ERROR_CODES))})"
            )
        out[fn] = NVML_ERROR_CODES[err]
    return out


class _GpuHandle:
    def __init__(self, spec: GpuSpec) -> None:
        self.spec = spec


class _MigHandle:
    def __init__(self, parent: _GpuHandle, instance: Instance) -> None:
        self.parent = parent
        self.instance = instance
        self.spec = parent.spec  # errors injected on the parent apply to its MIG devices too


class _GpuInstanceHandle:
    def __init__(self, parent: _GpuHandle, instance: Instance) -> None:
        self.parent = parent
        self.instance = instance
        self.spec = parent.spec


class _ComputeInstanceHandle:
    def __init__(self, gi: _GpuInstanceHandle) -> None:
        self.gi = gi
        self.instance = gi.instance
        self.spec = gi.spec


class _Process:
    """What nvmlDeviceGetComputeRunningProcesses lists (the fields dra-gpu reads)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.usedGpuMemory = 0


def _raise(code: int) -> None:
    raise pynvml.NVMLError(code)


def _pci_info(bus_id: str) -> Any:
    """An nvmlPciInfo_t as NVML fills it: upper-case hex, 8-digit domain in `busId` (bytes)."""
    info = pynvml.nvmlPciInfo_t()
    dom, bus, rest = bus_id.split(":")
    dev, fn = rest.split(".")
    info.busId = f"{int(dom, 16):08X}:{int(bus, 16):02X}:{int(dev, 16):02X}.{fn}".encode()
    info.domain, info.bus, info.device = int(dom, 16), int(bus, 16), int(dev, 16)
    return info


def _nvml_call(fn: F) -> F:
    """Checks init state and the profile's injected errors before the call."""

    @functools.wraps(fn)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not self._initialised:
            _raise(pynvml.NVML_ERROR_UNINITIALIZED)
        handle = args[0] if args else None
        spec = getattr(handle, "spec", None)
        code = self._fail_once.pop(fn.__name__, None)
        if code is not None:
            _raise(code)
        if isinstance(spec, GpuSpec):
            code = spec.nvml_errors.get(fn.__name__, spec.nvml_errors.get("*"))
            if code is not None:
                _raise(code)
        self._check_lost(handle)  # a simulated lost GPU (health events)
        code = self.profile.nvml_errors.get(fn.__name__)
        if code is not None:
            _raise(code)
        try:
            return fn(self, *args, **kwargs)
        except MigStateError as exc:
            log.info("simulated nvml refused call=%s reason=%s", fn.__name__, exc)
            raise pynvml.NVMLError(exc.code) from exc

    return wrapper  # type: ignore[return-value]
