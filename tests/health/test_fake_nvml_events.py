"""The fake NVML's events: registration, delivery to waiting threads, lost GPUs, recovery action."""

from __future__ import annotations

import threading
import time

import pynvml
import pytest
from simnode.fake import FakeNvml
from simnode.profiles import load_profile


@pytest.fixture
def nvml() -> FakeNvml:
    fake = FakeNvml(load_profile("hgx-2x4"))
    fake.nvmlInit()
    return fake


def test_an_injected_xid_wakes_the_waiting_thread(nvml: FakeNvml) -> None:
    h = nvml.nvmlDeviceGetHandleByIndex(2)
    uuid = nvml.nvmlDeviceGetUUID(h)
    es = nvml.nvmlEventSetCreate()
    nvml.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, es)
    with pytest.raises(pynvml.NVMLError_Timeout):
        nvml.nvmlEventSetWait(es, 10)
    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(nvml.nvmlEventSetWait(es, 5000)))
    t.start()
    time.sleep(0.05)
    assert nvml.inject_event(uuid, pynvml.nvmlEventTypeXidCriticalError, 79) == 1
    t.join(2)
    (event,) = got
    assert event.eventData == 79 and event.gpuInstanceId == 0xFFFFFFFF  # type: ignore[attr-defined]
    # Not registered for ECC on this set, and another GPU's events go elsewhere.
    assert nvml.inject_event(uuid, pynvml.nvmlEventTypeDoubleBitEccError) == 0
    other = nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(3))
    assert nvml.inject_event(other, pynvml.nvmlEventTypeXidCriticalError, 79) == 0


def test_a_lost_gpu_answers_gpu_is_lost_until_it_recovers(nvml: FakeNvml) -> None:
    h = nvml.nvmlDeviceGetHandleByIndex(1)
    uuid = nvml.nvmlDeviceGetUUID(h)
    es = nvml.nvmlEventSetCreate()
    nvml.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, es)
    nvml.set_lost(uuid, True)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        nvml.nvmlDeviceGetMemoryInfo(h)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        nvml.nvmlEventSetWait(es, 10)
    nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(0))  # the others are fine
    nvml.set_recovery_action(uuid, pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET)
    nvml.set_lost(uuid, False)
    (value,) = nvml.nvmlDeviceGetFieldValues(h, [pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION])
    assert value.nvmlReturn == 0 and value.value.uiVal == pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET
