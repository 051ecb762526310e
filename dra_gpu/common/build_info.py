"""What every dra-gpu process exports beside its own metrics: `dra_gpu_build_info` (the version
and component, and the node for a node's process, to join other series on) and the process's own
CPU, memory and file descriptors (`process_*`, from /proc)."""

from __future__ import annotations

import platform

from prometheus_client import CollectorRegistry, Info, ProcessCollector

from dra_gpu.common.version import VERSION


def register_build_info(registry: CollectorRegistry, component: str, node: str = "") -> None:
    info = Info("dra_gpu_build", "The running dra-gpu's version and component.", registry=registry)
    labels = {"version": VERSION, "component": component, "python": platform.python_version()}
    info.info({**labels, "node": node} if node else labels)
    ProcessCollector(registry=registry)
