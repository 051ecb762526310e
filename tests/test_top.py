"""`dra-gpu top`: the view of a snapshot (states, owners, shares, taints, MIG) and its two renderings."""

from __future__ import annotations

import json
import re

import pytest

from dra_gpu.fleet.as_json import view_to_json
from dra_gpu.fleet.snapshot import parse_snapshot
from dra_gpu.fleet.text import render_text
from dra_gpu.fleet.view import DomainKind, FleetView, GpuState, GpuView, build_view
from tests.controller.objects import DRIVER
from tests.fleet_cluster import Cluster

GI = 1 << 30
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def view_of(c: Cluster, **filters: str) -> FleetView:
    return build_view(parse_snapshot(DRIVER, c.slices, c.claims, c.pods, c.rules), **filters)  # type: ignore[arg-type]


def gpus(view: FleetView) -> dict[str, GpuView]:
    return {f"{g.node}/{g.name}": g for n in view.nodes for g in n.gpus}


@pytest.fixture
def cluster() -> Cluster:
    """hgx-2x4 with a 4-GPU NVLink claim and one GPU tainted in its slice, a second one by a
    DeviceTaintRule; mixed with memory shares (two shares on one GPU); dgx-a100-mig with one MIG
    device held; dgx-h100-mig (dynamic MIG) with a 3g.40gb placement held."""
    c = Cluster()
    hgx = c.add_node("node-hgx", "hgx-2x4")
    c.hold("team-a", "train", "node-hgx", hgx[:4], pod="trainer-0")
    c.taint_in_slice("node-hgx", hgx[5], f"{DRIVER}/xid", "xid-79", "NoSchedule")
    c.taint_rule("bad-gpu", "node-hgx", hgx[6], "example.com/broken", "NoExecute")
    c.taint_rule("other-pool", "node-elsewhere", hgx[7], "example.com/broken", "NoExecute")
    shared = c.add_node("node-mixed", "mixed", memory_shares=True)
    c.hold("team-b", "infer-0", "node-mixed", shared[:1], pod="infer-0", memory="10Gi")
    c.hold("team-a", "infer-1", "node-mixed", shared[:1], pod="infer-1", memory="20Gi", phase="Pending")
    mig = c.add_node("node-mig", "dgx-a100-mig")
    c.hold("team-b", "small", "node-mig", ["gpu-0000-0f-00-0-mig-1g10gb-5"], pod="small-0")
    c.add_node("node-dyn", "dgx-h100-mig", dynamic_mig=True)
    c.hold("team-a", "half", "node-dyn", ["gpu-0000-18-00-0-mig-3g40gb-4"], pod="half-0")
    assert mig
    return c


def test_whole_gpus_by_nvlink_domain_held_and_free(cluster: Cluster) -> None:
    view = view_of(cluster, node="node-hgx")
    (node,) = view.nodes
    assert [d.kind for d in node.domains] == [DomainKind.NVLINK, DomainKind.NVLINK]
    first, second = node.domains
    assert [g.index for g in first.gpus] == [0, 1, 2, 3] and [g.index for g in second.gpus] == [4, 5, 6, 7]
    assert first.domain != second.domain
    assert {g.state for g in first.gpus} == {GpuState.HELD}
    for g in first.gpus:
        (holder,) = g.holders
        assert (holder.namespace, holder.claim, holder.owner) == ("team-a", "train", "team-a/trainer-0")
    assert {g.state for g in second.gpus} == {GpuState.FREE}
    assert (node.totals.gpus, node.totals.free, node.totals.held, node.totals.tainted) == (8, 4, 4, 2)


def test_taints_from_slices_and_rules_with_their_cause(cluster: Cluster) -> None:
    g = gpus(view_of(cluster, node="node-hgx"))
    tainted = {
        name: [(t.key, t.value, t.effect, t.source) for t in gpu.taints]
        for name, gpu in g.items()
        if gpu.tainted
    }
    assert tainted == {
        "node-hgx/gpu-0000-ab-00-0": [(f"{DRIVER}/xid", "xid-79", "NoSchedule", "slice")],
        "node-hgx/gpu-0000-ba-00-0": [("example.com/broken", "", "NoExecute", "DeviceTaintRule bad-gpu")],
    }


def test_memory_shares_with_the_memory_each_holds(cluster: Cluster) -> None:
    g = gpus(view_of(cluster, node="node-mixed"))["node-mixed/gpu-0000-17-00-0"]
    assert g.state is GpuState.SHARED
    assert sorted((h.namespace, h.claim, h.memory) for h in g.holders) == [
        ("team-a", "infer-1", 20 * GI),
        ("team-b", "infer-0", 10 * GI),
    ]
    assert g.memory == 80 * GI and g.free_memory == 50 * GI
    pending = next(h for h in g.holders if h.claim == "infer-1")
    assert [(p.name, p.phase) for p in pending.pods] == [("infer-1", "Pending")]


def test_premade_mig_instances_used_and_free(cluster: Cluster) -> None:
    view = view_of(cluster, node="node-mig")
    (node,) = view.nodes
    assert [d.kind for d in node.domains] == [DomainKind.NVLINK, DomainKind.MIG]
    g = gpus(view)["node-mig/gpu-0000-0f-00-0"]
    assert g.state is GpuState.MIG and g.mig is not None and not g.mig.dynamic
    (used,) = g.mig.used
    assert (used.device, used.profile, used.holders[0].owner) == (
        "gpu-0000-0f-00-0-mig-1g10gb-5",
        "1g.10gb",
        "team-b/small-0",
    )
    assert dict(g.mig.free) == {"1g.10gb": 2, "2g.20gb": 2}
    assert (node.totals.gpus, node.totals.mig, node.totals.free) == (8, 3, 5)


def test_dynamic_mig_placements_used_and_still_possible(cluster: Cluster) -> None:
    g = gpus(view_of(cluster, node="node-dyn"))["node-dyn/gpu-0000-18-00-0"]
    assert g.mig is not None and g.mig.dynamic
    assert [(u.profile, u.holders[0].owner) for u in g.mig.used] == [("3g.40gb", "team-a/half-0")]
    # 3g.40gb at 4 takes memory slices 4-7: what NVML can still place lies in slices 0-3.
    assert (g.mig.slices_used, g.mig.slices_total) == (4, 8)
    assert dict(g.mig.free) == {"1g.10gb": 4, "1g.20gb": 2, "2g.20gb": 2, "3g.40gb": 1, "4g.40gb": 1}
    other = gpus(view_of(cluster, node="node-dyn"))["node-dyn/gpu-0000-2a-00-0"]
    assert other.mig is not None and dict(other.mig.free)["7g.80gb"] == 1 and other.mig.slices_used == 0


def test_totals_per_model_and_cluster(cluster: Cluster) -> None:
    view = view_of(cluster)
    models = {name: (t.gpus, t.free, t.held, t.shared, t.mig, t.tainted) for name, t in view.models}
    assert models == {
        "NVIDIA A100 80GB PCIe": (2, 1, 0, 1, 0, 0),
        "NVIDIA A100-SXM4-80GB": (8, 5, 0, 0, 3, 0),
        "NVIDIA H100 80GB HBM3": (16, 4, 4, 0, 8, 2),
        "NVIDIA L4": (2, 2, 0, 0, 0, 0),
    }
    assert (view.totals.gpus, view.totals.free, view.totals.tainted) == (28, 12, 2)


def test_namespace_shows_only_its_gpus_and_holders(cluster: Cluster) -> None:
    g = gpus(view_of(cluster, namespace="team-b"))
    assert sorted(g) == ["node-mig/gpu-0000-0f-00-0", "node-mixed/gpu-0000-17-00-0"]
    shared = g["node-mixed/gpu-0000-17-00-0"]
    assert [h.claim for h in shared.holders] == ["infer-0"]
    assert shared.free_memory == 50 * GI  # the other namespace's share still takes its memory


def test_malformed_objects_are_left_out_with_a_reason(cluster: Cluster) -> None:
    bad = cluster.hold("team-c", "broken", "node-hgx", ["gpu-0000-db-00-0"])
    bad["status"]["allocation"]["devices"]["results"] = "not a list"
    cluster.rules.append({"metadata": {"name": "no-taint"}, "spec": {"deviceSelector": {}}})
    view = view_of(cluster, node="node-hgx")
    assert gpus(view)["node-hgx/gpu-0000-db-00-0"].state is GpuState.FREE
    assert any("ResourceClaim team-c/broken" in p and "must be a list" in p for p in view.problems)
    assert any("DeviceTaintRule no-taint" in p and "taint" in p for p in view.problems)


def test_a_malformed_slice_costs_its_own_devices_only(cluster: Cluster) -> None:
    broken = next(s for s in cluster.slices if s["spec"]["pool"]["name"] == "node-mixed")
    broken["spec"]["devices"][1]["attributes"] = ["not", "a", "map"]
    view = view_of(cluster)
    assert "node-mixed" not in [n.name for n in view.nodes] and len(view.nodes) == 3
    assert any(
        p.startswith(
            f"ResourceSlice {broken['metadata']['name']}: spec.devices[1].attributes: must be an object"
        )
        for p in view.problems
    )
    assert "left out: ResourceSlice" in render_text(view)


def test_other_drivers_slices_and_claims_are_not_counted(cluster: Cluster) -> None:
    foreign = json.loads(json.dumps(cluster.slices[0]).replace(DRIVER, "gpu.example.com"))
    foreign["spec"]["pool"]["name"] = foreign["spec"]["nodeName"] = "node-foreign"
    cluster.slices.append(foreign)
    assert "node-foreign" not in [n.name for n in view_of(cluster).nodes]


# ---------------------------------------------------------------- renderings


def test_text_fits_80_columns_and_shows_owners_shares_taints_and_mig(cluster: Cluster) -> None:
    text = render_text(view_of(cluster))
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert not ANSI.search(text)
    row = next(line for line in lines if "gpu-0000-18-00-0" in line and "held" in line)
    assert "team-a/trainer-0 (claim train)" in row
    assert any(re.search(r"shared\s+2 shares, 50Gi of 80Gi free", line) for line in lines)
    assert any(re.search(r"10Gi team-b/infer-0 \(claim infer-0\)", line) for line in lines)
    assert any("20Gi team-a/infer-1 [Pending] (claim infer-1)" in line for line in lines)
    assert any(f"tainted {DRIVER}/xid=xid-79:NoSchedule (slice)" in line for line in lines)
    assert any("tainted example.com/broken:NoExecute (rule bad-gpu)" in line for line in lines)
    assert any(re.search(r"gpu-0000-18-00-0 +mig +1 in use · 4/8 memory slices$", line) for line in lines)
    assert any(re.search(r"gpu-0000-0f-00-0 +mig +1/5 instances in use$", line) for line in lines)
    assert any("3g.40gb  team-a/half-0 (claim half)" in line for line in lines)
    assert any("1g.10gb x2, 2g.20gb x2" in line for line in lines)
    assert "H100 80GB HBM3             16 GPUs: 4 free, 4 held, 8 MIG, 2 tainted" in text


def test_text_gives_long_owners_a_line_of_their_own(cluster: Cluster) -> None:
    owner = "e2e-0274a42a/trainer-with-a-long-name-0 (claim trainer-gpus-c8zhx)"
    namespace, _, rest = owner.partition("/")
    pod = rest.split(" ")[0]
    cluster.hold(namespace, "trainer-gpus-c8zhx", "node-hgx", ["gpu-0000-db-00-0"], pod=pod)
    lines = render_text(view_of(cluster, node="node-hgx")).splitlines()
    assert max(len(line) for line in lines) <= 80
    at = next(i for i, line in enumerate(lines) if "gpu-0000-db-00-0" in line)
    assert re.search(r"held +79.6Gi$", lines[at]) and lines[at + 1].strip() == owner


def test_text_never_prints_control_characters_from_published_attributes(cluster: Cluster) -> None:
    device = cluster.slices[0]["spec"]["devices"][0]
    device["attributes"]["productName"] = {"string": "H100\x1b]0;pwned\x07\x1b[2J"}
    text = render_text(view_of(cluster, node="node-hgx"), colour=True)
    assert "pwned" in text and "\x1b]" not in text and "\x07" not in text and "\x1b[2J" not in text


def test_text_in_colour_colours_states_only_on_request(cluster: Cluster) -> None:
    plain = render_text(view_of(cluster))
    coloured = render_text(view_of(cluster), colour=True)
    assert ANSI.sub("", coloured) == plain
    assert "\x1b[32mfree\x1b[0m" in coloured and "\x1b[1;31m" in coloured


def test_json_has_the_same_facts_as_the_view(cluster: Cluster) -> None:
    view = view_of(cluster)
    doc = json.loads(json.dumps(view_to_json(view)))
    by_name = {f"{n['name']}/{g['name']}": g for n in doc["nodes"] for d in n["domains"] for g in d["gpus"]}
    assert set(by_name) == set(gpus(view))
    shared = by_name["node-mixed/gpu-0000-17-00-0"]
    assert shared["state"] == "shared" and shared["freeMemory"] == 50 * GI
    assert sorted((h["namespace"], h["claim"], h["memory"]) for h in shared["holders"]) == [
        ("team-a", "infer-1", 20 * GI),
        ("team-b", "infer-0", 10 * GI),
    ]
    assert by_name["node-hgx/gpu-0000-ba-00-0"]["taints"] == [
        {"key": "example.com/broken", "value": "", "effect": "NoExecute", "source": "DeviceTaintRule bad-gpu"}
    ]
    held = by_name["node-hgx/gpu-0000-18-00-0"]
    assert held["holders"] == [
        {"namespace": "team-a", "claim": "train", "pods": [{"name": "trainer-0", "phase": "Running"}]}
    ]
    dyn = by_name["node-dyn/gpu-0000-18-00-0"]["mig"]
    assert dyn["used"][0]["device"] == "gpu-0000-18-00-0-mig-3g40gb-4"
    assert (dyn["memorySlicesUsed"], dyn["memorySlices"]) == (4, 8)
    assert doc["totals"]["tainted"] == 2 and doc["models"]["NVIDIA L4"]["free"] == 2


def test_an_mps_claim_is_shown_with_its_daemons_pod(cluster: Cluster) -> None:
    """The plugin runs each MPS daemon as a pod of its own, labelled with the daemon's id (the
    claim's UID and a number): top names it beside the claim, in text and JSON, and the pod read
    filter keeps it though it uses no claim."""
    from dra_gpu.fleet.read import _keep
    from dra_gpu.model.mps_daemon_pods import COMPONENT, COMPONENT_LABEL, DAEMON_LABEL

    claim = next(c for c in cluster.claims if c["metadata"]["name"] == "train")
    daemon = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "dra-gpu-kubelet-plugin-mps-x-0",
            "namespace": "dra-gpu",
            "labels": {COMPONENT_LABEL: COMPONENT, DAEMON_LABEL: f"{claim['metadata']['uid']}-0"},
        },
        "spec": {"nodeName": "node-hgx", "hostPID": True},
        "status": {"phase": "Running"},
    }
    keep = _keep("pods")
    assert keep is not None and keep(daemon) and not keep({"metadata": {"name": "web"}, "spec": {}})
    cluster.pods.append(daemon)
    view = view_of(cluster, node="node-hgx")
    (holder,) = gpus(view)["node-hgx/gpu-0000-18-00-0"].holders
    assert [(d.name, d.phase) for d in holder.mps_daemons] == [
        ("dra-gpu/dra-gpu-kubelet-plugin-mps-x-0", "Running")
    ]
    text = render_text(view, width=200)
    assert "team-a/trainer-0 (claim train, MPS daemon dra-gpu/dra-gpu-kubelet-plugin-mps-x-0)" in text, text
    (held,) = [
        h for n in view_to_json(view)["nodes"] for d in n["domains"] for g in d["gpus"] for h in g["holders"]
    ][:1]
    assert held["mpsDaemons"] == [{"pod": "dra-gpu/dra-gpu-kubelet-plugin-mps-x-0", "phase": "Running"}]
    # Another claim's GPUs name no daemon.
    assert not any(
        h.mps_daemons for g in gpus(view_of(cluster, node="node-mixed")).values() for h in g.holders
    )
