"""The DRA path end to end with a peer driver (not ours): scheduler allocation -> kubelet ->
kubelet plugin (upstream's DRA test driver, as gpu.example.com) -> CDI spec -> containerd ->
the container's environment."""
import time

import pytest

pytestmark = pytest.mark.e2e


def test_claim_pod_sees_injected_env(core, dyn, namespace, peer_driver, busybox_image,
                                     wait_pod):
    from kubernetes import client
    templates = dyn.resources.get(api_version="resource.k8s.io/v1", kind="ResourceClaimTemplate")
    templates.create(namespace=namespace, body={
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
        "metadata": {"name": "gpu"},
        "spec": {"spec": {"devices": {
            "requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.example.com"}}],
            # The test driver turns opaque parameters into env vars: user_<key>=<value>.
            "config": [{"opaque": {"driver": peer_driver,
                                   "parameters": {"GPU_DEVICE_0": "peer-gpu-0"}}}],
        }}},
    })
    pod = client.V1Pod(
        metadata=client.V1ObjectMeta(name="claim-pod"),
        spec=client.V1PodSpec(
            restart_policy="Never",
            termination_grace_period_seconds=0,
            resource_claims=[client.V1PodResourceClaim(name="gpu",
                                                       resource_claim_template_name="gpu")],
            containers=[client.V1Container(
                name="main", image=busybox_image, image_pull_policy="Never",
                command=["sh", "-c", "env | sort"],
                resources=client.V1ResourceRequirements(
                    claims=[client.V1ResourceClaim(name="gpu")]))]))
    core.create_namespaced_pod(namespace, pod)
    phase = wait_pod(core, namespace, "claim-pod", timeout=120)
    log = core.read_namespaced_pod_log("claim-pod", namespace, container="main")
    assert phase == "Succeeded", log
    env = dict(line.split("=", 1) for line in log.splitlines() if "=" in line)
    gpu_vars = {k: v for k, v in env.items() if "GPU_DEVICE_" in k}
    assert gpu_vars == {"user_GPU_DEVICE_0": "peer-gpu-0"}, log
    assert any(k.startswith("claim_") and k.endswith("_gpu") for k in env), log

    # The claim made from the template was allocated by the scheduler to the peer driver.
    claims = dyn.resources.get(api_version="resource.k8s.io/v1", kind="ResourceClaim")
    items = claims.get(namespace=namespace).to_dict()["items"]
    assert len(items) == 1
    results = items[0]["status"]["allocation"]["devices"]["results"]
    assert [r["driver"] for r in results] == [peer_driver]
    # Deleting the pod lets the kubelet unprepare the claim (the driver removes its CDI file).
    core.delete_namespaced_pod("claim-pod", namespace, grace_period_seconds=0)
    deadline = time.time() + 60
    while time.time() < deadline:
        if not core.list_namespaced_pod(namespace).items:
            break
        time.sleep(0.5)
