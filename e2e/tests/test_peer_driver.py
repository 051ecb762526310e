"""The DRA path end to end with a peer driver (not ours): scheduler allocation -> kubelet ->
kubelet plugin (upstream's DRA test driver, as gpu.example.com) -> CDI spec -> containerd ->
the container's environment."""

import time

import pytest

pytestmark = pytest.mark.e2e


def test_claim_pod_sees_injected_env(core, dyn, namespace, peer_driver, busybox_image):
    templates = dyn.resources.get(api_version="resource.k8s.io/v1", kind="ResourceClaimTemplate")
    templates.create(
        namespace=namespace,
        body={
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaimTemplate",
            "metadata": {"name": "gpu"},
            "spec": {
                "spec": {
                    "devices": {
                        "requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.example.com"}}],
                        # The test driver turns opaque parameters into env vars: user_<key>=<value>.
                        "config": [
                            {"opaque": {"driver": peer_driver, "parameters": {"GPU_DEVICE_0": "peer-gpu-0"}}}
                        ],
                    }
                }
            },
        },
    )
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "claim-pod"},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 0,
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "gpu"}],
            "containers": [
                {
                    "name": "main",
                    "image": busybox_image,
                    "imagePullPolicy": "Never",
                    "command": ["sh", "-c", "env | sort; echo END-OF-ENV; exec sleep 3600"],
                    "resources": {"claims": [{"name": "gpu"}]},
                }
            ],
        },
    }
    core.create_namespaced_pod(namespace, pod)
    log = wait_log(core, namespace, "claim-pod", "END-OF-ENV", timeout=120)
    env = dict(line.split("=", 1) for line in log.splitlines() if "=" in line)
    gpu_vars = {k: v for k, v in env.items() if "GPU_DEVICE_" in k}
    assert gpu_vars == {"user_GPU_DEVICE_0": "peer-gpu-0"}, log
    assert any(k.startswith("claim_") and k.endswith("_gpu") for k in env), log

    # The claim made from the template was allocated by the scheduler to the peer driver and
    # reserved for the pod.
    claims = dyn.resources.get(api_version="resource.k8s.io/v1", kind="ResourceClaim")
    items = claims.get(namespace=namespace).to_dict()["items"]
    assert len(items) == 1, items
    status = items[0]["status"]
    assert [r["driver"] for r in status["allocation"]["devices"]["results"]] == [peer_driver]
    assert [r["name"] for r in status["reservedFor"]] == ["claim-pod"]

    # Deleting the pod makes the kubelet unprepare the claim and the controller delete it.
    core.delete_namespaced_pod("claim-pod", namespace, grace_period_seconds=0)
    deadline = time.time() + 60
    while claims.get(namespace=namespace).to_dict()["items"]:
        assert time.time() < deadline, "claim not deleted 60 s after its pod"
        time.sleep(0.5)


def wait_log(core, ns, name, marker, timeout):
    deadline = time.time() + timeout
    log = ""
    while time.time() < deadline:
        pod = core.read_namespaced_pod(name, ns)
        if pod.status.phase in ("Running", "Succeeded", "Failed"):
            log = core.read_namespaced_pod_log(name, ns)
            if marker in log:
                return log
        time.sleep(0.5)
    events = core.list_namespaced_event(ns, field_selector="involvedObject.name=" + name)
    lines = "\n".join(f"{e.type} {e.reason}: {e.message}" for e in events.items)
    raise AssertionError(
        f"pod {ns}/{name}: no {marker!r} in its log after {timeout} s; status "
        f"{pod.status.phase}\nlog:\n{log}\nevents:\n{lines}"
    )
