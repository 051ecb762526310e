"""MPS daemons as pods of their own (dra_gpu.plugin.mps_pods): the pod made from the plugin's pod,
one per daemon whoever asks twice, found again after a restart by label and node only, deleted and
waited for; against an in-memory API on a real event loop in its own thread, as the plugin calls it
from its worker threads. The e2e (e2e/tests/test_real_mps.py) runs them on a node with NVIDIA's
daemon."""

from __future__ import annotations

import asyncio
import copy
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from dra_gpu.kube.api import KubeError
from dra_gpu.plugin.mps import MpsError
from dra_gpu.plugin.mps_pods import COMPONENT_LABEL, DAEMON_LABEL, DaemonPodError, DaemonPods, PluginPod
from dra_gpu.plugin.server import MpsSettings

NS = "dra-gpu"
NODE = "gpu-node-1"
PLUGIN = {
    "metadata": {
        "name": "dra-gpu-kubelet-plugin-x7k2p",
        "namespace": NS,
        "labels": {
            "app.kubernetes.io/name": "dra-gpu",
            "app.kubernetes.io/instance": "dra-gpu",
            "app.kubernetes.io/component": "kubelet-plugin",
            "controller-revision-hash": "abc",
        },
        "ownerReferences": [{"kind": "DaemonSet", "name": "dra-gpu-kubelet-plugin", "controller": True}],
    },
    "spec": {
        "priorityClassName": "dra-gpu-node-critical",
        "serviceAccountName": "dra-gpu-kubelet-plugin",
        "volumes": [
            {"name": "plugins", "hostPath": {"path": "/var/lib/kubelet/plugins"}},
            {"name": "driver-root", "hostPath": {"path": "/run/nvidia"}},
            {"name": "kube-api-access-abcde", "projected": {"sources": []}},
        ],
        "containers": [
            {
                "name": "plugin",
                "image": "registry.example/dra-gpu/dra-gpu:0.2.0@sha256:" + "0" * 64,
                "imagePullPolicy": "IfNotPresent",
                "securityContext": {"privileged": True, "readOnlyRootFilesystem": True},
                "volumeMounts": [
                    {
                        "name": "plugins",
                        "mountPath": "/var/lib/kubelet/plugins",
                        "mountPropagation": "Bidirectional",
                    },
                    {"name": "driver-root", "mountPath": "/driver-root", "readOnly": True},
                    {
                        "name": "kube-api-access-abcde",
                        "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount",
                    },
                ],
            }
        ],
    },
}
MPS_DIR = "/var/lib/kubelet/plugins/gpu.dra-gpu.io/mps/0c1d-0"


class FakeApi:
    """The few calls DaemonPods makes, over dicts: pods of the namespace and one node."""

    def __init__(self) -> None:
        self.pods: dict[str, dict[str, Any]] = {f"{NS}/{PLUGIN['metadata']['name']}": copy.deepcopy(PLUGIN)}
        self.node = {"metadata": {"name": NODE, "uid": "node-uid-1"}}
        self.creates = 0
        self.linger = 0  # GETs a deleted pod is still answered for (its containers stopping)

    async def get_json(self, path: str) -> dict[str, Any] | None:
        if path == f"/api/v1/nodes/{NODE}":
            return self.node
        key = path.split("/namespaces/")[1].replace("/pods/", "/")
        pod = self.pods.get(key)
        if pod is not None and pod.get("deleting"):
            if self.linger == 0:
                del self.pods[key]
                return None
            self.linger -= 1
        return pod

    async def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        self.creates += 1
        key = f"{body['metadata']['namespace']}/{body['metadata']['name']}"
        if key in self.pods:
            raise KubeError(409, f"pods {body['metadata']['name']!r} already exists")
        self.pods[key] = copy.deepcopy(body)
        return body

    async def delete(self, path: str, grace_period_seconds: int | None = None) -> bool:
        key = path.split("/namespaces/")[1].replace("/pods/", "/")
        if key not in self.pods:
            return False
        self.pods[key]["deleting"] = True
        return True

    async def list_objects(self, path: str, field_selector: str | None = None, *, keep: Any = None) -> Any:
        assert field_selector == f"spec.nodeName={NODE}"
        pods = [p for p in self.pods.values() if p["spec"].get("nodeName") == NODE]
        return [p for p in pods if keep is None or keep(p)], "1"


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


def pods_of(api: FakeApi, loop: asyncio.AbstractEventLoop) -> DaemonPods:
    plugin = PluginPod(PLUGIN["metadata"]["name"], NS, NODE)
    return DaemonPods(api, loop, plugin, {"limits": {"memory": "512Mi"}}, delete_timeout=2.0)  # type: ignore[arg-type]


def create(pods: DaemonPods, daemon_id: str = "0c1d-0") -> str:
    env = {"LD_PRELOAD": "/driver-root/driver/usr/lib/libcuda.so.1", "CUDA_VISIBLE_DEVICES": "GPU-1"}
    return pods.create(
        daemon_id, f"{MPS_DIR}/pipe", f"{MPS_DIR}/shm", "/driver-root/usr/bin/nvidia-cuda-mps-control", env
    )


def test_the_daemon_pod_is_made_from_the_plugins_pod(loop: asyncio.AbstractEventLoop) -> None:
    api = FakeApi()
    name = create(pods_of(api, loop))
    assert name == "dra-gpu-kubelet-plugin-mps-0c1d-0"  # after the DaemonSet: its pods' names are random
    pod = api.pods[f"{NS}/{name}"]
    meta, spec = pod["metadata"], pod["spec"]
    (c,) = spec["containers"]
    # Its own life: on this node, the host's PID namespace, never restarted behind the plugin's back,
    # owned by the node (drain evicts it; nothing of the plugin's takes it away).
    assert spec["nodeName"] == NODE and spec["hostPID"] is True and spec["restartPolicy"] == "Never"
    assert meta["ownerReferences"] == [
        {
            "apiVersion": "v1",
            "kind": "Node",
            "name": NODE,
            "uid": "node-uid-1",
            "controller": True,
            "blockOwnerDeletion": False,
        }
    ]
    # Not the DaemonSet's: another component, so its selector never adopts it.
    assert meta["labels"] == {
        "app.kubernetes.io/name": "dra-gpu",
        "app.kubernetes.io/instance": "dra-gpu",
        COMPONENT_LABEL: "mps-control-daemon",
        DAEMON_LABEL: "0c1d-0",
    }
    # The plugin's image, security and driver root; no API token; Bidirectional made one-way.
    assert c["image"] == PLUGIN["spec"]["containers"][0]["image"]  # type: ignore[index]
    assert c["securityContext"] == {"privileged": True, "readOnlyRootFilesystem": True}
    assert (
        spec["automountServiceAccountToken"] is False and spec["priorityClassName"] == "dra-gpu-node-critical"
    )
    assert [v["name"] for v in spec["volumes"]] == ["plugins", "driver-root", "mps-shm"]
    assert {m["mountPath"]: m.get("mountPropagation") for m in c["volumeMounts"]} == {
        "/var/lib/kubelet/plugins": "HostToContainer",
        "/driver-root": None,
        "/dev/shm": None,
    }
    assert spec["volumes"][-1]["hostPath"] == {"path": f"{MPS_DIR}/shm", "type": "Directory"}
    # NVIDIA's daemon in the foreground under the supervisor; libcuda preloaded for it alone.
    assert c["command"] == [
        sys.executable,
        "-m",
        "dra_gpu.plugin.mps_supervisor",
        f"{MPS_DIR}/pipe",
        "/driver-root/driver/usr/lib/libcuda.so.1",
        "/driver-root/usr/bin/nvidia-cuda-mps-control",
        "-f",
    ]
    assert c["env"] == [{"name": "CUDA_VISIBLE_DEVICES", "value": "GPU-1"}]
    assert c["resources"] == {"limits": {"memory": "512Mi"}}
    assert spec["tolerations"] == [{"operator": "Exists"}]


def test_never_a_second_pod_for_one_daemon_and_found_again_after_a_restart(
    loop: asyncio.AbstractEventLoop,
) -> None:
    api = FakeApi()
    first = pods_of(api, loop)
    name = create(first)
    again = pods_of(api, loop)  # a restarted plugin (or the other instance of a rolling update)
    assert create(again) == name and api.creates == 2
    assert len([p for p in api.pods.values() if p["metadata"]["labels"].get(DAEMON_LABEL)]) == 1
    create(again, "9f8e-1")
    # Another release's daemon and a pod of another node are not this plugin's.
    other = copy.deepcopy(api.pods[f"{NS}/{name}"])
    other["metadata"]["name"] = "x"
    other["metadata"]["labels"]["app.kubernetes.io/instance"] = "other"
    api.pods[f"{NS}/x"] = other
    elsewhere = copy.deepcopy(api.pods[f"{NS}/{name}"])
    elsewhere["metadata"]["name"] = "y"
    elsewhere["spec"]["nodeName"] = "gpu-node-2"
    api.pods[f"{NS}/y"] = elsewhere
    assert pods_of(api, loop).ids() == {"0c1d-0", "9f8e-1"}


def test_a_daemon_runs_while_its_pods_container_runs(loop: asyncio.AbstractEventLoop) -> None:
    """What the plugin asks of a daemon that does not answer (kept while it runs, see
    Sharing.ensure): its pod Running with its container running; not when it ended or is gone."""
    api = FakeApi()
    pods = pods_of(api, loop)
    name = create(pods)
    pod = api.pods[f"{NS}/{name}"]
    assert not pods.running("0c1d-0")  # created, not started
    pod["status"] = {"phase": "Running", "containerStatuses": [{"state": {"running": {}}}]}
    assert pods.running("0c1d-0")
    pod["status"] = {"phase": "Running", "containerStatuses": [{"state": {"terminated": {"exitCode": 1}}}]}
    assert not pods.running("0c1d-0")
    pod["status"] = {"phase": "Succeeded", "containerStatuses": [{"state": {"terminated": {"exitCode": 0}}}]}
    assert not pods.running("0c1d-0")
    assert not pods.running("9f8e-1")  # no such pod


def test_delete_waits_until_the_pod_is_gone_and_says_when_it_is_not(loop: asyncio.AbstractEventLoop) -> None:
    api = FakeApi()
    pods = pods_of(api, loop)
    name = create(pods)
    api.linger = 3
    pods.delete("0c1d-0")
    assert f"{NS}/{name}" not in api.pods
    pods.delete("0c1d-0")  # not there: nothing to do
    create(pods)
    api.linger = 10**6  # its containers never stop
    with pytest.raises(
        DaemonPodError, match=rf"MPS daemon pod {NS}/{name}: still there 2s after its deletion"
    ) as e:
        pods.delete("0c1d-0")
    assert isinstance(e.value, MpsError)  # undone and reported like any daemon's failure


def test_the_plugins_pod_must_be_there(loop: asyncio.AbstractEventLoop) -> None:
    api = FakeApi()
    api.pods.clear()
    with pytest.raises(DaemonPodError, match="the plugin's own pod dra-gpu/dra-gpu-kubelet-plugin-x7k2p"):
        create(pods_of(api, loop))


def test_the_settings_name_the_flag_of_a_bad_value(monkeypatch: pytest.MonkeyPatch) -> None:
    assert MpsSettings.parse("auto", "16Gi", '{"limits": {"memory": "1Gi"}}') == MpsSettings(
        "auto", 16 << 30, {"limits": {"memory": "1Gi"}}
    )
    for args, said in [
        (("pods", "", ""), "--mps-daemons"),
        (("auto", "lots", ""), "--mps-shm-size"),
        (("auto", "1Mi", ""), "--mps-shm-size .*under 64Mi"),
        (("auto", "", "{"), "--mps-daemon-resources .*not JSON"),
        (("auto", "", '{"memory": "1Gi"}'), "--mps-daemon-resources .*requests and limits"),
    ]:
        with pytest.raises(ValueError, match=said):
            MpsSettings.parse(*args)
    monkeypatch.delenv("POD_NAME", raising=False)
    monkeypatch.delenv("POD_NAMESPACE", raising=False)
    assert MpsSettings().plugin_pod(NODE) is None  # auto, not in a pod: the node's processes
    with pytest.raises(ValueError, match=r"\$POD_NAME"):
        MpsSettings("pod").plugin_pod(NODE)
    monkeypatch.setenv("POD_NAME", "p")
    monkeypatch.setenv("POD_NAMESPACE", NS)
    assert MpsSettings().plugin_pod(NODE) == PluginPod("p", NS, NODE)
    assert MpsSettings("process").plugin_pod(NODE) is None
