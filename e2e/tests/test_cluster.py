"""The cluster itself works: a Ready node, a pod whose log is read back, DRA gates on."""

import time
import uuid

import pytest

pytestmark = pytest.mark.e2e


def test_node_ready(core):
    deadline = time.time() + 60
    while True:
        nodes = core.list_node().items
        ready = [
            n.metadata.name
            for n in nodes
            if any(c.type == "Ready" and c.status == "True" for c in n.status.conditions)
        ]
        if ready or time.time() > deadline:
            break
        time.sleep(1)
    assert ready, "no Ready node among %s" % [n.metadata.name for n in nodes]


def test_busybox_pod_log(core, namespace, busybox_image, wait_pod):
    from kubernetes import client

    token = uuid.uuid4().hex
    pod = client.V1Pod(
        metadata=client.V1ObjectMeta(name="busybox"),
        spec=client.V1PodSpec(
            restart_policy="Never",
            termination_grace_period_seconds=0,
            containers=[
                client.V1Container(
                    name="main",
                    image=busybox_image,
                    image_pull_policy="Never",
                    command=["sh", "-c", "echo hello-$TOKEN; uname -s"],
                    env=[client.V1EnvVar(name="TOKEN", value=token)],
                )
            ],
        ),
    )
    core.create_namespaced_pod(namespace, pod)
    assert wait_pod(core, namespace, "busybox") == "Succeeded"
    log = core.read_namespaced_pod_log("busybox", namespace, container="main")
    assert "hello-" + token in log
    assert "Linux" in log


def test_dra_feature_gates_keep_fields(dyn):
    """A gate that is off makes the apiserver drop its fields silently: read them back.

    One pool, two slices (since 1.35 a slice has either devices or sharedCounters)."""
    api = dyn.resources.get(api_version="resource.k8s.io/v1", kind="ResourceSlice")
    name = "e2e-gates-" + uuid.uuid4().hex[:6]
    pool = {"name": name, "generation": 1, "resourceSliceCount": 2}
    common = {"driver": "gates.e2e.dra-gpu.invalid", "allNodes": True, "pool": pool}
    counters = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name + "-counters"},
        "spec": dict(common, sharedCounters=[{"name": "mem", "counters": {"memory": {"value": "8Gi"}}}]),
    }
    devices = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name + "-devices"},
        "spec": dict(
            common,
            devices=[
                {
                    "name": "dev0",
                    "allowMultipleAllocations": True,
                    "capacity": {
                        "memory": {
                            "value": "8Gi",
                            "requestPolicy": {"default": "1Gi", "validRange": {"min": "1Gi", "step": "1Gi"}},
                        }
                    },
                    "consumesCounters": [{"counterSet": "mem", "counters": {"memory": {"value": "8Gi"}}}],
                    "taints": [{"key": "e2e.dra-gpu/check", "value": "x", "effect": "NoSchedule"}],
                    "bindsToNode": True,
                    "bindingConditions": ["e2e.dra-gpu/ready"],
                    "bindingFailureConditions": ["e2e.dra-gpu/failed"],
                }
            ],
        ),
    }
    created = []
    try:
        got_c = api.create(body=counters).to_dict()
        created.append(counters["metadata"]["name"])
        got_d = api.create(body=devices).to_dict()
        created.append(devices["metadata"]["name"])
        assert got_c["spec"].get("sharedCounters"), "sharedCounters dropped (DRAPartitionableDevices off?)"
        dev = got_d["spec"]["devices"][0]
        missing = [
            f
            for f in (
                "allowMultipleAllocations",
                "consumesCounters",
                "taints",
                "bindsToNode",
                "bindingConditions",
                "bindingFailureConditions",
            )
            if not dev.get(f)
        ]
        assert not missing, f"fields dropped by the apiserver (gates off?): {missing}"
        assert dev.get("capacity", {}).get("memory", {}).get("requestPolicy"), (
            "capacity.requestPolicy dropped (DRAConsumableCapacity off?)"
        )
    finally:
        for n in created:
            api.delete(name=n)
