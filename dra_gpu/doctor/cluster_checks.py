"""The cluster's answers, run in order over one view of the cluster: is the DRA API served with the
gates this driver needs and are the classes there (here), does every GPU node publish its slices
(node_slices.py), which devices are tainted (device_taints.py), why is each GPU pod Pending
(pending_pods.py), is the admission webhook reachable with a valid certificate (webhook_check.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from dra_gpu.doctor.cluster_view import ClusterView, load_view, object_name
from dra_gpu.doctor.device_taints import check_device_taints
from dra_gpu.doctor.node_slices import check_node_slices
from dra_gpu.doctor.pending_pods import check_pending_pods
from dra_gpu.doctor.report import Result, crashed, fail, first_line, guarded, ok, skip, warn
from dra_gpu.doctor.settings import ClusterSettings
from dra_gpu.doctor.webhook_check import check_webhook
from dra_gpu.kube.api import RESOURCE_V1, Kube, KubeError
from dra_gpu.kubeletplugin.publisher import GATED_SLICE_FIELDS

# Fields of the features this driver uses; an apiserver with the gate off drops them silently.
# The fields the probe slice carries, with what each gives; their gates are the plugin's own table
# (one field -> gate mapping for the plugin's log line, its metric and this row).
GATED_FIELDS = tuple(
    (field, GATED_SLICE_FIELDS[field][0], what)
    for field, what in (
        ("taints", "device health taints"),
        ("consumesCounters", "dynamic MIG (counters)"),
        ("allowMultipleAllocations", "shared GPUs (consumable memory)"),
    )
)


def check_resource_api(view: ClusterView, settings: ClusterSettings) -> Iterable[Result]:
    name = "cluster/resource-api"
    if "v1" not in view.resource_versions:
        served = ", ".join(view.resource_versions) or "none"
        yield fail(
            name,
            f"resource.k8s.io/v1 is not served by {view.server_version} (served: {served})",
            "upgrade the control plane to Kubernetes >= 1.34 "
            "(or enable --runtime-config=resource.k8s.io/v1=true)",
        )
        return
    yield ok(name, f"resource.k8s.io/v1 served by {view.server_version}")


def _probe_slice(driver: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"generateName": "dra-gpu-doctor-"},
        "spec": {
            "driver": driver,
            "allNodes": True,
            "pool": {"name": "dra-gpu-doctor-dry-run", "generation": 1, "resourceSliceCount": 1},
            "devices": [
                {
                    "name": "probe",
                    "allowMultipleAllocations": True,
                    "capacity": {
                        "memory": {
                            "value": "8Gi",
                            "requestPolicy": {"default": "1Gi", "validRange": {"min": "1Gi"}},
                        }
                    },
                    "consumesCounters": [{"counterSet": "probe", "counters": {"memory": {"value": "8Gi"}}}],
                    "taints": [{"key": f"{driver}/doctor", "value": "probe", "effect": "NoSchedule"}],
                }
            ],
        },
    }


async def check_dra_features(kube: Kube, view: ClusterView, settings: ClusterSettings) -> list[Result]:
    """A server-side dry run of a slice using every gated field: what comes back is what is on."""
    name = "cluster/dra-features"
    if "v1" not in view.resource_versions:
        return [skip(name, "resource.k8s.io/v1 not served")]
    try:
        got = await asyncio.wait_for(
            kube.create(f"{RESOURCE_V1}/resourceslices", _probe_slice(settings.driver), dry_run=True),
            settings.timeout,
        )
    except KubeError as exc:
        if exc.status in (401, 403):
            return [skip(name, f"cannot dry-run a ResourceSlice (HTTP {exc.status}: no create permission)")]
        raise
    device = ((got.get("spec") or {}).get("devices") or [{}])[0]
    dropped = [(f, gate, what) for f, gate, what in GATED_FIELDS if not device.get(f)]
    results = []
    if "devicetaintrules" not in view.v1_resources:
        dropped.append(("DeviceTaintRule", "DRADeviceTaintRules", "tainting devices by rule"))
    if dropped:
        results.append(
            warn(
                name,
                "dropped by the apiserver (gate off): "
                + "; ".join(f"{f} ({gate}): no {what}" for f, gate, what in dropped),
                "enable "
                + ",".join(sorted({g for _, g, _ in dropped}))
                + " =true on kube-apiserver, kube-scheduler, kube-controller-manager and kubelet",
            )
        )
    else:
        kept = ", ".join(f"{f} ({gate})" for f, gate, _ in GATED_FIELDS)
        results.append(ok(name, f"kept in a dry run: {kept}; DeviceTaintRule served"))
    return results


def check_device_classes(view: ClusterView, settings: ClusterSettings) -> Iterable[Result]:
    name = "cluster/device-classes"
    present = {object_name(c) for c in view.classes}
    missing = [c for c in settings.class_names if c not in present]
    if missing:
        yield fail(
            name,
            f"DeviceClass {', '.join(missing)} missing: claims naming it never allocate",
            "reinstall the chart's classes: `helm upgrade --reuse-values <release> deploy/helm/dra-gpu` "
            "(deviceClasses.*.enabled=true)",
        )
        return
    yield ok(name, f"{', '.join(settings.class_names)} present")


SYNC_CHECKS: tuple[tuple[str, Callable[[ClusterView, ClusterSettings], Iterable[Result]]], ...] = (
    ("cluster/resource-api", check_resource_api),
    ("cluster/device-classes", check_device_classes),
    ("cluster/slices", check_node_slices),
    ("cluster/device-taints", check_device_taints),
    ("cluster/pending-pods", check_pending_pods),
    ("cluster/webhook", check_webhook),
)


async def _run(settings: ClusterSettings) -> list[Result]:
    try:
        kube = await asyncio.wait_for(Kube.connect(settings.kubeconfig), settings.timeout)
    except Exception as exc:
        return [
            skip(
                "cluster/api-server",
                f"no usable kubeconfig: {first_line(exc)}",
            )
        ]
    try:
        try:
            view = await load_view(kube, settings.namespace, settings.timeout)
        except Exception as exc:  # refused, TLS, credentials, timeouts, HTTP errors: one verdict
            why = first_line(exc)
            return [
                fail(
                    "cluster/api-server",
                    f"API server not reachable: {why}",
                    "check the kubeconfig's server and credentials (`kubectl get --raw /version`)",
                )
            ]
        results = [ok("cluster/api-server", f"{view.server_version} reachable")]
        for what, why in sorted(view.errors.items()):
            results.append(
                warn(f"cluster/list/{what}", why, "give doctor's credentials list/get on it (RBAC)")
            )
        results.extend(
            await _guarded_async("cluster/dra-features", lambda: check_dra_features(kube, view, settings))
        )
        for check, fn in SYNC_CHECKS:
            results.extend(guarded(check, _bind(fn, view, settings)))
        return results
    finally:
        await kube.close()


def _bind(
    fn: Callable[[ClusterView, ClusterSettings], Iterable[Result]],
    view: ClusterView,
    settings: ClusterSettings,
) -> Callable[[], Iterable[Result]]:
    return lambda: fn(view, settings)


async def _guarded_async(check: str, run: Callable[[], Awaitable[Iterable[Result]]]) -> list[Result]:
    try:
        return list(await run())
    except Exception as exc:
        return [crashed(check, exc)]


def run_cluster_checks(settings: ClusterSettings) -> list[Result]:
    return asyncio.run(_run(settings))
