"""Dynamic MIG in the real cluster: the plugin publishes every MIG placement of the simulated
dgx-h100-mig node as a partitionable device (one counter set per GPU), the real scheduler picks
placements by the counters, and the plugin creates the MIG instance at prepare and destroys it at
unprepare; a plugin killed halfway leaves no orphan."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from simnode.profiles import load_profile
from simnode.state import read_state, reboot
from support import ROOT, wait_for
from test_kubelet_plugin import (
    CDI_DIR,
    DRIVER,
    MIG_CLASS,
    PLUGIN_DIR,
    SIM_DEV,
    Plugin,
    allocated,
    claim_pod,
    ensure_device_classes,
    our_slices,
    template,
)

pytestmark = pytest.mark.e2e

PROFILE = "dgx-h100-mig"
GPU0, GPU1 = "gpu-0000-18-00-0", "gpu-0000-2a-00-0"
SHOW = "ls -l /dev/nvidia-caps/; env | grep -e ^NVIDIA -e ^DRA_GPU; sleep 3600"
FAILPOINT = "mig-after-gpu-instance"


def profile_is(name: str) -> str:
    return f"device.attributes['{DRIVER}'].profile == '{name}'"


def instances(gpu_uuid: str | None = None) -> list[dict]:
    """The simulated GPUs' MIG instances (the state the simulated driver keeps, like the kernel)."""
    doc = read_state(SIM_DEV, load_profile(PROFILE)).instances
    return [i for uuid, insts in doc.items() if gpu_uuid in (None, uuid) for i in insts]


def gpu_uuid(dyn, device: str) -> str:
    """The UUID of a dynamic-MIG GPU, from its placements (the GPU itself is not published)."""
    _, items = our_slices(dyn)
    for s in items:
        for d in s["spec"].get("devices") or []:
            if d["name"].startswith(f"{device}-mig-"):
                return d["attributes"]["parentUUID"]["string"]
    raise AssertionError(f"no device {device}")


def running_log(core, namespace, pod):
    def check():
        if core.read_namespaced_pod(pod, namespace).status.phase != "Running":
            return None
        log = core.read_namespaced_pod_log(pod, namespace)
        return log if "DRA_GPU_VISIBLE_DEVICES=" in log else None

    return wait_for(f"pod {pod} to run and print its devices", check, timeout=120)


def visible(log: str) -> str:
    return next(x for x in log.splitlines() if x.startswith("DRA_GPU_VISIBLE_DEVICES=")).split("=", 1)[1]


def caps_nodes(log: str) -> list[str]:
    return [line for line in log.splitlines() if line.startswith("c") and "nvidia-cap" in line]


def unschedulable(core, namespace, pod) -> str | None:
    """The scheduler's verdict that `pod` cannot be placed now (PodScheduled False, reason
    Unschedulable: it tried the pod against the state it sees), its message; None until then. A
    wrong allocation cannot come later: the pod is tried again only on a change of that state."""
    p = core.read_namespaced_pod(pod, namespace)
    for c in p.status.conditions or []:
        if c.type == "PodScheduled" and c.status == "False" and c.reason == "Unschedulable":
            return c.message or "unschedulable"
    return None


def delete_pods(core, namespace, *pods):
    for pod in pods:
        core.delete_namespaced_pod(pod, namespace, grace_period_seconds=0)


def wait_claims_gone(dyn, namespace):
    """The next test's first fit must not see this test's allocations."""
    claims = dyn.resources.get(api_version="resource.k8s.io/v1", kind="ResourceClaim")
    for c in claims.get(namespace=namespace).to_dict()["items"]:
        if not (c["metadata"].get("ownerReferences")):
            claims.delete(namespace=namespace, name=c["metadata"]["name"])
    wait_for(
        "the test's claims to be gone",
        lambda: not claims.get(namespace=namespace).to_dict()["items"],
        timeout=60,
    )


@pytest.fixture(scope="module")
def mig_plugin(target, core, dyn, tmp_path_factory):
    if not target.local:
        pytest.skip("the plugin runs as a host process only on the local e2e cluster")
    node = core.list_node().items[0].metadata.name
    reboot(SIM_DEV)  # a fresh GPU, as after a reboot
    p = Plugin(target.kubeconfig, node, tmp_path_factory.mktemp("plugin") / "plugin.log")
    p.profile = PROFILE
    p.extra_args = ["--dynamic-mig"]
    ensure_device_classes(dyn)
    p.start()
    wait_for("the dynamic MIG slices", lambda: len(our_slices(dyn)[1]) == 4, timeout=60)
    yield p
    p.stop()
    api, items = our_slices(dyn)
    for s in items:
        api.delete(name=s["metadata"]["name"])
    print(f"\n[e2e] plugin log tail:\n{p.log_tail(15)}")


def test_counters_and_placements_are_published_as_sent(mig_plugin, dyn):
    _, items = our_slices(dyn)
    counters = [s for s in items if s["spec"].get("sharedCounters")]
    devices = [d for s in items for d in s["spec"].get("devices") or []]
    assert len(counters) == 1 and len(counters[0]["spec"]["sharedCounters"]) == 8
    assert len(devices) == 8 * 18 and all(len(s["spec"].get("devices") or []) <= 64 for s in items)
    # The apiserver kept the gated fields (DRAPartitionableDevices is on): nothing dropped.
    assert all(d.get("consumesCounters") for d in devices)
    # Placements only: a GPU in MIG mode without an instance runs no CUDA work, so it is not
    # offered whole.
    assert {d["attributes"]["type"]["string"] for d in devices} == {"mig"}
    assert all(d.get("bindingConditions") == ["MigInstanceReady"] for d in devices)
    assert {s["spec"]["pool"]["resourceSliceCount"] for s in items} == {4}


def test_two_3g_on_one_gpu_and_its_7g_waits(mig_plugin, core, dyn, namespace, busybox_image):
    template(dyn, namespace, "three-g", device_class=MIG_CLASS, selectors=[profile_is("3g.40gb")])
    for pod in ("a", "b"):
        claim_pod(core, namespace, pod, {"resource_claim_template_name": "three-g"}, SHOW, busybox_image)
    logs = {pod: running_log(core, namespace, pod) for pod in ("a", "b")}
    devices = sorted(allocated(dyn, namespace, pod)[0] for pod in ("a", "b"))
    assert devices == [f"{GPU0}-mig-3g40gb-0", f"{GPU0}-mig-3g40gb-4"]
    parent = gpu_uuid(dyn, GPU0)
    live = instances(parent)
    assert sorted((i["profile"], i["placement"]) for i in live) == [("3g.40gb", 0), ("3g.40gb", 4)]
    for pod, log in logs.items():
        assert visible(log) in {i["uuid"] for i in live}, (pod, log)
        caps = caps_nodes(log)
        assert len(caps) == 2 and all(" 508, " in line for line in caps), log  # GI + CI capability
    assert visible(logs["a"]) != visible(logs["b"])

    # All of GPU 0 (its full-GPU profile: a dynamic-MIG GPU is not offered whole) waits for both.
    seven_on_gpu0 = f"{profile_is('7g.80gb')} && device.attributes['{DRIVER}'].parentIndex == 0"
    claims = dyn.resources.get(api_version="resource.k8s.io/v1", kind="ResourceClaim")
    claims.create(
        namespace=namespace,
        body={
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": "whole-gpu0"},
            "spec": {
                "devices": {
                    "requests": [
                        {
                            "name": "gpus",
                            "exactly": {
                                "deviceClassName": MIG_CLASS,
                                "selectors": [{"cel": {"expression": seven_on_gpu0}}],
                            },
                        }
                    ]
                }
            },
        },
    )
    claim_pod(core, namespace, "whole", {"resource_claim_name": "whole-gpu0"}, SHOW, busybox_image)
    wait_for(
        "the scheduler to find no place for the whole GPU 0", lambda: unschedulable(core, namespace, "whole")
    )
    assert core.read_namespaced_pod("whole", namespace).status.phase == "Pending"
    assert not (claims.get(namespace=namespace, name="whole-gpu0").to_dict().get("status") or {}).get(
        "allocation"
    )

    delete_pods(core, namespace, "a", "b")
    # The 7g.80gb instance may be made as soon as both 3g.40gb ones are gone: wait for those only.
    wait_for(
        "both 3g.40gb instances to be destroyed",
        lambda: all(i["profile"] != "3g.40gb" for i in instances(parent)),
        timeout=90,
    )
    log = running_log(core, namespace, "whole")
    (seven,) = instances(parent)
    assert seven["profile"] == "7g.80gb" and visible(log) == seven["uuid"] and len(caps_nodes(log)) == 2
    print(f"\n[e2e] two 3g.40gb on {GPU0}: {', '.join(devices)}; its 7g.80gb scheduled after both ended")
    delete_pods(core, namespace, "whole")
    wait_claims_gone(dyn, namespace)


def test_seven_1g_fill_one_gpu_and_the_eighth_goes_to_the_next(
    mig_plugin, core, dyn, namespace, busybox_image
):
    template(dyn, namespace, "one-g", device_class=MIG_CLASS, selectors=[profile_is("1g.10gb")])
    pods = [f"s{i}" for i in range(8)]
    for pod in pods[:7]:
        claim_pod(
            core, namespace, pod, {"resource_claim_template_name": "one-g"}, "sleep 3600", busybox_image
        )
    first = {
        pod: wait_for(f"{pod} allocated", lambda pod=pod: allocated(dyn, namespace, pod), timeout=60)[0]
        for pod in pods[:7]
    }
    assert sorted(first.values()) == sorted(f"{GPU0}-mig-1g10gb-{s}" for s in range(7))
    claim_pod(
        core, namespace, pods[7], {"resource_claim_template_name": "one-g"}, "sleep 3600", busybox_image
    )
    (eighth,) = wait_for("the eighth allocated", lambda: allocated(dyn, namespace, pods[7]), timeout=60)
    assert eighth == f"{GPU1}-mig-1g10gb-0"

    def all_running():
        return all(core.read_namespaced_pod(p, namespace).status.phase == "Running" for p in pods)

    wait_for("all eight pods running", all_running, timeout=180)
    assert len(instances(gpu_uuid(dyn, GPU0))) == 7 and len(instances(gpu_uuid(dyn, GPU1))) == 1
    print(f"\n[e2e] seven 1g.10gb on {GPU0}, the eighth on {eighth}")
    delete_pods(core, namespace, *pods)
    wait_for("all eight MIG instances to be destroyed", lambda: not instances(), timeout=120)
    wait_claims_gone(dyn, namespace)


def test_a_14gib_model_fits_no_1g_but_runs_on_a_2g(mig_plugin, core, dyn, namespace, busybox_image, tmp_path):
    fits = "device.capacity['gpu.dra-gpu.io'].memory.compareTo(quantity('14Gi')) >= 0"
    claim_file = tmp_path / "claim.yaml"
    claim_file.write_text(
        json.dumps(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaim",
                "metadata": {"name": "model-1g", "namespace": namespace},
                "spec": {
                    "devices": {
                        "requests": [
                            {
                                "name": "model",
                                "exactly": {
                                    "deviceClassName": MIG_CLASS,
                                    "selectors": [
                                        {"cel": {"expression": profile_is("1g.10gb")}},
                                        {"cel": {"expression": fits}},
                                    ],
                                },
                            }
                        ]
                    }
                },
            }
        )
    )
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "dra_gpu.cli",
            "validate",
            "-f",
            str(claim_file),
            "--kubeconfig",
            mig_plugin.kubeconfig,
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1, r.stdout + r.stderr
    assert "unsupported kind" not in r.stdout, r.stdout
    assert (
        "can never be satisfied" in r.stdout and "(1g.10gb)" in r.stdout and "memory >= 14Gi" in r.stdout
    ), r.stdout
    print(f"\n[e2e] validate: {r.stdout.strip()}")
    template(dyn, namespace, "model-2g", device_class=MIG_CLASS, selectors=[profile_is("2g.20gb"), fits])
    claim_pod(core, namespace, "model", {"resource_claim_template_name": "model-2g"}, SHOW, busybox_image)
    log = running_log(core, namespace, "model")
    (device,) = allocated(dyn, namespace, "model")
    assert device == f"{GPU0}-mig-2g20gb-0"
    assert [i["uuid"] for i in instances()] == [visible(log)]
    delete_pods(core, namespace, "model")
    wait_for("the 2g.20gb instance to be destroyed", lambda: not instances(), timeout=90)
    wait_claims_gone(dyn, namespace)


def test_plugin_killed_between_gpu_and_compute_instance(mig_plugin, core, dyn, namespace, busybox_image):
    mig_plugin.stop()
    mig_plugin.env = {"DRA_GPU_FAILPOINTS": f"{FAILPOINT}=kill"}
    mig_plugin.extra_args = [*mig_plugin.extra_args, "--enable-failpoints"]
    mig_plugin.start()
    template(dyn, namespace, "two-g", device_class=MIG_CLASS, selectors=[profile_is("2g.20gb")])
    claim_pod(core, namespace, "crash", {"resource_claim_template_name": "two-g"}, SHOW, busybox_image)
    proc = mig_plugin.proc
    assert proc is not None
    wait_for("the plugin to die at the failpoint", lambda: proc.poll() is not None, timeout=120)
    assert proc.returncode == -9, mig_plugin.log_tail()
    (half,) = instances()
    assert half["ciId"] is None and half["profile"] == "2g.20gb"  # a GPU instance, no compute instance
    checkpoint = json.loads((PLUGIN_DIR / "checkpoint.json").read_text())
    steps = [m["step"] for c in checkpoint["data"]["claims"].values() for m in c.get("migInstances", [])]
    assert steps == ["gpu-instance"]

    mig_plugin.env = {}
    mig_plugin.extra_args = [a for a in mig_plugin.extra_args if a != "--enable-failpoints"]
    mig_plugin.start()
    log = running_log(core, namespace, "crash")
    (made,) = instances()  # the half-made one was rolled back; the kubelet's retry made this one
    assert made["ciId"] == 0 and made["uuid"] == visible(log)
    assert "claim left half-prepared, rolled back" in mig_plugin.log_tail(200)
    (device,) = allocated(dyn, namespace, "crash")
    uid = next(
        c["metadata"]["uid"]
        for c in dyn.resources.get(api_version="resource.k8s.io/v1", kind="ResourceClaim")
        .get(namespace=namespace)
        .to_dict()["items"]
    )
    assert (CDI_DIR / f"k8s.{DRIVER}-claim_{uid}.json").exists()
    print(
        f"\n[e2e] plugin SIGKILLed after the GPU instance of {device}: "
        f"rolled back at restart, the pod got {made['uuid']}"
    )
    delete_pods(core, namespace, "crash")
    wait_for("the instance to be destroyed", lambda: not instances(), timeout=90)
    wait_claims_gone(dyn, namespace)


def test_a_trace_sample_places_as_explain_predicts(mig_plugin, core, dyn, namespace, busybox_image):
    """24 arrivals of bench/mig_fragmentation.py's trace (seed 1, mean life 80: two departures,
    three refusals) through the real scheduler, against the bench's simulation of it."""
    sys.path.insert(0, str(ROOT / "bench"))
    import mig_fragmentation as bench

    arrivals = bench.trace(1, 24, 80)
    predicted = bench.run("two-ended", arrivals)["placements"]
    for profile in {a.profile for a in arrivals}:
        name = "t-" + profile.replace(".", "")
        template(dyn, namespace, name, device_class=MIG_CLASS, selectors=[profile_is(profile)])
    claims = dyn.resources.get(api_version="resource.k8s.io/v1", kind="ResourceClaim")
    live: dict[str, int] = {}  # pod -> the step it leaves at
    got: list[str | None] = []

    def claim_of(pod):
        items = claims.get(namespace=namespace).to_dict()["items"]
        return [c for c in items if pod in [o["name"] for o in c["metadata"].get("ownerReferences") or []]]

    for a, (_, _, want) in zip(arrivals, predicted, strict=True):
        leaving = [p for p, leaves in live.items() if leaves <= a.step]
        for pod in leaving:
            # Bound first: the scheduler holds a pod still waiting in PreBind (binding conditions,
            # checked every 5 s) "in flight" for a while after it is deleted; the bench's pods
            # leave once placed.
            wait_for(f"{pod} bound", lambda pod=pod: core.read_namespaced_pod(pod, namespace).spec.node_name)
            delete_pods(core, namespace, pod)
            del live[pod]
            wait_for(f"{pod}'s claim to go", lambda pod=pod: not claim_of(pod), timeout=60)
        # No pause after the departures: the scheduler tries a pod only once the pod's claim is in
        # its claim cache (the DRA plugin's PreEnqueue holds the pod until then), and that claim is
        # made after the departed claims were gone from the API, so the one watch that feeds the
        # cache (events in resourceVersion order) delivered their deletions first. A refusal is
        # checked below to be the DRA filter's, which looked at that cache.
        pod = f"t{a.step}"
        template_name = "t-" + a.profile.replace(".", "")
        claim_pod(
            core, namespace, pod, {"resource_claim_template_name": template_name}, "sleep 3600", busybox_image
        )
        if want is None:
            verdict = wait_for(
                f"step {a.step}: the scheduler to refuse {a.profile}",
                lambda pod=pod: unschedulable(core, namespace, pod),
            )
            assert "cannot allocate all claims" in verdict, f"step {a.step}: {verdict}"
            assert not allocated(dyn, namespace, pod), (
                f"step {a.step}: {a.profile} was expected to be refused"
            )
            got.append(None)
            delete_pods(core, namespace, pod)
            wait_for(f"{pod}'s claim to go", lambda pod=pod: not claim_of(pod), timeout=60)
            continue
        (device,) = wait_for(
            f"step {a.step}: {a.profile} allocated", lambda pod=pod: allocated(dyn, namespace, pod)
        )
        got.append(device)
        live[pod] = a.leaves
    assert got == [want for _, _, want in predicted]
    refused = sum(1 for d in got if d is None)
    print(
        f"\n[e2e] trace sample: {len(got)} arrivals placed by the real scheduler as explain "
        f"predicted ({refused} refused)"
    )
    delete_pods(core, namespace, *live)
    wait_for("the trace's MIG instances to be destroyed", lambda: not instances(), timeout=120)
    wait_claims_gone(dyn, namespace)


def test_a_failed_creation_sends_the_pod_back_to_the_scheduler(
    mig_plugin, core, dyn, namespace, busybox_image
):
    """The first GPU-instance creation fails (NVML error): the plugin reports MigInstanceFailed
    before the pod is bound, the scheduler gives the allocation up and schedules the pod again,
    and the second attempt makes the instance: the pod never waits on a failing prepare."""
    mig_plugin.stop()
    mig_plugin.env = {"DRA_GPU_SIM_NVML_FAIL": "nvmlDeviceCreateGpuInstanceWithPlacement=Unknown"}
    mig_plugin.start()
    try:
        template(dyn, namespace, "four-g", device_class=MIG_CLASS, selectors=[profile_is("4g.40gb")])
        claim_pod(core, namespace, "retry", {"resource_claim_template_name": "four-g"}, SHOW, busybox_image)
        log = running_log(core, namespace, "retry")
        (made,) = instances()
        assert made["uuid"] == visible(log) and made["profile"] == "4g.40gb"
        tail = mig_plugin.log_tail(400)
        failed = tail.index(f"mig binding condition reported claim={namespace}/")
        assert "=failed" in tail[failed:].splitlines()[0], tail
        assert "=ready" in tail[failed:], tail
        assert "FailedPrepareDynamicResources" not in {
            e.reason for e in core.list_namespaced_event(namespace).items if e.involved_object.name == "retry"
        }
        reasons = sorted({e.reason for e in core.list_namespaced_event(namespace).items})
        print(
            f"\n[e2e] first creation failed, back to the scheduler, made on the next try; events: {reasons}"
        )
        delete_pods(core, namespace, "retry")
        wait_for("the instance to be destroyed", lambda: not instances(), timeout=90)
        wait_claims_gone(dyn, namespace)
    finally:
        mig_plugin.stop()
        mig_plugin.env = {}
        mig_plugin.start()
