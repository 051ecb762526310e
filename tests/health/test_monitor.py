"""The monitor's threads: events, lost GPUs, GPUs whose events cannot be registered."""

from __future__ import annotations

import threading
import time
from typing import Any

import pynvml

from dra_gpu.discovery import FakeNvml, load_profile
from dra_gpu.health.classification import EventKind
from dra_gpu.health.monitor import Monitor, Observation, Seen


class NoEvents(FakeNvml):
    def nvmlDeviceRegisterEvents(self, handle: Any, mask: int, event_set: Any) -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)


def watch(nvml: FakeNvml, seconds: float) -> list[Observation]:
    seen: list[Observation] = []
    lock = threading.Lock()

    def sink(obs: Observation) -> None:
        with lock:
            seen.append(obs)

    uuids = [g.uuid for g in nvml.profile.gpus[:2]]
    monitor = Monitor(nvml, uuids, sink, interval=0.05)
    monitor.start()
    time.sleep(0.2)
    nvml.inject_event(uuids[0], pynvml.nvmlEventTypeXidCriticalError, 94)
    nvml.set_lost(uuids[1], True)
    time.sleep(seconds)
    monitor.stop()
    assert not any(w.thread.is_alive() for w in monitor.watchers)
    return seen


def test_events_liveness_and_lost_gpus() -> None:
    nvml = FakeNvml(load_profile("hgx-2x4"))
    nvml.nvmlInit()
    seen = watch(nvml, 0.3)
    first, second = (g.uuid for g in nvml.profile.gpus[:2])
    events = [o for o in seen if o.seen is Seen.EVENT]
    assert [(o.gpu_uuid, o.kind, o.data) for o in events] == [(first, EventKind.XID, 94)]
    assert any(o.seen is Seen.ALIVE and o.gpu_uuid == first and o.recovery_action == 0 for o in seen)
    assert any(o.seen is Seen.LOST and o.gpu_uuid == second for o in seen)


def test_a_gpu_without_events_is_still_checked() -> None:
    nvml = NoEvents(load_profile("hgx-2x4"))
    nvml.nvmlInit()
    seen = watch(nvml, 0.2)
    first = nvml.profile.gpus[0].uuid
    assert [o.seen for o in seen if o.gpu_uuid == first].count(Seen.UNMONITORED) == 1
    assert sum(o.seen is Seen.ALIVE and o.gpu_uuid == first for o in seen) >= 2
    assert not any(o.seen is Seen.EVENT for o in seen)
