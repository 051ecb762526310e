"""bench/nvidia_peer_bench.py's pure parts: the bench node a simulated node can serve, the claims
both plugins get (NVIDIA's opaque config, as dra-gpu decodes it), which device each plugin
publishes for a GPU, the check of each prepare answer, the process tree's CPU, the phase order."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from simnode.profiles import load_profile

from bench.nvidia_peer_bench import (
    NVIDIA,
    Phase,
    ProcStat,
    allocated_status,
    bench_profile,
    claim_body,
    devices_by_uuid,
    parse_levels,
    parse_stat,
    pct,
    phase_orders,
    prepare_error,
    profile_parts,
    profile_top,
    profile_uuids,
    refusal_kind,
    sharing_config,
    split_workers,
    summary,
    tree_ticks,
)
from dra_gpu.kubeletplugin._proto import dra_v1_pb2 as pb
from dra_gpu.model.config import nvidia_v1beta1


def test_bench_profile_is_a_node_of_whole_gpus_the_simulator_serves(tmp_path: Path) -> None:
    path = tmp_path / "bench.yaml"
    path.write_text(yaml.safe_dump(bench_profile(56)))
    node = load_profile(str(path))
    assert len(node.gpus) == 56
    assert [g.uuid for g in node.gpus] == profile_uuids(bench_profile(56))
    assert len({g.uuid for g in node.gpus}) == len({g.pci_bus_id for g in node.gpus}) == 56
    assert not any(g.mig_capable or g.mig_enabled for g in node.gpus)  # whole GPUs only
    assert sorted(g.minor for g in node.gpus) == list(range(56))  # NVIDIA's gpu-<minor> names


def _slice(name: str, driver: str, devices: list[dict[str, Any]]) -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": {"driver": driver, "devices": devices}}


def _dev(name: str, uuid: str | None, key: str = "uuid") -> dict[str, Any]:
    return {"name": name, "attributes": {} if uuid is None else {key: {"string": uuid}}}


def test_devices_by_uuid_matches_each_plugins_names_to_the_same_gpus() -> None:
    nvidia = [_slice("a", NVIDIA, [_dev("gpu-0", "GPU-1"), _dev("gpu-1", "GPU-2")])]
    ours = [
        _slice("b", NVIDIA, [_dev("gpu-18-00-0", "GPU-2", key=f"{NVIDIA}/uuid")]),
        _slice("c", NVIDIA, [_dev("gpu-17-00-0", "GPU-1")]),
        _slice("d", "gpu.example.com", [_dev("dev-0", "GPU-1")]),  # another driver's: not counted
    ]
    theirs, mine = devices_by_uuid(nvidia), devices_by_uuid(ours)
    assert theirs == {"GPU-1": "gpu-0", "GPU-2": "gpu-1"}
    assert mine == {"GPU-1": "gpu-17-00-0", "GPU-2": "gpu-18-00-0"}
    with pytest.raises(ValueError, match="device gpu-9 has no uuid"):
        devices_by_uuid([_slice("e", NVIDIA, [_dev("gpu-9", None)])])
    with pytest.raises(ValueError, match="GPU-1 published as gpu-0 and gpu-3"):
        devices_by_uuid([_slice("f", NVIDIA, [_dev("gpu-0", "GPU-1"), _dev("gpu-3", "GPU-1")])])


@pytest.mark.parametrize("sharing", ["exclusive", "timeslice", "mps"])
def test_claims_carry_nvidias_config_in_spec_and_allocation(sharing: str) -> None:
    params = sharing_config(sharing)
    claim = claim_body("c1", NVIDIA, params)
    status = allocated_status(NVIDIA, "vm", "gpu-3", {"resource": "pods", "name": "p", "uid": "u"}, params)
    assert status["allocation"]["devices"]["results"] == [
        {"request": "gpu", "driver": NVIDIA, "pool": "vm", "device": "gpu-3"}
    ]
    assert status["reservedFor"] == [{"resource": "pods", "name": "p", "uid": "u"}]
    if params is None:
        assert "config" not in claim["spec"]["devices"]
        assert "config" not in status["allocation"]["devices"]
        return
    (spec_cfg,) = claim["spec"]["devices"]["config"]
    (alloc_cfg,) = status["allocation"]["devices"]["config"]
    assert alloc_cfg["source"] == "FromClaim"
    assert spec_cfg["opaque"] == alloc_cfg["opaque"] == {"driver": NVIDIA, "parameters": params}
    decoded = nvidia_v1beta1.decode(params)  # what dra-gpu makes of it, strictly
    assert decoded.sharing.strategy == {"timeslice": "TimeSlicing", "mps": "MPS"}[sharing]


def test_sharing_config_refuses_an_unknown_mode() -> None:
    with pytest.raises(ValueError, match="'shared'"):
        sharing_config("shared")


def _answer(**kw: Any) -> Any:
    return pb.NodePrepareResourceResponse(**kw)


def test_prepare_error_accepts_only_the_allocated_device_with_a_cdi_device() -> None:
    good = pb.Device(request_names=["gpu"], pool_name="vm", device_name="gpu-3", cdi_device_ids=["k8s.x/y=z"])
    assert prepare_error(_answer(devices=[good]), "vm", "gpu-3") is None
    assert prepare_error(None, "vm", "gpu-3") == "no answer for the claim"
    assert prepare_error(_answer(error="boom"), "vm", "gpu-3") == "error: boom"
    assert "want" in (prepare_error(_answer(devices=[good]), "vm", "gpu-4") or "")
    assert "want" in (prepare_error(_answer(devices=[good, good]), "vm", "gpu-3") or "")
    assert "want" in (prepare_error(_answer(devices=[]), "vm", "gpu-3") or "")
    no_cdi = pb.Device(request_names=["gpu"], pool_name="vm", device_name="gpu-3")
    assert "want" in (prepare_error(_answer(devices=[no_cdi]), "vm", "gpu-3") or "")


def test_tree_cpu_counts_live_descendants_and_reaped_children_only() -> None:
    text = "42 (gpu kubelet) plugin) S 1 42 42 0 -1 4194560 0 0 0 0 70 30 5 2 20 0 9 0 1 2 3"
    st = parse_stat(text)
    assert st == ProcStat(ppid=1, own=100, children=7)
    stats = {
        1: ProcStat(0, 1000, 1000),
        42: st,
        43: ProcStat(42, 10, 0),  # a running nvidia-smi
        44: ProcStat(43, 1, 0),  # its child
        50: ProcStat(1, 500, 0),  # not the plugin's
    }
    assert tree_ticks(stats, 42) == 100 + 7 + 10 + 1
    assert tree_ticks(stats, 99) == 0  # gone


def test_split_workers_keeps_that_many_in_flight_over_every_claim() -> None:
    claims = list(range(56))
    for inflight in (1, 8, 56, 100):
        shares = split_workers(claims, inflight)
        assert len(shares) == min(inflight, 56)
        assert sorted(c for s in shares for c in s) == claims


def test_pct_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 201)]
    assert pct(values, 50) == 100.0
    assert pct(values, 99) == 198.0
    assert pct([], 50) != pct([], 50)  # nan


def test_phase_orders_are_random_yet_reproducible() -> None:
    phases = [("dra-gpu", "exclusive"), ("nvidia", "exclusive"), ("floor", "exclusive")]
    a, b = phase_orders(7, 20, phases), phase_orders(7, 20, phases)
    assert a == b
    assert all(sorted(o) == sorted(phases) for o in a)
    assert len({tuple(o) for o in a}) > 1
    assert phase_orders(8, 20, phases) != a


def test_parse_levels() -> None:
    assert parse_levels("1,8,56", 56) == [1, 8, 56]
    for bad in ("", "0", "1,57"):
        with pytest.raises(ValueError, match="--levels"):
            parse_levels(bad, 56)


def test_summary_compares_the_same_runs_phases() -> None:
    def phase(plugin: str, ms: float, cpu: float) -> Phase:
        p = Phase(plugin, "exclusive", [1])
        p.prepare_ms[1] = [ms] * 10
        p.unprepare_ms[1] = [1.0]
        p.cpu_ms = cpu
        return p

    done = [
        (1, phase("dra-gpu", 2.0, 4.0)),
        (1, phase("nvidia", 4.0, 2.0)),
        (2, phase("nvidia", 8.0, 1.0)),
        (2, phase("dra-gpu", 4.0, 3.0)),
        (3, phase("dra-gpu", 1.0, 1.0)),  # no NVIDIA phase in run 3: no ratio
    ]
    lines = summary(done, [1])
    assert lines[0].startswith("dra-gpu exclusive (3 runs): 1 in flight p50 1.00-4.00 p99 1.00-4.00 ms")
    assert lines[1].startswith("nvidia exclusive (2 runs): 1 in flight p50 4.00-8.00")
    assert lines[-1] == (
        "dra-gpu / NVIDIA, exclusive, run by run: 1 in flight p50 0.50 0.50, p99 0.50 0.50; "
        "CPU/claim 2.00 3.00"
    )


def test_refused_prepares_are_counted_by_cause_and_said_in_the_runs_line() -> None:
    lock = (
        "error preparing devices for claim bench-nv-8e8e72/bench-ac6cb5cac5:39fb22ee-34bc-4c8b-b515-"
        "58d852ffbf57: error acquiring prep/unprep lock: timeout acquiring lock "
        "(/tmp/dra-nvidia-bench-abcdefgh/nvidia-plugins/gpu.nvidia.com/pu.lock)"
    )
    other = lock.replace("bench-ac6cb5cac5", "bench-0552cf53f3").replace("39fb22ee", "cd05d0a1")
    assert refusal_kind(lock) == refusal_kind(other)  # one cause, whichever claim
    assert refusal_kind(lock).endswith("timeout acquiring lock (.../pu.lock)")
    p = Phase("nvidia", "timeslice", [1, 56])
    p.prepare_ms = {1: [5.0], 56: [9.0]}
    p.unprepare_ms = {1: [1.0], 56: [1.0]}
    assert "REFUSED" not in p.line(1)
    p.refused = {56: 3}
    p.refusals = {refusal_kind(lock): 3}
    assert "REFUSED 0 at 1 in flight, 3 at 56 in flight (3x error preparing devices" in p.line(1)


LOOP = 'process 1:"python";_run (asyncio/events.py:80)'
PREPARE = f"{LOOP};prepare (dra_gpu/plugin/prepare.py:10)"
COLLAPSED = "\n".join(
    [
        f"{PREPARE};write (dra_gpu/plugin/checkpoint.py:5) 30",
        f"{PREPARE};spec (dra_gpu/plugin/cdi.py:7) 20",
        f"{LOOP};NodePrepareResources (dra_gpu/kubeletplugin/node_service.py:3) 10",
        f"{LOOP};select (selectors.py:1) 40",
        "not a sample line",
    ]
)


def test_a_profile_reads_as_a_breakdown_of_the_prepare_path() -> None:
    # each sample counts once, for the first part its stack touches (checkpoint before prepare)
    assert profile_parts(COLLAPSED) == {"checkpoint": 30, "CDI spec": 20, "gRPC server": 10, "asyncio": 40}
    top = profile_top(COLLAPSED, lines=2)
    assert top[0].startswith("100 samples: asyncio 40 %, checkpoint 30 %, CDI spec 20 %")
    assert top[1:] == [" 40.0 % select (selectors.py:1)", " 30.0 % write (dra_gpu/plugin/checkpoint.py:5)"]
