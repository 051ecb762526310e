"""A rollout of the chart's kubelet-plugin DaemonSet with live claim pods, measured from both
sides: once with the old strategy (maxUnavailable 100%: the old pod goes, then the new one
starts) and once with the chart's (maxSurge 1: the new pod registers beside the old one under
its own socket names, the kubelet sends its calls to it, then the old one stops). A time-sliced
pod runs through both: it is never restarted and its GPU's time slice is never reset.

While each rollout runs, GPU pods are created one after another (a claim each) and a prober
calls an empty NodePrepareResources every 50 ms on each plugin instance registered in the
kubelet's registry directory. Measured: the longest stretch in which no instance answered, the
pods' FailedPrepareDynamicResources events, and each pod's wait from being scheduled to its
container's start. The chart's strategy must leave no failed prepare and no stretch longer than
a second. Measured (simulated hgx-2x4 node): maxUnavailable 100%, 2.1 s unanswered, 2 pods'
prepares failed ("DRA driver gpu.dra-gpu.io is not registered"), the longest pod wait 14 s (the
kubelet's retry backoff); maxSurge 1, nothing unanswered (0 of 313 probes), no failed prepare,
the longest pod wait 1 s.

As in test_deploy_daemonset.py the pods run with hostNetwork (the e2e cluster has no kube-proxy),
where two plugin pods on one node would both bind the plugin's HTTP port: here the HTTP endpoint
is off and the probes are exec probes that make the same self-check (GetInfo on the pod's own
registration socket, an empty NodePrepareResources on its DRA socket)."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path

import grpc
import pytest
from support import (
    apiserver_port,
    apply_all,
    delete_all,
    reach_apiserver,
    simulated_node_chart,
    wait_for,
    wait_ready_pod,
)
from test_kubelet_plugin import device_attrs
from test_sharing import time_slice, time_sliced_claim

from dra_gpu.kubeletplugin._proto import dra_v1_pb2 as v1_pb
from dra_gpu.kubeletplugin._proto import dra_v1_pb2_grpc as v1_grpc
from dra_gpu.kubeletplugin._proto import pluginregistration_v1_pb2 as reg_pb
from dra_gpu.kubeletplugin._proto import pluginregistration_v1_pb2_grpc as reg_grpc

pytestmark = pytest.mark.e2e

DRIVER = "gpu.dra-gpu.io"
LABEL = "nvidia.com/gpu.present"
KUBELET_ROOT = Path(os.environ.get("DRA_GPU_E2E_KUBELET_ROOT", "/var/lib/kubelet"))
REGISTRY = KUBELET_ROOT / "plugins_registry"
PROBE_SECONDS = 0.05
POD_EVERY_SECONDS = 1.5
NEW_BOUND_SECONDS = 1.0  # the longest stretch the chart's strategy may leave unanswered

# The pod's own self-check, as /healthz makes it (an exec probe: no port to share on the host).
SELF_CHECK = """
import asyncio, os, sys
from pathlib import Path
from dra_gpu.kubeletplugin.helper import Sockets
from dra_gpu.kubeletplugin.self_check import SelfCheck
d = os.environ["DRIVER_NAME"]
s = Sockets.for_instance(d, Path(os.environ["DRA_GPU_PLUGIN_DIR"]), Path(os.environ["DRA_GPU_REGISTRY_DIR"]),
                         os.environ.get("POD_UID", ""))
async def main():
    check = SelfCheck(s.registration, s.dra, d)
    problem = await check.check(3.0)
    await check.close()
    sys.exit(f"unhealthy: {problem}" if problem else 0)
asyncio.run(main())
"""


def _exec_probes(ds: dict) -> None:
    c = ds["spec"]["template"]["spec"]["containers"][0]
    c.pop("ports", None)
    for e in c["env"]:
        if e["name"] == "DRA_GPU_HTTP_ADDRESS":
            e["value"] = ""
    probe = {"exec": {"command": ["python3", "-c", SELF_CHECK]}, "timeoutSeconds": 10}
    c["startupProbe"] = {**probe, "periodSeconds": 2, "failureThreshold": 150}
    c["readinessProbe"] = {**probe, "periodSeconds": 2}
    c["livenessProbe"] = {**probe, "periodSeconds": 30, "failureThreshold": 3}


class Prober:
    """An empty NodePrepareResources on every registered instance of the driver, every 50 ms;
    `longest()`: the longest stretch in which none answered."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.samples: list[tuple[float, bool]] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _answers(reg: Path) -> bool:
        try:
            with grpc.insecure_channel(f"unix://{reg}") as ch:
                info = reg_grpc.RegistrationStub(ch).GetInfo(reg_pb.InfoRequest(), timeout=0.5)
            with grpc.insecure_channel(f"unix://{info.endpoint}") as ch:
                v1_grpc.DRAPluginStub(ch).NodePrepareResources(
                    v1_pb.NodePrepareResourcesRequest(), timeout=0.5
                )
            return True
        except grpc.RpcError:
            return False

    def _run(self) -> None:
        while not self.stop.is_set():
            regs = [REGISTRY / n for n in os.listdir(REGISTRY) if n.startswith(f"{DRIVER}-")]
            self.samples.append((time.monotonic(), any(self._answers(r) for r in regs)))
            time.sleep(PROBE_SECONDS)

    def longest(self) -> float:
        longest, since = 0.0, None
        for t, ok in self.samples:
            if not ok and since is None:
                since = t
            elif ok and since is not None:
                longest, since = max(longest, t - since), None
        if since is not None:
            longest = max(longest, self.samples[-1][0] - since)
        return longest


class ClaimPods:
    """One GPU pod after another, each with its own claim (from one template); finished pods are
    deleted so their GPUs come back."""

    def __init__(self, core, namespace: str, prefix: str, image: str) -> None:
        self.core, self.namespace, self.prefix, self.image = core, namespace, prefix, image
        self.stop = threading.Event()
        self.names: list[str] = []
        self.errors: list[str] = []
        self.waits: dict[str, float] = {}  # pod -> seconds from scheduled to its container's start
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            name = f"{self.prefix}-{len(self.names)}"
            body = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": name, "labels": {"e2e-roll": self.prefix}},
                "spec": {
                    "restartPolicy": "Never",
                    "terminationGracePeriodSeconds": 1,
                    "containers": [
                        {
                            "name": "ctr",
                            "image": self.image,
                            "command": ["true"],
                            "resources": {"claims": [{"name": "gpu"}]},
                        }
                    ],
                    "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "roll-gpu"}],
                },
            }
            try:
                self.core.create_namespaced_pod(self.namespace, body)
                self.names.append(name)
            except Exception as exc:
                self.errors.append(str(exc))
            self._reap()
            self.stop.wait(POD_EVERY_SECONDS)

    def _reap(self) -> None:
        for pod in self.core.list_namespaced_pod(
            self.namespace, label_selector=f"e2e-roll={self.prefix}"
        ).items:
            if pod.status.phase in ("Succeeded", "Failed") and not pod.metadata.deletion_timestamp:
                self.waits[pod.metadata.name] = _wait(pod)
                with contextlib.suppress(Exception):
                    self.core.delete_namespaced_pod(pod.metadata.name, self.namespace, grace_period_seconds=0)


def _wait(pod) -> float:
    """Seconds from the pod's scheduling to its container's start (the API's 1 s resolution):
    the kubelet's prepare, with its retries, lies in between."""
    scheduled = next(c.last_transition_time for c in pod.status.conditions if c.type == "PodScheduled")
    (status,) = pod.status.container_statuses
    started = status.state.terminated.started_at if status.state.terminated else None
    return (started - scheduled).total_seconds() if started else float("nan")


def _roll(apps, namespace: str, name: str, n: int) -> None:
    apps.patch_namespaced_daemon_set(
        name, namespace, {"spec": {"template": {"metadata": {"annotations": {"e2e/roll": str(n)}}}}}
    )


def _rolled(apps, core, namespace: str, name: str, selector: str) -> bool:
    ds = apps.read_namespaced_daemon_set(name, namespace)
    s = ds.status
    pods = core.list_namespaced_pod(namespace, label_selector=selector).items
    return bool(
        s.observed_generation >= ds.metadata.generation
        and s.updated_number_scheduled == s.desired_number_scheduled
        and s.number_available == s.desired_number_scheduled
        and len(pods) == s.desired_number_scheduled
    )


def _start_sliced_pod(core, dyn, namespace: str, image: str) -> str:
    """The pod of claim `sliced`, running; its GPU's UUID (its time slice set: Long)."""
    core.create_namespaced_pod(
        namespace,
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "sliced"},
            "spec": {
                "terminationGracePeriodSeconds": 0,
                "containers": [
                    {
                        "name": "ctr",
                        "image": image,
                        "command": ["sleep", "3600"],
                        "resources": {"claims": [{"name": "gpu"}]},
                    }
                ],
                "resourceClaims": [{"name": "gpu", "resourceClaimName": "sliced"}],
            },
        },
    )
    wait_for(
        "the time-sliced pod to run",
        lambda: core.read_namespaced_pod("sliced", namespace).status.phase == "Running",
        120,
        0.5,
    )
    claims = dyn.resources.get(api_version="resource.k8s.io/v1", kind="ResourceClaim")
    (result,) = claims.get(namespace=namespace, name="sliced").to_dict()["status"]["allocation"]["devices"][
        "results"
    ]
    uuid = device_attrs(dyn)[result["device"]]["uuid"]
    assert "Timeslice 3 (LONG)" in time_slice(uuid), time_slice(uuid)
    return uuid


def _measure(apps, core, namespace, ds_name, selector, n, prober_label, image):
    """Roll the DaemonSet with claim pods coming; returns the figures."""
    prober, pods = Prober(), ClaimPods(core, namespace, f"p{n}", image)
    prober.thread.start()
    pods.thread.start()
    try:
        time.sleep(4)  # a steady state first
        t0 = time.monotonic()
        _roll(apps, namespace, ds_name, n)
        time.sleep(2)
        wait_for(
            f"the {prober_label} rollout", lambda: _rolled(apps, core, namespace, ds_name, selector), 240, 1
        )
        rollout = time.monotonic() - t0
        time.sleep(6)  # pods made at the end of it get their prepare too
    finally:
        pods.stop.set()
        pods.thread.join(30)
        prober.stop.set()
        prober.thread.join(10)

    def all_done() -> bool:
        got = core.list_namespaced_pod(namespace, label_selector=f"e2e-roll={pods.prefix}").items
        return all(p.status.phase in ("Succeeded", "Failed") or p.metadata.deletion_timestamp for p in got)

    try:
        wait_for(f"the claim pods of the {prober_label} rollout", all_done, 180, 1)
        pods._reap()
    except AssertionError:
        left = core.list_namespaced_pod(namespace, label_selector=f"e2e-roll={pods.prefix}").items
        said = [
            f"{e.involved_object.name} {e.reason}: {(e.message or '')[:200]}"
            for e in core.list_namespaced_event(namespace).items
            if e.type == "Warning"
        ]
        raise AssertionError(
            "claim pods not done: "
            + "; ".join(
                f"{q.metadata.name} {q.status.phase} {[c.state for c in q.status.container_statuses or []]}"
                for q in left
                if q.status.phase not in ("Succeeded", "Failed")
            )
            + "\nwarnings:\n"
            + "\n".join(said[-30:])
        ) from None
    mine = set(pods.names)
    failed = [
        e
        for e in core.list_namespaced_event(namespace).items
        if e.reason == "FailedPrepareDynamicResources" and e.involved_object.name in mine
    ]
    failed_pods = {e.involved_object.name for e in failed}
    span = 0.0
    if failed:
        first = min(e.first_timestamp or e.event_time for e in failed)
        last = max(e.last_timestamp or e.event_time for e in failed)
        span = (last - first).total_seconds()
    return {
        "rollout_s": rollout,
        "longest_unanswered_s": prober.longest(),
        "probes": len(prober.samples),
        "pods": len(pods.names),
        "failed_prepare_events": sum(e.count or 1 for e in failed),
        "pods_with_failed_prepare": len(failed_pods),
        "failed_prepare_span_s": span,
        "longest_pod_wait_s": max((w for w in pods.waits.values() if w == w), default=0.0),  # not NaN
        "pod_errors": pods.errors,
        "failure_messages": sorted({(e.message or "")[:160] for e in failed})[:3],
    }


def test_rollout_answers_every_prepare(simnode_image, example_image, dyn, core, namespace):
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    apps = client.AppsV1Api(core.api_client)
    node = core.list_node().items[0].metadata.name
    release, objs, ds = simulated_node_chart("roll", namespace, simnode_image)
    assert ds["spec"]["updateStrategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    template_spec = ds["spec"]["template"]["spec"]
    assert not template_spec.get("hostNetwork") and not any(
        p.get("hostPort") for c in template_spec["containers"] for p in c.get("ports", [])
    ), "the chart's pod has no host port: maxSurge can place a second one on the node"
    reach_apiserver(ds, apiserver_port())
    _exec_probes(ds)
    ds["spec"]["updateStrategy"] = {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "100%"}}
    template = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": "roll-gpu"},
        "spec": {
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]}}
        },
    }
    sliced = time_sliced_claim("sliced", "gpu")  # its pod lives through both rollouts
    applied: list = []
    slices = dyn.resources.get(api_version="resource.k8s.io/v1", kind="ResourceSlice")
    core.patch_node(node, {"metadata": {"labels": {LABEL: "true"}}})
    sel = f"app.kubernetes.io/instance={release},app.kubernetes.io/component=kubelet-plugin"
    name = ds["metadata"]["name"]
    try:
        apply_all(dyn, [*objs, template, sliced], namespace, applied)
        wait_ready_pod(core, namespace, sel, 180, "plugin")
        uuid_sliced = _start_sliced_pod(core, dyn, namespace, example_image)
        before = _measure(apps, core, namespace, name, sel, 1, "maxUnavailable 100%", example_image)
        apps.patch_namespaced_daemon_set(
            name,
            namespace,
            {"spec": {"updateStrategy": {"rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}}},
        )
        after = _measure(apps, core, namespace, name, sel, 2, "maxSurge 1", example_image)
        print(f"\n[rolling update] before (maxUnavailable 100%): {before}")
        print(f"[rolling update] after (maxSurge 1, maxUnavailable 0): {after}")
        assert before["pods"] >= 5 and after["pods"] >= 5, (before, after)
        # The probes see the old strategy's gap: what they find nothing of in the new one is gone.
        assert before["longest_unanswered_s"] > NEW_BOUND_SECONDS, before
        assert not after["pod_errors"], after
        assert after["failed_prepare_events"] == 0, after
        assert after["longest_unanswered_s"] < NEW_BOUND_SECONDS, after
        assert after["longest_pod_wait_s"] <= 5, after  # no kubelet retry backoff in it
        # Only the chart's instance is left, its sockets only.
        regs = sorted(n for n in os.listdir(REGISTRY) if n.startswith(f"{DRIVER}-"))
        assert len(regs) == 1, regs
        # The time-sliced pod ran through both rollouts, its GPU's time slice never reset.
        pod = core.read_namespaced_pod("sliced", namespace)
        assert pod.status.phase == "Running" and pod.status.container_statuses[0].restart_count == 0, (
            pod.status
        )
        assert "Timeslice 3 (LONG)" in time_slice(uuid_sliced), time_slice(uuid_sliced)
        core.delete_namespaced_pod("sliced", namespace, grace_period_seconds=0)
        wait_for("the time slice restored", lambda: "(DEFAULT)" in time_slice(uuid_sliced), 60, 0.5)
    finally:
        core.delete_collection_namespaced_pod(
            namespace, label_selector="!nonexistent", grace_period_seconds=0
        )
        delete_all(dyn, applied, namespace)
        deadline = time.time() + 90  # the plugin pods gone before anything else uses the socket dir
        while time.time() < deadline and core.list_namespaced_pod(namespace).items:
            time.sleep(0.5)
        core.patch_node(node, {"metadata": {"labels": {LABEL: None}}})
        for s in slices.get(field_selector=f"spec.driver={DRIVER}").to_dict()["items"]:
            with contextlib.suppress(ApiException):
                slices.delete(name=s["metadata"]["name"])
