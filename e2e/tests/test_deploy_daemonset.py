"""The chart's kubelet-plugin DaemonSet, installed for real with `simulatedProfile` and run as a
pod of the e2e cluster: its security context (not privileged, only CAP_MKNOD, read-only root),
host paths, downward-API env, startup/liveness probes on the pod IP, and its service account
(in-cluster config, least-privilege RBAC, the node-scoped slice policy) all at work; a claim pod
then gets a GPU from it.

There is no container engine to build deploy/Dockerfile here, so the pod runs the e2e busybox
image with this machine's Python, virtualenv and source mounted read-only at their own paths
(the only changes made to the rendered DaemonSet, with hostNetwork and the apiserver's address
because the e2e cluster has no kube-proxy and its apiserver listens on 127.0.0.1)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml
from support import helm_binary, sim_driver_root

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "dra-gpu"
EXAMPLES = ROOT / "deploy" / "examples"
DRIVER = "gpu.dra-gpu.io"
LABEL = "nvidia.com/gpu.present"
BROKEN_CEL = "device.attributes['gpu.dra-gpu.io'].productName =="  # a syntax error


def run_from_host(ds, apiserver_port):
    """Point the DaemonSet's container at this machine's Python instead of the image's."""
    spec = ds["spec"]["template"]["spec"]
    c = spec["containers"][0]
    c["image"], c["imagePullPolicy"] = "localhost/dra-gpu-e2e/busybox:1", "Never"
    c["command"] = [sys.executable, "-m", "dra_gpu.cli"]
    c.setdefault("env", [])
    c["env"] += [
        {"name": "KUBERNETES_SERVICE_HOST", "value": "127.0.0.1"},
        {"name": "KUBERNETES_SERVICE_PORT", "value": str(apiserver_port)},
        {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"},
    ]
    spec["hostNetwork"] = True
    # The interpreter, its shared libraries (and the loader, whose links are absolute /lib paths).
    libs = os.path.realpath("/lib/x86_64-linux-gnu")
    mounts = {p: p for p in (sys.prefix, sys.base_prefix, str(ROOT))}
    mounts.update(
        {
            "/lib/x86_64-linux-gnu": libs,
            "/usr/lib/x86_64-linux-gnu": libs,
            "/lib64": os.path.realpath("/lib64"),
        }
    )
    for i, (inside, host) in enumerate(sorted(mounts.items())):
        spec["volumes"].append({"name": f"host-{i}", "hostPath": {"path": host, "type": "Directory"}})
        c["volumeMounts"].append({"name": f"host-{i}", "mountPath": inside, "readOnly": True})


def api_for(dyn, o):
    return dyn.resources.get(api_version=o["apiVersion"], kind=o["kind"])


def apply_all(dyn, objs, namespace, applied):
    """Server-side apply each rendered object, recording it in `applied` for delete_all."""
    for o in objs:
        api = api_for(dyn, o)
        api.server_side_apply(
            body=o,
            namespace=namespace if api.namespaced else None,
            field_manager="dra-gpu-e2e",
            force_conflicts=True,
        )
        applied.append(o)


def delete_all(dyn, applied, namespace):
    from kubernetes.client.exceptions import ApiException

    for o in reversed(applied):
        api = api_for(dyn, o)
        with contextlib.suppress(ApiException):
            api.delete(name=o["metadata"]["name"], namespace=namespace if api.namespaced else None)


def wait_ready_pod(core, namespace, selector, timeout, what):
    """The first pod matching `selector` once Ready; fails with its status, log tail and events."""
    from kubernetes.client.exceptions import ApiException

    deadline, pod = time.time() + timeout, None
    while time.time() < deadline:
        pods = core.list_namespaced_pod(namespace, label_selector=selector).items
        pod = pods[0] if pods else None
        if pod and any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or []):
            return pod
        time.sleep(1)
    log = ""
    if pod:
        try:
            log = core.read_namespaced_pod_log(pod.metadata.name, namespace, tail_lines=40)
        except ApiException as exc:
            log = str(exc)
    events = core.list_namespaced_event(namespace).items
    pytest.fail(
        f"{what} pod not Ready: {pod.status if pod else None}\nlog:\n{log}\nevents:\n"
        + "\n".join(f"{e.reason}: {e.message}" for e in events)
    )


def test_daemonset_serves_a_simulated_node(target, dyn, core, namespace, wait_pod):
    if not target.local:
        pytest.skip("runs the host's Python in the pod: only on the local e2e cluster")
    from kubernetes.client.exceptions import ApiException

    node = core.list_node().items[0].metadata.name
    port = int(os.environ.get("DRA_GPU_E2E_APISERVER_PORT", "6443"))
    release = "ds-" + uuid.uuid4().hex[:6]
    out = subprocess.run(
        [
            helm_binary(),
            "template",
            release,
            str(CHART),
            "-n",
            namespace,
            "--kube-version",
            "1.37.2",
            "--set",
            "simulatedProfile=hgx-2x4",
            "--set",
            f"kubeletPlugin.nvidiaDriverRoot={sim_driver_root('hgx-2x4')}",
            "--set",
            "controller.enabled=false",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    objs = [o for o in yaml.safe_load_all(out) if o]
    (ds,) = [o for o in objs if o["kind"] == "DaemonSet"]
    run_from_host(ds, port)
    applied = []
    slices = dyn.resources.get(api_version="resource.k8s.io/v1", kind="ResourceSlice")
    core.patch_node(node, {"metadata": {"labels": {LABEL: "true"}}})
    try:
        apply_all(dyn, objs, namespace, applied)
        # The pod becomes Ready only after its startup probe got 200 from /healthz on the pod IP.
        sel = f"app.kubernetes.io/instance={release},app.kubernetes.io/component=kubelet-plugin"
        pod = wait_ready_pod(core, namespace, sel, 120, "plugin")
        sc = pod.spec.containers[0].security_context
        assert sc.privileged is False and sc.capabilities.add == ["MKNOD"]
        # Published through its own service account (RBAC + the node-scoped policy let it).
        items = slices.get(field_selector=f"spec.driver={DRIVER},spec.nodeName={node}").to_dict()["items"]
        assert sum(len(s["spec"]["devices"]) for s in items) == 8
        managers = {m["manager"] for s in items for m in s["metadata"].get("managedFields", [])}
        assert DRIVER in managers
        # A claim pod gets a GPU prepared by the plugin pod.
        for o in yaml.safe_load_all((EXAMPLES / "one-gpu.yaml").read_text()):
            api_for(dyn, o).create(body=o, namespace=namespace)
        phase = wait_pod(core, namespace, "one-gpu", timeout=120)
        log = core.read_namespaced_pod_log("one-gpu", namespace)
        assert phase == "Succeeded", log
        assert "NVIDIA_VISIBLE_DEVICES=GPU-" in log and "nvidia" in log.split("\n", 1)[1], log
    finally:
        core.delete_collection_namespaced_pod(
            namespace, label_selector="!nonexistent", grace_period_seconds=0
        )
        delete_all(dyn, applied, namespace)
        deadline = time.time() + 60  # the plugin pod gone before anything else uses the socket dir
        while time.time() < deadline and core.list_namespaced_pod(namespace).items:
            time.sleep(0.5)
        core.patch_node(node, {"metadata": {"labels": {LABEL: None}}})
        for s in slices.get(field_selector=f"spec.driver={DRIVER}").to_dict()["items"]:
            with contextlib.suppress(ApiException):
                slices.delete(name=s["metadata"]["name"])


def test_controller_deployment_serves_admission_reviews(target, dyn, core, namespace):
    """The chart's controller Deployment (non-root, no capabilities, read-only root) with the
    chart's generated certificate: Ready through its HTTPS probe, watching the cluster through
    its read-only RBAC without a denial, and answering an AdmissionReview over TLS that verifies
    with the webhook's caBundle for the Service's DNS name. (The apiserver cannot call it here:
    no kube-proxy routes the Service, so the ValidatingWebhookConfiguration is not applied.)"""
    if not target.local:
        pytest.skip("runs the host's Python in the pod: only on the local e2e cluster")
    import base64
    import json
    import socket
    import ssl

    port = int(os.environ.get("DRA_GPU_E2E_APISERVER_PORT", "6443"))
    release = "ctl-" + uuid.uuid4().hex[:6]
    out = subprocess.run(
        [
            helm_binary(),
            "template",
            release,
            str(CHART),
            "-n",
            namespace,
            "--set",
            "kubeletPlugin.enabled=false",
            "--set",
            "controller.replicas=1",
            "--set",
            "deviceClasses.gpu.enabled=false",
            "--set",
            "deviceClasses.mig.enabled=false",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    objs = [o for o in yaml.safe_load_all(out) if o]
    (vwc,) = [o for o in objs if o["kind"] == "ValidatingWebhookConfiguration"]
    objs = [o for o in objs if o is not vwc]
    (dep,) = [o for o in objs if o["kind"] == "Deployment"]
    run_from_host(dep, port)
    applied = []
    try:
        apply_all(dyn, objs, namespace, applied)
        sel = f"app.kubernetes.io/instance={release},app.kubernetes.io/component=controller"
        pod = wait_ready_pod(core, namespace, sel, 90, "controller")
        assert pod.spec.security_context.run_as_user == 65532
        time.sleep(2)  # let the list+watch loops run once
        log = core.read_namespaced_pod_log(pod.metadata.name, namespace)
        # Its read-only RBAC covers every list and watch it makes.
        assert "forbidden" not in log.lower(), log
        for resource in ("slices", "classes", "claims"):
            assert f"event=listed resource={resource}" in log, log

        ca = base64.b64decode(vwc["webhooks"][0]["clientConfig"]["caBundle"]).decode()
        svc = vwc["webhooks"][0]["clientConfig"]["service"]
        claim = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": "bad", "namespace": namespace},
            "spec": {
                "devices": {
                    "requests": [
                        {
                            "name": "gpu",
                            "exactly": {
                                "deviceClassName": DRIVER,
                                "selectors": [{"cel": {"expression": BROKEN_CEL}}],
                            },
                        }
                    ]
                }
            },
        }
        review = json.dumps(
            {
                "apiVersion": "admission.k8s.io/v1",
                "kind": "AdmissionReview",
                "request": {
                    "uid": "u1",
                    "operation": "CREATE",
                    "namespace": namespace,
                    "name": "bad",
                    "kind": {"group": "resource.k8s.io", "version": "v1", "kind": "ResourceClaim"},
                    "resource": {"group": "resource.k8s.io", "version": "v1", "resource": "resourceclaims"},
                    "object": claim,
                },
            }
        ).encode()
        ctx = ssl.create_default_context(cadata=ca)
        with (
            socket.create_connection((pod.status.pod_ip, 8443), timeout=10) as raw,
            ctx.wrap_socket(raw, server_hostname=f"{svc['name']}.{svc['namespace']}.svc") as s,
        ):
            s.sendall(
                f"POST {svc['path']} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(review)}\r\nConnection: close\r\n\r\n".encode()
                + review
            )
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        response = json.loads(data.split(b"\r\n\r\n", 1)[1])["response"]
        assert response["uid"] == "u1" and response["allowed"] is False, response
    finally:
        delete_all(dyn, applied, namespace)
