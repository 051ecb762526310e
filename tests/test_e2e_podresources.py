"""e2e/tests/podresources.py without a kubelet: stubs generated from the pinned k8s.io/kubelet's
api.proto (Go's module cache), and List/Get against a fake PodResourcesLister served in this
process on a unix socket, answering what the kubelet answers for a pod with a DRA claim."""

from __future__ import annotations

import importlib.util
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import pytest

from dra_gpu.model.inventory import DEFAULT_DRIVER_NAME
from dra_gpu.plugin.cdi import CdiSpecs

MODULE = Path(__file__).resolve().parents[1] / "e2e" / "tests" / "podresources.py"

NS = "e2e-podres"
POD = "gpu-pod"
NODE = "node-a"
CLAIM_UID = "6f1c9d2e-8a4b-4c3d-9e5f-0a1b2c3d4e5f"
GPU0 = "gpu-00000000-17-00-0"
GPU1 = "gpu-00000000-2a-00-0"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("e2e_podresources", MODULE)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def pr(tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    mod = _load()
    try:
        proto = mod.api_proto()
    except mod.ProtoNotFound as e:
        pytest.skip(f"no PodResources API to generate stubs from: {e}")
    mod.load_stubs(cache_dir=tmp_path_factory.mktemp("stubs"), proto=proto)
    return mod


def _cdi(device: str) -> str:
    """Our plugin's CDI device name for a device of the claim (what NodePrepareResources returns)."""
    return CdiSpecs(Path("cdi"), DEFAULT_DRIVER_NAME).device_id(CLAIM_UID, device)


def _pod_message(pb2: Any) -> Any:
    """What kubelet v1.37.2 answers for a pod whose container `cuda` has the claim `gpus` of two
    GPUs, the second shared, and whose container `sidecar` has a device plugin's device."""
    topo = pb2.TopologyInfo(nodes=[pb2.NUMANode(ID=1)])
    return pb2.PodResources(
        name=POD,
        namespace=NS,
        containers=[
            pb2.ContainerResources(
                name="cuda",
                dynamic_resources=[
                    pb2.DynamicResource(
                        claim_name="gpus",
                        claim_namespace=NS,
                        claim_resources=[
                            pb2.ClaimResource(
                                cdi_devices=[pb2.CDIDevice(name=_cdi(GPU0))],
                                driver_name=DEFAULT_DRIVER_NAME,
                                pool_name=NODE,
                                device_name=GPU0,
                            ),
                            pb2.ClaimResource(
                                # the kubelet's list for a driver's 2nd device carries the 1st's too
                                cdi_devices=[pb2.CDIDevice(name=_cdi(GPU0)), pb2.CDIDevice(name=_cdi(GPU1))],
                                driver_name=DEFAULT_DRIVER_NAME,
                                pool_name=NODE,
                                device_name=GPU1,
                                share_id="share-1",
                            ),
                        ],
                    )
                ],
            ),
            pb2.ContainerResources(
                name="sidecar",
                devices=[
                    pb2.ContainerDevices(resource_name="example.com/nic", device_ids=["nic0"], topology=topo)
                ],
                cpu_ids=[2, 3],
                memory=[pb2.ContainerMemory(memory_type="memory", size=1 << 30, topology=topo)],
            ),
        ],
    )


class _Lister:
    """The fake kubelet: one pod; Get of any other pod fails as the kubelet's does."""

    def __init__(self, pb2: Any, delay: threading.Event | None = None) -> None:
        self.pb2 = pb2
        self.requests: list[tuple[str, Any]] = []
        self.hold = delay  # set: answer only once the event is set (a kubelet that hangs)

    def List(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.requests.append(("List", request))
        if self.hold is not None:
            self.hold.wait(10)
        return self.pb2.ListPodResourcesResponse(pod_resources=[_pod_message(self.pb2)])

    def Get(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.requests.append(("Get", request))
        if (request.pod_namespace, request.pod_name) != (NS, POD):
            # A Go handler's plain error reaches the client as UNKNOWN with its text.
            context.abort(
                grpc.StatusCode.UNKNOWN,
                f"pod {request.pod_name} in namespace {request.pod_namespace} not found",
            )
        return self.pb2.GetPodResourcesResponse(pod_resources=_pod_message(self.pb2))

    def GetAllocatableResources(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self.pb2.AllocatableResourcesResponse()


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="podres"))  # unix socket paths must stay under 108 bytes
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _serve(pr: ModuleType, lister: _Lister, sock: Path) -> Any:
    stubs = pr.load_stubs()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    stubs.pb2_grpc.add_PodResourcesListerServicer_to_server(lister, server)
    server.add_insecure_port(f"unix://{sock}")
    server.start()
    return server


@pytest.fixture
def kubelet(pr: ModuleType, sock_dir: Path) -> Iterator[tuple[_Lister, Path]]:
    lister = _Lister(pr.load_stubs().pb2)
    sock = sock_dir / "kubelet.sock"
    server = _serve(pr, lister, sock)
    try:
        yield lister, sock
    finally:
        server.stop(None)


def _expected(pr: ModuleType) -> Any:
    topo = pr.TopologyInfo((pr.NUMANode(1),))
    return pr.PodResources(
        name=POD,
        namespace=NS,
        containers=(
            pr.ContainerResources(
                name="cuda",
                devices=(),
                cpu_ids=(),
                memory=(),
                dynamic_resources=(
                    pr.DynamicResource(
                        claim_name="gpus",
                        claim_namespace=NS,
                        claim_resources=(
                            pr.ClaimResource(
                                (pr.CDIDevice(f"k8s.gpu.dra-gpu.io/claim={CLAIM_UID}-{GPU0}"),),
                                "gpu.dra-gpu.io",
                                NODE,
                                GPU0,
                                None,
                            ),
                            pr.ClaimResource(
                                (
                                    pr.CDIDevice(f"k8s.gpu.dra-gpu.io/claim={CLAIM_UID}-{GPU0}"),
                                    pr.CDIDevice(f"k8s.gpu.dra-gpu.io/claim={CLAIM_UID}-{GPU1}"),
                                ),
                                "gpu.dra-gpu.io",
                                NODE,
                                GPU1,
                                "share-1",
                            ),
                        ),
                    ),
                ),
            ),
            pr.ContainerResources(
                name="sidecar",
                devices=(pr.ContainerDevices("example.com/nic", ("nic0",), topo),),
                cpu_ids=(2, 3),
                memory=(pr.ContainerMemory("memory", 1 << 30, topo),),
                dynamic_resources=(),
            ),
        ),
        cpu_ids=(),
        memory=(),
    )


def test_stubs_come_from_the_pinned_kubelet_module(pr: ModuleType) -> None:
    pin = next(
        line.split("=", 1)[1]
        for line in (MODULE.parents[1] / "node" / "versions.sh").read_text().splitlines()
        if line.startswith("K8S_VERSION=")
    )
    stubs = pr.load_stubs()
    assert stubs.proto.parts[-6] == "kubelet@v0." + pin.removeprefix("v1.")
    # The service the kubelet registers: package v1 of api.proto, kept in the generated copy.
    assert stubs.pb2.DESCRIPTOR.services_by_name["PodResourcesLister"].full_name == "v1.PodResourcesLister"


def test_list_round_trip(pr: ModuleType, kubelet: tuple[_Lister, Path]) -> None:
    lister, sock = kubelet
    pods = pr.list_pod_resources(socket=sock, timeout=5.0)
    assert pods == [_expected(pr)]
    assert [name for name, _ in lister.requests] == ["List"]
    assert pods[0].cdi_devices() == {
        "gpus": [
            f"k8s.gpu.dra-gpu.io/claim={CLAIM_UID}-{GPU0}",
            f"k8s.gpu.dra-gpu.io/claim={CLAIM_UID}-{GPU1}",
        ]
    }
    assert pods[0].container("sidecar").dynamic_resources == ()
    with pytest.raises(KeyError, match=f"pod {NS}/{POD} has no container 'nope'"):
        pods[0].container("nope")


def test_get_round_trip(pr: ModuleType, kubelet: tuple[_Lister, Path]) -> None:
    lister, sock = kubelet
    pod = pr.get_pod_resources(NS, POD, socket=sock, timeout=5.0)
    assert pod == _expected(pr)
    ((rpc, req),) = lister.requests
    assert (rpc, req.pod_namespace, req.pod_name) == ("Get", NS, POD)


def test_get_of_an_unknown_pod_names_it(pr: ModuleType, kubelet: tuple[_Lister, Path]) -> None:
    _, sock = kubelet
    with pytest.raises(pr.PodResourcesError, match=f"pod resources of {NS}/other: .*Get.*UNKNOWN") as e:
        pr.get_pod_resources(NS, "other", socket=sock)
    assert e.value.code == grpc.StatusCode.UNKNOWN
    assert f"pod other in namespace {NS} not found" in str(e.value)


def test_a_call_times_out(pr: ModuleType, sock_dir: Path) -> None:
    release = threading.Event()
    sock = sock_dir / "kubelet.sock"
    server = _serve(pr, _Lister(pr.load_stubs().pb2, delay=release), sock)
    try:
        with pytest.raises(pr.PodResourcesError) as e:
            pr.list_pod_resources(socket=sock, timeout=0.2)
        assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        release.set()
        server.stop(None)


def test_missing_socket_is_named(pr: ModuleType, sock_dir: Path) -> None:
    sock = sock_dir / "absent.sock"
    with pytest.raises(pr.PodResourcesError, match=f"socket {sock} does not exist") as e:
        pr.list_pod_resources(socket=sock)
    assert e.value.code is None


def test_strip_gogo_keeps_the_rest() -> None:
    mod = _load()
    older = (
        'syntax = "proto3";\n\npackage v1;\noption go_package = "v1";\n\n'
        'import "github.com/gogo/protobuf/gogoproto/gogo.proto";\n\n'
        "option (gogoproto.goproto_stringer_all) = false;\n"
        "option (gogoproto.stringer_all) =  true;\n"
        'message NUMANode {\n    int64 ID = 1 [(gogoproto.customname) = "ID"];\n}\n'
    )
    assert mod.strip_gogo(older) == (
        'syntax = "proto3";\n\npackage v1;\noption go_package = "v1";\n\n\n'
        "message NUMANode {\n    int64 ID = 1;\n}\n"
    )


def test_versions_and_module_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    mod = _load()
    assert mod.kubelet_module_version("v1.37.2") == "v0.37.2"
    with pytest.raises(ValueError, match=r"K8S_VERSION '1\.37\.2' is not a v1\.X\.Y release"):
        mod.kubelet_module_version("1.37.2")
    no_pin = tmp_path / "versions.sh"
    no_pin.write_text("ETCD_VERSION=v3.6.16\n")
    with pytest.raises(ValueError, match="has no K8S_VERSION"):
        mod.k8s_version(no_pin)
    with pytest.raises(mod.ProtoNotFound, match=r"k8s\.io/kubelet@v0\.99\.0 is not in Go's module cache"):
        mod.api_proto("v1.99.0", mod_cache=tmp_path)
    # Without go on PATH: Go's default module cache under $HOME.
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path))
    assert mod.go_mod_cache() == tmp_path / "go" / "pkg" / "mod"
