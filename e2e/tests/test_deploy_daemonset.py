"""The chart's kubelet-plugin DaemonSet and controller Deployment, installed for real and run as
pods of the e2e cluster from the image of deploy/Dockerfile (built with buildah by
e2e/node/image_build.sh and imported into the cluster's containerd): the image's own Python and
package, started through its entrypoint, with the chart's security contexts (the plugin as root
with only CAP_MKNOD on a simulated node, the controller as 65532 with no capabilities, both with a
read-only root filesystem), host paths, downward-API env, probes and service accounts; a claim
pod then gets a GPU from the plugin pod and the controller pod's webhook denies a bad claim.

The only changes made to the rendered objects: hostNetwork and the apiserver's address, because
the e2e cluster has no kube-proxy and its apiserver listens on 127.0.0.1."""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from pathlib import Path

import pytest
import yaml
from support import (
    api_for,
    apiserver_port,
    apply_all,
    assert_runs_the_image,
    container_process,
    delete_all,
    reach_apiserver,
    render,
    simulated_node_chart,
    wait_for,
    wait_ready_pod,
)
from test_deploy import nvidia_smi, visible

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "deploy" / "examples"
DRIVER = "gpu.dra-gpu.io"
LABEL = "nvidia.com/gpu.present"
BROKEN_CEL = "device.attributes['gpu.dra-gpu.io'].productName =="  # a syntax error
CAP_MKNOD = 1 << 27


def test_daemonset_serves_a_simulated_node(simnode_image, example_image, dyn, core, namespace, wait_pod):
    from kubernetes.client.exceptions import ApiException

    node = core.list_node().items[0].metadata.name
    release, objs, ds = simulated_node_chart("ds", namespace, simnode_image)
    reach_apiserver(ds, apiserver_port())
    applied = []
    slices = dyn.resources.get(api_version="resource.k8s.io/v1", kind="ResourceSlice")
    core.patch_node(node, {"metadata": {"labels": {LABEL: "true"}}})
    try:
        apply_all(dyn, objs, namespace, applied)
        # The pod becomes Ready only after its startup probe got 200 from /healthz on the pod IP.
        sel = f"app.kubernetes.io/instance={release},app.kubernetes.io/component=kubelet-plugin"
        t0 = time.time()
        pod = wait_ready_pod(core, namespace, sel, 120, "plugin")
        ready_s = time.time() - t0
        sc = pod.spec.containers[0].security_context
        assert sc.privileged is False and sc.capabilities.add == ["MKNOD"]
        # The init container found the driver root's NVML before the plugin started.
        (init,) = pod.status.init_container_statuses
        assert init.state.terminated and init.state.terminated.exit_code == 0, init
        said = core.read_namespaced_pod_log(pod.metadata.name, namespace, container="wait-for-driver")
        assert said.startswith("NVIDIA driver found: /driver-root/"), said
        # As the chart says: root, with CAP_MKNOD as its only capability, read-only root.
        proc = container_process(pod)
        assert proc["uid"] == 0 and proc["cap_eff"] == CAP_MKNOD, proc
        assert_runs_the_image(proc, proc["cid"])
        # Published through its own service account (RBAC + the node-scoped policy let it).
        items = slices.get(field_selector=f"spec.driver={DRIVER},spec.nodeName={node}").to_dict()["items"]
        assert sum(len(s["spec"]["devices"]) for s in items) == 8
        managers = {m["manager"] for s in items for m in s["metadata"].get("managedFields", [])}
        assert DRIVER in managers
        # A claim pod (the example as it is: its public image, served locally under that name)
        # gets a GPU prepared by the plugin pod, and nvidia-smi from the driver root lists it.
        for o in yaml.safe_load_all((EXAMPLES / "one-gpu.yaml").read_text()):
            api_for(dyn, o).create(body=o, namespace=namespace)
        phase = wait_pod(core, namespace, "one-gpu", timeout=120)
        log = core.read_namespaced_pod_log("one-gpu", namespace)
        assert phase == "Succeeded", log
        (gpu,) = visible(log)
        assert nvidia_smi(log) == {"GPU": {gpu: "NVIDIA H100 80GB HBM3"}, "MIG": {}}, log
        nodes = [x for x in log.splitlines() if x.startswith("nvidia") and x[6:].isdigit()]
        assert len(nodes) == 1, log  # its device node (ls /dev | grep nvidia)
        print(
            f"[image] plugin pod Ready in {ready_s:.1f} s (uid 0, CapEff MKNOD only, ro root); "
            "a claim pod got its GPU from it"
        )
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


def test_controller_deployment_serves_admission_reviews(image, dyn, core, namespace):
    """The chart's controller Deployment (non-root, no capabilities, read-only root) with the
    chart's generated certificate: Ready through its HTTPS probe, watching the cluster through
    its read-only RBAC without a denial, and answering an AdmissionReview over TLS that verifies
    with the webhook's caBundle for the Service's DNS name. (The apiserver cannot call it here:
    no kube-proxy routes the Service, so the ValidatingWebhookConfiguration is not applied.)"""
    import base64
    import socket
    import ssl

    port = apiserver_port()
    release = "ctl-" + uuid.uuid4().hex[:6]
    objs = render(
        release,
        namespace,
        *image,
        "kubeletPlugin.enabled=false",
        "controller.replicas=1",
        "deviceClasses.gpu.enabled=false",
        "deviceClasses.mig.enabled=false",
    )
    (vwc,) = [o for o in objs if o["kind"] == "ValidatingWebhookConfiguration"]
    objs = [o for o in objs if o is not vwc]
    (dep,) = [o for o in objs if o["kind"] == "Deployment"]
    reach_apiserver(dep, port)
    applied = []
    try:
        apply_all(dyn, objs, namespace, applied)
        sel = f"app.kubernetes.io/instance={release},app.kubernetes.io/component=controller"
        t0 = time.time()
        pod = wait_ready_pod(core, namespace, sel, 90, "controller")
        ready_s = time.time() - t0
        assert pod.spec.security_context.run_as_user == 65532
        proc = container_process(pod)
        assert proc["uid"] == 65532 and proc["cap_eff"] == 0, proc
        assert_runs_the_image(proc, proc["cid"])
        ca = base64.b64decode(vwc["webhooks"][0]["clientConfig"]["caBundle"]).decode()
        svc = vwc["webhooks"][0]["clientConfig"]["service"]
        ctx = ssl.create_default_context(cadata=ca)
        server_name = f"{svc['name']}.{svc['namespace']}.svc"

        def https(request: bytes) -> bytes:
            with (
                socket.create_connection((pod.status.pod_ip, 8443), timeout=10) as raw,
                ctx.wrap_socket(raw, server_hostname=server_name) as s,
            ):
                s.sendall(request)
                data = b""
                while chunk := s.recv(65536):
                    data += chunk
            return data

        # Its read-only RBAC covers every list and watch it makes: each of the three loops lists,
        # then sees a watch event for an object made after the list (its metric counts them), so
        # every list and watch request has been answered before the log is searched for a denial.
        wait_for(
            "the controller's three lists",
            lambda: all(
                f"event=listed resource={r}" in core.read_namespaced_pod_log(pod.metadata.name, namespace)
                for r in ("slices", "classes", "claims")
            ),
            timeout=30,
            interval=0.2,
        )
        probe = "watch-probe-" + release
        probes = [
            {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": probe},
             "spec": {}},
            {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": probe},
             "spec": {"driver": "probe.example.com", "pool": {"name": probe, "generation": 1,
                      "resourceSliceCount": 1}, "allNodes": True, "devices": []}},
            {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": probe},
             "spec": {"devices": {"requests": [{"name": "r", "exactly": {"deviceClassName": probe}}]}}},
        ]  # fmt: skip
        apply_all(dyn, probes, namespace, applied)

        def watched() -> dict[str, float] | None:
            metrics = https(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").decode()
            seen = {
                line.split('resource="')[1].split('"')[0]: float(line.split()[-1])
                for line in metrics.splitlines()
                if line.startswith("dra_gpu_watch_events_total{")
            }
            return seen if all(seen.get(r, 0) >= 1 for r in ("slices", "classes", "claims")) else None

        wait_for("a watch event on each of the three resources", watched, timeout=30, interval=0.2)
        log = core.read_namespaced_pod_log(pod.metadata.name, namespace)
        assert "forbidden" not in log.lower(), log
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
        data = https(
            f"POST {svc['path']} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(review)}\r\nConnection: close\r\n\r\n".encode()
            + review
        )
        response = json.loads(data.split(b"\r\n\r\n", 1)[1])["response"]
        assert response["uid"] == "u1" and response["allowed"] is False, response
        print(
            f"[image] controller pod Ready in {ready_s:.1f} s (uid 65532, no capabilities, ro root); "
            f"its webhook denied the bad claim: {response.get('status', {}).get('message', '')[:80]}"
        )
    finally:
        delete_all(dyn, applied, namespace)
