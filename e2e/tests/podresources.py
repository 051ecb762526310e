"""A client of the kubelet's PodResources API (v1): what a GPU metrics exporter (dcgm-exporter)
reads to map a device to the pod and container using it. The kubelet lists a running pod's DRA
claims with, per allocated device, the CDI device names our plugin returned from
NodePrepareResources (`k8s.gpu.dra-gpu.io/claim=<claim UID>-<device>`).

The stubs are generated at first use, never committed: from `api.proto` of the k8s.io/kubelet
module of the Kubernetes release pinned in e2e/node/versions.sh (K8S_VERSION v1.X.Y is
k8s.io/kubelet v0.X.Y, as e2e/node/build.sh pins the staging modules; building the e2e kubelet
downloads that module), found in Go's module cache (`go env GOMODCACHE`, else
$HOME/go/pkg/mod). A copy of the proto, with any gogo-protobuf import and options taken out
(protoc cannot resolve them without gogo's protos; the api.proto of v0.34.4 and later has none),
is compiled by grpc_tools.protoc into a cache dir: under the e2e state dir ($DRA_GPU_E2E_STATE)
when that is writable, else under the temp dir. The cache key holds the module version, the
proto's digest and grpcio-tools' version, so a new pin or a new grpcio-tools generates afresh.

Feature gates at v1.37.2 (pkg/features/kube_features.go): KubeletPodResourcesGet and
KubeletPodResourcesDynamicResources are GA since 1.36 and locked to true, so the Get RPC and
the DRA fields are always served (1.37.2's kubelet serves the whole socket only under
KubeletPodResourcesGet, and fills the DRA fields under DynamicResourceAllocation alone). Both
were alpha and off by default in 1.27-1.33, beta and on in 1.34-1.35.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc

ROOT = Path(__file__).resolve().parents[2]
VERSIONS = ROOT / "e2e" / "node" / "versions.sh"
KUBELET_MODULE = "k8s.io/kubelet"
PROTO_IN_MODULE = Path("pkg/apis/podresources/v1/api.proto")
# The generated copy's file name: protoc names the modules after it, and `api_pb2` is too generic
# a top-level name for sys.modules and protobuf's default descriptor pool.
STUB_NAME = "kubelet_podresources_v1"
# The kubelet serves <root-dir>/pod-resources/kubelet.sock; the e2e harness may move its root dir.
SOCKET = (
    Path(os.environ.get("DRA_GPU_E2E_KUBELET_ROOT", "/var/lib/kubelet")) / "pod-resources" / "kubelet.sock"
)
# What Kubernetes' own node e2e tests allow a response (test/e2e_node/util.go,
# defaultPodResourcesMaxSize); gRPC's default of 4 MiB can be short on a node with many pods.
MAX_MESSAGE = 16 * 1024 * 1024


class ProtoNotFound(FileNotFoundError):
    """The kubelet module's api.proto is not in Go's module cache."""


class PodResourcesError(RuntimeError):
    """A PodResources RPC failed; `code` is the gRPC status code (None: no RPC was made)."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code


# --- records: the fields of api.proto's messages, by their names there ---


@dataclass(frozen=True)
class NUMANode:
    ID: int


@dataclass(frozen=True)
class TopologyInfo:
    nodes: tuple[NUMANode, ...]


@dataclass(frozen=True)
class ContainerDevices:
    """A device plugin's devices (extended resources such as nvidia.com/gpu), not DRA's."""

    resource_name: str
    device_ids: tuple[str, ...]
    topology: TopologyInfo | None


@dataclass(frozen=True)
class ContainerMemory:
    memory_type: str
    size: int
    topology: TopologyInfo | None


@dataclass(frozen=True)
class CDIDevice:
    name: str  # fully qualified: <vendor>/<class>=<device>


@dataclass(frozen=True)
class ClaimResource:
    """One allocated device of a claim. kubelet v1.37.2 (cm GetDynamicResources) builds one
    cdi_devices list per driver and appends each device's names to it, so the k-th device of a
    driver in a claim also lists the CDI names of the devices before it."""

    cdi_devices: tuple[CDIDevice, ...]
    driver_name: str
    pool_name: str
    device_name: str
    share_id: str | None  # unset unless the device is shared (and on kubelets before share_id)


@dataclass(frozen=True)
class DynamicResource:
    claim_name: str
    claim_namespace: str
    claim_resources: tuple[ClaimResource, ...]


@dataclass(frozen=True)
class ContainerResources:
    name: str
    devices: tuple[ContainerDevices, ...]
    cpu_ids: tuple[int, ...]
    memory: tuple[ContainerMemory, ...]
    dynamic_resources: tuple[DynamicResource, ...]


@dataclass(frozen=True)
class PodResources:
    name: str
    namespace: str
    containers: tuple[ContainerResources, ...]
    cpu_ids: tuple[int, ...]  # pod-level exclusive CPUs (kubelet 1.37+; empty before)
    memory: tuple[ContainerMemory, ...]  # pod-level memory blocks (kubelet 1.37+; empty before)

    def container(self, name: str) -> ContainerResources:
        for c in self.containers:
            if c.name == name:
                return c
        have = [c.name for c in self.containers]
        raise KeyError(f"pod {self.namespace}/{self.name} has no container {name!r} in containers: {have}")

    def cdi_devices(self) -> dict[str, list[str]]:
        """claim_name -> the CDI device names the kubelet lists for it, over all containers
        (each name once, in the order listed)."""
        out: dict[str, list[str]] = {}
        for c in self.containers:
            for dr in c.dynamic_resources:
                names = out.setdefault(dr.claim_name, [])
                for cr in dr.claim_resources:
                    names.extend(d.name for d in cr.cdi_devices if d.name not in names)
        return out


# --- stubs: generated at first use ---


@dataclass(frozen=True)
class Stubs:
    pb2: ModuleType
    pb2_grpc: ModuleType
    proto: Path  # the module cache's api.proto they were generated from


_stubs: Stubs | None = None


def k8s_version(versions: Path = VERSIONS) -> str:
    """K8S_VERSION of e2e/node/versions.sh."""
    for line in versions.read_text().splitlines():
        if line.startswith("K8S_VERSION="):
            return line.split("=", 1)[1].strip().strip("\"'")
    raise ValueError(f"{versions} has no K8S_VERSION")


def kubelet_module_version(k8s: str) -> str:
    """k8s.io/kubelet's version for a Kubernetes release: v1.X.Y -> v0.X.Y."""
    m = re.fullmatch(r"v1\.(\d+\.\d+(?:-[0-9A-Za-z.-]+)?)", k8s)
    if not m:
        raise ValueError(f"K8S_VERSION {k8s!r} is not a v1.X.Y release")
    return f"v0.{m.group(1)}"


def go_mod_cache() -> Path:
    """`go env GOMODCACHE`, or $HOME/go/pkg/mod (Go's default) where go is missing or says nothing."""
    go = shutil.which("go")
    if go:
        r = subprocess.run([go, "env", "GOMODCACHE"], capture_output=True, text=True, timeout=30)
        if r.returncode == 0 and r.stdout.strip():
            return Path(r.stdout.strip())
    return Path.home() / "go" / "pkg" / "mod"


def api_proto(k8s: str | None = None, mod_cache: Path | None = None) -> Path:
    """api.proto of k8s.io/kubelet for `k8s` (default: the pinned K8S_VERSION)."""
    version = kubelet_module_version(k8s or k8s_version())
    path = (mod_cache or go_mod_cache()) / f"{KUBELET_MODULE}@{version}" / PROTO_IN_MODULE
    if not path.is_file():
        raise ProtoNotFound(
            f"{path} is missing: the PodResources API of {KUBELET_MODULE}@{version} is not in Go's "
            f"module cache (`e2e/node/build.sh podresources`)"
        )
    return path


_GOGO_IMPORT = re.compile(r'^[ \t]*import\s+(?:public\s+|weak\s+)?"[^"]*gogo[^"]*";[ \t]*\n?', re.M)
_GOGO_FILE_OPTION = re.compile(r"^[ \t]*option\s+\(gogoproto\.[^)]*\)\s*=[^;]*;[ \t]*\n?", re.M)
_GOGO_FIELD_OPTIONS = re.compile(r"[ \t]*\[\s*\(gogoproto\.[^\]]*\]")


def strip_gogo(text: str) -> str:
    """The proto without gogo-protobuf's import, file options and field options: Go code-generation
    hints only, which change nothing on the wire."""
    text = _GOGO_IMPORT.sub("", text)
    text = _GOGO_FILE_OPTION.sub("", text)
    return _GOGO_FIELD_OPTIONS.sub("", text)


def default_cache_dir() -> Path:
    state = Path(os.environ.get("DRA_GPU_E2E_STATE", "/var/lib/dra-gpu-e2e"))
    if state.is_dir() and os.access(state, os.W_OK):
        return state / "podresources-stubs"
    return Path(tempfile.gettempdir()) / f"dra-gpu-podresources-stubs-{os.getuid()}"


def _generate(proto_text: str, out: Path) -> None:
    from grpc_tools import protoc  # dev dependency (pyproject's dev extra), as for the driver's stubs

    # Generated beside the final dir and renamed into place: two test processes may race here.
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        (work / f"{STUB_NAME}.proto").write_text(proto_text)
        include = Path(protoc.__file__).parent / "_proto"
        args = [
            "protoc",
            f"-I{work}",
            f"-I{include}",
            f"--python_out={work}",
            f"--grpc_python_out={work}",
            str(work / f"{STUB_NAME}.proto"),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"grpc_tools.protoc failed on {work / STUB_NAME}.proto (from api.proto)")
        work.chmod(0o755)  # mkdtemp's 0700 would hide a shared cache from other users
        try:
            work.rename(out)
        except OSError:
            if not (out / f"{STUB_NAME}_pb2_grpc.py").is_file():  # not another process's result
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _load_module(name: str, path: Path) -> ModuleType:
    loaded = sys.modules.get(name)
    if loaded is not None and getattr(loaded, "__file__", None) == str(path):
        return loaded  # this file loaded twice (by path and by name): one descriptor pool entry
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load generated stub {path}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # the _grpc module imports the _pb2 module by this name
    spec.loader.exec_module(mod)
    return mod


def load_stubs(cache_dir: Path | None = None, proto: Path | None = None) -> Stubs:
    """The generated modules (generated on the first call of the process; later calls return
    them whatever their arguments). Raises ProtoNotFound when the module cache lacks api.proto."""
    global _stubs
    if _stubs is not None:
        return _stubs
    proto = proto or api_proto()
    text = strip_gogo(proto.read_text())
    key = hashlib.sha256(text.encode()).hexdigest()[:16]
    tools = importlib.metadata.version("grpcio-tools")
    out = (cache_dir or default_cache_dir()) / f"{proto.parents[4].name}-{key}-grpcio-tools-{tools}"
    if not (out / f"{STUB_NAME}_pb2_grpc.py").is_file():
        _generate(text, out)
    pb2 = _load_module(f"{STUB_NAME}_pb2", out / f"{STUB_NAME}_pb2.py")
    pb2_grpc = _load_module(f"{STUB_NAME}_pb2_grpc", out / f"{STUB_NAME}_pb2_grpc.py")
    _stubs = Stubs(pb2, pb2_grpc, proto)
    return _stubs


# --- messages to records ---


def _defines(msg: Any, field: str) -> bool:
    """Whether the generated message has `field` (an older pin's api.proto may lack it)."""
    return field in msg.DESCRIPTOR.fields_by_name


def _topology(msg: Any) -> TopologyInfo | None:
    if not msg.HasField("topology"):
        return None
    return TopologyInfo(tuple(NUMANode(n.ID) for n in msg.topology.nodes))


def _memory(msgs: Any) -> tuple[ContainerMemory, ...]:
    return tuple(ContainerMemory(m.memory_type, m.size, _topology(m)) for m in msgs)


def _claim_resource(msg: Any) -> ClaimResource:
    share = msg.share_id if _defines(msg, "share_id") and msg.HasField("share_id") else None
    return ClaimResource(
        cdi_devices=tuple(CDIDevice(d.name) for d in msg.cdi_devices),
        driver_name=msg.driver_name,
        pool_name=msg.pool_name,
        device_name=msg.device_name,
        share_id=share,
    )


def _container(msg: Any) -> ContainerResources:
    return ContainerResources(
        name=msg.name,
        devices=tuple(
            ContainerDevices(d.resource_name, tuple(d.device_ids), _topology(d)) for d in msg.devices
        ),
        cpu_ids=tuple(msg.cpu_ids),
        memory=_memory(msg.memory),
        dynamic_resources=tuple(
            DynamicResource(
                claim_name=dr.claim_name,
                claim_namespace=dr.claim_namespace,
                claim_resources=tuple(_claim_resource(cr) for cr in dr.claim_resources),
            )
            for dr in msg.dynamic_resources
        ),
    )


def pod_resources(msg: Any) -> PodResources:
    """The record of a generated PodResources message."""
    return PodResources(
        name=msg.name,
        namespace=msg.namespace,
        containers=tuple(_container(c) for c in msg.containers),
        cpu_ids=tuple(msg.cpu_ids) if _defines(msg, "cpu_ids") else (),
        memory=_memory(msg.memory) if _defines(msg, "memory") else (),
    )


# --- the RPCs ---


def _call(socket: Path, rpc: str, request: Any, timeout: float, what: str) -> Any:
    if not socket.exists():
        raise PodResourcesError(f"{what}: the kubelet's PodResources socket {socket} does not exist")
    stubs = load_stubs()
    options = [("grpc.max_receive_message_length", MAX_MESSAGE)]
    with grpc.insecure_channel(f"unix://{socket}", options=options) as channel:
        client = stubs.pb2_grpc.PodResourcesListerStub(channel)
        try:
            return getattr(client, rpc)(request, timeout=timeout)
        except grpc.RpcError as e:
            code = e.code() if isinstance(e, grpc.Call) else None
            details = e.details() if isinstance(e, grpc.Call) else str(e)
            name = code.name if code else "?"
            raise PodResourcesError(
                f"{what}: PodResourcesLister/{rpc} on {socket}: {name}: {details}", code
            ) from e


def list_pod_resources(socket: Path = SOCKET, timeout: float = 5.0) -> list[PodResources]:
    """PodResourcesLister/List: the node's pods with their containers' resources; since 1.34 the
    active ones only, not those terminated (feature gate KubeletPodResourcesListUseActivePods,
    default on). Sidecars (restartable init containers) are listed among the containers."""
    stubs = load_stubs()
    resp = _call(socket, "List", stubs.pb2.ListPodResourcesRequest(), timeout, "list pod resources")
    return [pod_resources(p) for p in resp.pod_resources]


def get_pod_resources(namespace: str, name: str, socket: Path = SOCKET, timeout: float = 5.0) -> PodResources:
    """PodResourcesLister/Get: one pod's resources. The RPC is behind the kubelet's feature gate
    KubeletPodResourcesGet: alpha and off by default in 1.27-1.33 (the call then fails), beta and
    on in 1.34-1.35, GA and locked on from 1.36. The kubelet answers a pod it does not know or no
    longer runs with an error (status UNKNOWN, "pod <name> in namespace <ns> not found")."""
    stubs = load_stubs()
    req = stubs.pb2.GetPodResourcesRequest(pod_name=name, pod_namespace=namespace)
    resp = _call(socket, "Get", req, timeout, f"pod resources of {namespace}/{name}")
    return pod_resources(resp.pod_resources)
