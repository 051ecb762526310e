"""MPS control daemons as pods of their own on the plugin's node, so that they outlive the plugin.

A daemon the plugin ran itself lived in the plugin's PID namespace and cgroup: every plugin
restart (a crash, an OOM kill, an upgrade, a rollout) killed it and every tenant's CUDA client with
it, and its memory counted against the plugin's limit. Here each daemon is a pod, like NVIDIA's
driver does it (one Deployment each there; a bare pod here, see below):

- made from the plugin's own pod, read once from the API: its image, volumes and mounts (the
  driver root, the plugin directory holding the daemon's directories, a real node's /dev), security
  context and priority class, so whatever the chart gives the plugin to reach the driver, the daemon
  has too. A Bidirectional mount becomes HostToContainer: the daemon makes no mounts;
- `hostPID`: NVIDIA's server must see its clients' processes (tenants' containers, each in a PID
  namespace of its own);
- its `/dev/shm` is the daemon's `shm/` directory, the one its claim's containers get;
- its program is dra_gpu.plugin.mps_supervisor (NVIDIA's `nvidia-cuda-mps-control -f`, asked to
  quit at SIGTERM); restartPolicy Never: a daemon that died is started again by the plugin, which
  empties its directories and sets its limits first (the next prepare, the start, each sweep);
- owned (as controller) by the Node: `kubectl drain` evicts it without --force, a deleted node's
  go with it. Not by the claim (another namespace) nor by the plugin's pod or DaemonSet (their
  deletion at an upgrade or uninstall would take the daemons with them);
- its own memory and CPU (`resources`), visible as `kubectl get pods -l
  app.kubernetes.io/component=mps-control-daemon`.

After a restart the plugin adopts the pods of its node it finds (label, node and name: the pod's
name is the daemon's id, so a second one for the same claim cannot be created), checked against
the checkpoint's records, never against anything a tenant can write; pods no record names are
deleted. Calls are made from the plugin's worker threads onto its event loop, each bounded.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from tenacity import RetryError, retry, retry_if_result, stop_after_delay, wait_exponential

from dra_gpu.kube.api import REQUEST_TIMEOUT, Kube, KubeError
from dra_gpu.model.mps_daemon_pods import COMPONENT, COMPONENT_LABEL, DAEMON_LABEL
from dra_gpu.plugin.mps import MpsError

log = logging.getLogger(__name__)

CONTAINER = "mps-control-daemon"
SHM_VOLUME = "mps-shm"
SUPERVISOR = "dra_gpu.plugin.mps_supervisor"
KEPT_LABELS = ("app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/part-of")
TOKEN_VOLUME_PREFIX = "kube-api-access-"  # the service account token: the daemon needs no API
DELETE_GRACE_S = 10  # the supervisor's quit (5 s) and kill fit in it
HTTP_CONFLICT = 409
T = TypeVar("T")


class DaemonPodError(MpsError):
    """A daemon pod that cannot be made, found or removed; the message names it and says why."""


@dataclass(frozen=True)
class PluginPod:
    """Where the plugin runs: its pod (POD_NAME, POD_NAMESPACE) on its node."""

    name: str
    namespace: str
    node_name: str


class DaemonPods:
    """Creates, lists and deletes this node's MPS daemon pods (blocking: call from a thread)."""

    def __init__(
        self,
        kube: Kube,
        loop: asyncio.AbstractEventLoop,
        plugin: PluginPod,
        resources: dict[str, Any] | None = None,
        delete_timeout: float = 30.0,
    ) -> None:
        self.kube = kube
        self.loop = loop
        self.plugin = plugin
        self.resources = resources or {}
        self.delete_timeout = delete_timeout
        self._template: dict[str, Any] | None = None

    def _call(self, make: Callable[[], Awaitable[T]]) -> T:
        """Run one API call on the plugin's loop from this worker thread, bounded."""

        async def call() -> T:
            return await make()

        future = asyncio.run_coroutine_threadsafe(call(), self.loop)
        try:
            return future.result(timeout=REQUEST_TIMEOUT + 5)
        except TimeoutError as exc:
            future.cancel()
            raise DaemonPodError(f"the API did not answer within {REQUEST_TIMEOUT + 5:g}s") from exc
        except (KubeError, OSError) as exc:
            raise DaemonPodError(str(exc)) from exc

    @property
    def collection(self) -> str:
        return f"/api/v1/namespaces/{self.plugin.namespace}/pods"

    def pod_name(self, daemon_id: str) -> str:
        return f"{self._base()['prefix']}-mps-{daemon_id}"

    def _base(self) -> dict[str, Any]:
        """The plugin's pod and node, read once: what every daemon pod is made from."""
        if self._template is None:
            ns, name = self.plugin.namespace, self.plugin.name
            pod = self._call(lambda: self.kube.get_json(f"/api/v1/namespaces/{ns}/pods/{name}"))
            if pod is None:
                raise DaemonPodError(
                    f"the plugin's own pod {ns}/{name} (POD_NAME, POD_NAMESPACE) is not there"
                )
            node = self._call(lambda: self.kube.get_json(f"/api/v1/nodes/{self.plugin.node_name}"))
            if node is None:
                raise DaemonPodError(f"node {self.plugin.node_name} is not there")
            owners = pod["metadata"].get("ownerReferences") or []
            prefix = next((o["name"] for o in owners if o.get("kind") == "DaemonSet"), name)
            self._template = {"pod": pod, "node_uid": node["metadata"]["uid"], "prefix": prefix}
        return self._template

    def manifest(
        self, daemon_id: str, pipe_dir: str, shm_dir: str, binary: str, env: dict[str, str]
    ) -> dict[str, Any]:
        """The daemon's pod: the plugin's pod's image, volumes and security, NVIDIA's daemon run by
        the supervisor, its /dev/shm the daemon's shm directory. `env` is the daemon's environment
        (its LD_PRELOAD is handed to the supervisor, which sets it for the daemon only)."""
        base = self._base()
        plugin = base["pod"]
        spec = plugin["spec"]
        (container,) = [c for c in spec["containers"] if c["name"] == "plugin"] or spec["containers"][:1]
        env = dict(env)
        preload = env.pop("LD_PRELOAD", "")
        mounts = []
        for m in container.get("volumeMounts") or []:
            if m["name"].startswith(TOKEN_VOLUME_PREFIX):
                continue
            if m.get("mountPropagation") == "Bidirectional":
                m = {**m, "mountPropagation": "HostToContainer"}
            mounts.append(m)
        mounts.append({"name": SHM_VOLUME, "mountPath": "/dev/shm"})
        volumes = [v for v in spec.get("volumes") or [] if not v["name"].startswith(TOKEN_VOLUME_PREFIX)]
        volumes.append({"name": SHM_VOLUME, "hostPath": {"path": shm_dir, "type": "Directory"}})
        labels = {k: v for k, v in (plugin["metadata"].get("labels") or {}).items() if k in KEPT_LABELS}
        labels[COMPONENT_LABEL] = COMPONENT
        labels[DAEMON_LABEL] = daemon_id
        pod_spec: dict[str, Any] = {
            "nodeName": self.plugin.node_name,
            "hostPID": True,
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "terminationGracePeriodSeconds": DELETE_GRACE_S,
            # Its tenants' pods tolerate what they tolerate; the daemon stays while they run.
            "tolerations": [{"operator": "Exists"}],
            "volumes": volumes,
            "containers": [
                {
                    "name": CONTAINER,
                    "image": container["image"],
                    "imagePullPolicy": container.get("imagePullPolicy", "IfNotPresent"),
                    "command": [sys.executable, "-m", SUPERVISOR, pipe_dir, preload, binary, "-f"],
                    "env": [{"name": k, "value": v} for k, v in sorted(env.items())],
                    "volumeMounts": mounts,
                    "securityContext": container.get("securityContext") or {},
                    "resources": self.resources,
                }
            ],
        }
        for key in ("priorityClassName", "imagePullSecrets", "securityContext"):
            if spec.get(key):
                pod_spec[key] = spec[key]
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": self.pod_name(daemon_id),
                "namespace": self.plugin.namespace,
                "labels": labels,
                "annotations": {"dra-gpu.io/made-by": plugin["metadata"]["name"]},
                "ownerReferences": [
                    {
                        "apiVersion": "v1",
                        "kind": "Node",
                        "name": self.plugin.node_name,
                        "uid": base["node_uid"],
                        "controller": True,
                        "blockOwnerDeletion": False,
                    }
                ],
            },
            "spec": pod_spec,
        }

    def create(self, daemon_id: str, pipe_dir: str, shm_dir: str, binary: str, env: dict[str, str]) -> str:
        """Create the daemon's pod; its name. One that exists already (another instance of the
        plugin made it) is kept: the name is the daemon's, there is never a second."""
        body = self.manifest(daemon_id, pipe_dir, shm_dir, binary, env)
        name = str(body["metadata"]["name"])
        try:
            self._call(lambda: self.kube.create(self.collection, body))
        except DaemonPodError as exc:
            cause = exc.__cause__
            if isinstance(cause, KubeError) and cause.status == HTTP_CONFLICT:
                log.info("MPS daemon pod exists already, kept pod=%s", name)
                return name
            raise DaemonPodError(
                f"MPS daemon pod {self.plugin.namespace}/{name}: not created: {exc}"
            ) from exc
        log.info("MPS daemon pod created pod=%s", name)
        return name

    def get(self, daemon_id: str) -> dict[str, Any] | None:
        name = self.pod_name(daemon_id)
        return self._call(lambda: self.kube.get_json(f"{self.collection}/{name}"))

    def running(self, daemon_id: str) -> bool:
        """Whether the daemon's pod runs its container (False when unreadable: not known to run)."""
        try:
            pod = self.get(daemon_id)
        except DaemonPodError:
            return False
        status = (pod or {}).get("status") or {}
        containers = status.get("containerStatuses") or []
        return status.get("phase") == "Running" and any(
            "running" in (c.get("state") or {}) for c in containers
        )

    def describe(self, daemon_id: str) -> str:
        """The pod's phase and its container's state, for an error message."""
        try:
            pod = self.get(daemon_id)
        except DaemonPodError as exc:
            return f"pod {self.pod_name(daemon_id)}: unreadable: {exc}"
        if pod is None:
            return f"pod {self.pod_name(daemon_id)}: not there"
        status = pod.get("status") or {}
        states = [
            f"{kind} {detail.get('reason') or ''} {detail.get('message') or ''}".strip()
            for c in status.get("containerStatuses") or []
            for kind, detail in (c.get("state") or {}).items()
        ]
        return f"pod {self.pod_name(daemon_id)}: {status.get('phase', '?')} {'; '.join(states)}".strip()

    def ids(self) -> set[str]:
        """The ids of this node's daemon pods that this plugin's release made."""
        instance = (self._base()["pod"]["metadata"].get("labels") or {}).get("app.kubernetes.io/instance")

        def ours(pod: dict[str, Any]) -> bool:
            labels = pod.get("metadata", {}).get("labels") or {}
            return (
                labels.get(COMPONENT_LABEL) == COMPONENT
                and DAEMON_LABEL in labels
                and labels.get("app.kubernetes.io/instance") == instance
            )

        field = f"spec.nodeName={self.plugin.node_name}"
        pods, _ = self._call(lambda: self.kube.list_objects(self.collection, field, keep=ours))
        return {p["metadata"]["labels"][DAEMON_LABEL] for p in pods}

    def delete(self, daemon_id: str) -> None:
        """Delete the daemon's pod and wait (bounded) until it is gone: its containers stopped."""
        name = self.pod_name(daemon_id)
        path = f"{self.collection}/{name}"
        if not self._call(lambda: self.kube.delete(path, DELETE_GRACE_S)):
            return

        @retry(
            retry=retry_if_result(bool),
            wait=wait_exponential(multiplier=0.05, max=1.0),
            stop=stop_after_delay(self.delete_timeout),
        )
        def still_there() -> bool:
            return self._call(lambda: self.kube.get_json(path)) is not None

        started = time.monotonic()
        try:
            still_there()
        except RetryError as exc:
            raise DaemonPodError(
                f"MPS daemon pod {self.plugin.namespace}/{name}: still there {self.delete_timeout:g}s "
                "after its deletion"
            ) from exc
        log.info("MPS daemon pod deleted pod=%s seconds=%.1f", name, time.monotonic() - started)
