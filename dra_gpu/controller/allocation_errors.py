"""Why an allocation could not even be attempted: what the allocator's view and its search raise,
and what `explain`, the diagnosis and the rules tell apart."""

from __future__ import annotations


class AllocationError(RuntimeError):
    """The allocation cannot even be attempted (unknown class, a selector failing at runtime, ...)."""


class UnknownClassError(AllocationError):
    """A request names a DeviceClass that does not exist (it may be created later)."""

    def __init__(self, device_class: str) -> None:
        super().__init__(f"device class {device_class!r} does not exist")
        self.device_class = device_class


class UnmodelledError(AllocationError):
    """A selector uses Kubernetes CEL functions this simulation does not model (valid, not simulated)."""


class SearchLimitError(AllocationError):
    """The search ran out of its step budget (the scheduler has a filter timeout for the same reason)."""
