"""Whether a node's memory shares are held by the driver (`memory_limits.detect`), asked of the
simulated libnvidia-ml.so.1 of each driver version, as the plugin asks the node's own at start."""

from __future__ import annotations

from pathlib import Path

import pytest

from dra_gpu.plugin.memory_limits import cgroup_v2
from tests.simnode_support import (  # noqa: F401 - fixtures
    devdir_for,
    libcache,
    library,
    needs_root,
    needs_toolchain,
    nvml_h,
    run_child,
)

pytestmark = [needs_toolchain, needs_root]

DETECT = """
from dra_gpu.plugin.memory_limits import detect
from pathlib import Path
pynvml.nvmlInit()
handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
gpus = [(pynvml.nvmlDeviceGetUUID(h), h) for h in handles]
def ask(mode="auto", v2=True, hook="/opt/nvidia-cdi-hook", hooks=None):
    limits = detect(mode=mode, nvml=pynvml, nvml_library=Path(LIB), driver_version=sys.argv[2],
                    gpus=gpus, hook_path=hook, host_driver_root="/", is_cgroup_v2=lambda: v2,
                    hook_subcommands=hooks)
    return (limits.enforcement.kind, limits.enforcement.reason, sorted(limits.unsupported),
            [limits.for_gpu(u).kind for u, _ in gpus])
out({"auto": ask(), "v1": ask(v2=False), "nohook": ask(hook=None), "off": ask(mode="off"),
     "old": ask(hooks=frozenset({"create-symlinks", "update-ldcache"})),
     "new": ask(hooks=frozenset({"create-symlinks", "update-ldcache", "apply-cuda-memory-limits"}))})
"""


@pytest.mark.parametrize("version", ["570.133.20", "580.95.05"])
def test_driver_limits_need_driver_580_cgroup_v2_and_the_hook(
    version: str,
    libcache: Path,  # noqa: F811 - the fixture imported above
    tmp_path: Path,
) -> None:
    lib = library(libcache, "hgx-2x4", version)
    res = run_child(lib, devdir_for(tmp_path / "dev", "hgx-2x4"), DETECT, version)
    if version.startswith("570"):
        kind, reason, _, per_gpu = res["auto"]
        assert kind == "cooperative" and "driver 570.133.20 has no per-cgroup memory limits" in reason
        assert set(per_gpu) == {"cooperative"}
    else:
        assert res["auto"][0] == "driver" and set(res["auto"][3]) == {"driver"}
        assert res["v1"][:2] == (
            "cooperative",
            "the node runs cgroup v1; per-cgroup GPU memory limits need cgroup v2",
        )
        assert res["nohook"][0] == "cooperative" and "--cdi-hook-path" in res["nohook"][1]
        # A hook program without apply-cuda-memory-limits (toolkit before 1.20.1, as it says at start).
        assert res["old"][0] == "cooperative"
        assert res["old"][1].startswith("/opt/nvidia-cdi-hook has no apply-cuda-memory-limits hook")
        assert res["new"][0] == "driver"
    assert res["off"][0] == "cooperative" and "off" in res["off"][1]


def test_a_gpu_whose_driver_answers_not_supported_is_cooperative_alone(
    libcache: Path,  # noqa: F811 - the fixture imported above
    tmp_path: Path,
) -> None:
    lib = library(libcache, "hgx-2x4", "580.95.05")
    env = {"DRA_GPU_SIM_NVML_FAIL": "nvmlDeviceGetMemoryLimits_v1=NotSupported"}
    res = run_child(lib, devdir_for(tmp_path / "dev", "hgx-2x4"), DETECT, "580.95.05", env=env)
    kind, _, unsupported, per_gpu = res["auto"]
    assert kind == "driver" and len(unsupported) == 1  # the injected failure fails one call once
    assert per_gpu.count("cooperative") == 1 and per_gpu.count("driver") == len(per_gpu) - 1


def test_cgroup_v2_is_the_unified_hierarchys_root_file(tmp_path: Path) -> None:
    assert not cgroup_v2(tmp_path)
    (tmp_path / "cgroup.controllers").write_text("cpu memory pids\n")
    assert cgroup_v2(tmp_path)
