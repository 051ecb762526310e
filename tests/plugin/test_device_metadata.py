"""Device metadata (KEP-5304): the file each request of a prepared claim gets, its CDI spec and CDI
ID, for every kind of claim; kept across restarts, removed at unprepare, refused whole when it
cannot be written; on by the kubelet's version (auto), or as the flag says."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

import pytest

from dra_gpu.kube.values import DNS_LABEL, DNS_SUBDOMAIN, SEMVER, qualified_name_problem
from dra_gpu.kubeletplugin.driver import ClaimRef
from dra_gpu.model.config import API_VERSION
from dra_gpu.model.nvidia_compat import DRIVER_NAME as NVIDIA_DRIVER
from dra_gpu.node.catalog import DeviceCatalog
from dra_gpu.node.settings import NodeSettings
from dra_gpu.node.slices import SliceBuilder
from dra_gpu.plugin.checkpoint import COMPLETED
from dra_gpu.plugin.device_metadata import (
    API_VERSIONS,
    CONTAINER_DIR,
    POD_CLAIM_NAME_ANNOTATION,
    DeviceMetadata,
    decide,
    kubelet_version,
)
from dra_gpu.plugin.plan import PrepareError
from dra_gpu.plugin.record import ClaimRecord, ClaimState, MetadataInputs, PreparedDevice
from dra_gpu.plugin.server import KubeletPlugin, PluginConfig
from plugin.conftest import (
    DRIVER,
    NODE,
    PluginCore,
    claim,
    gpu_names,
    make_core,
    mig_names,
    prepare_claim,
    validate_cdi,
)
from plugin.test_dynamic_mig_prepare import GPU0, start_node
from plugin.test_dynamic_mig_prepare import PROFILE as H100_PROFILE
from tests.driver_root import make_root

PREVIOUS = Path(__file__).parent.parent / "data" / "checkpoint-previous-release.json"
CHECKER = Path(__file__).parent.parent / "data" / "metadata-check"  # upstream's reader, in Go
# A UUID that starts with a digit (CDI 0.5.0 for the device name) and one that does not (0.3.0).
UID_DIGIT = "11111111-2222-4333-8444-555555555555"
UID_LETTER = "abcdef01-2222-4333-8444-555555555555"


@pytest.fixture
def mcore(core: PluginCore) -> PluginCore:
    """The core of the plugin's tests, writing device metadata (as on a 1.37 kubelet)."""
    core.preparer.metadata.enabled = True
    return core


def ref_of(c: dict[str, Any]) -> ClaimRef:
    m = c["metadata"]
    return ClaimRef(m["namespace"], m["uid"], m["name"])


def from_template(c: dict[str, Any], pod_claim: str) -> dict[str, Any]:
    """The claim as the ResourceClaim controller makes it from a pod's template."""
    c["metadata"]["annotations"] = {POD_CLAIM_NAME_ANNOTATION: pod_claim}
    return c


def prepare(core: PluginCore, c: dict[str, Any]) -> list[PreparedDevice]:
    core.add(c)
    return asyncio.run(prepare_claim(core.preparer, ref_of(c)))


def metadata_file(core: PluginCore, c: dict[str, Any], request: str) -> Path:
    m = c["metadata"]
    return (
        core.root
        / "plugin"
        / "dra-device-metadata"
        / f"{m['namespace']}_{m['name']}"
        / request
        / "metadata.json"
    )


def metadata_spec(core: PluginCore, c: dict[str, Any], request: str) -> Path:
    return core.cdi.dir / f"{DRIVER}_metadata_{c['metadata']['uid']}_{request}.json"


def published(core: PluginCore, device: str) -> dict[str, Any]:
    """The device's attributes as the node's ResourceSlice publishes them."""
    catalog = DeviceCatalog.build(core.inventory)
    return SliceBuilder(catalog, DRIVER).device(catalog[device])["attributes"]


def objects(text: str) -> list[dict[str, Any]]:
    """The JSON stream's objects, in order (as json.Decoder reads a stream)."""
    decoder, out, i = json.JSONDecoder(), [], 0
    while i < len(text):
        obj, i = decoder.raw_decode(text, i)
        out.append(obj)
        while i < len(text) and text[i].isspace():
            i += 1
    return out


def indented(value: Any, depth: int) -> str:
    """`value` as a 2-space indented JSON block nested `depth` levels deep (its first line bare)."""
    return json.dumps(value, indent=2).replace("\n", "\n" + "  " * depth)


# -- what the upstream Go types accept (k8s.io/dynamic-resource-allocation@v0.37.2,
# api/metadata/v1beta1/types.go and v1alpha1, the same shape; resource.k8s.io/v1 DeviceAttribute):
# the JSON names of each struct's fields, the required ones, and the validation's limits.
OBJECT_META = {
    "name", "generateName", "namespace", "selfLink", "uid", "resourceVersion", "generation",
    "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds", "labels", "annotations",
    "ownerReferences", "finalizers", "managedFields",
}  # fmt: skip
DEVICE_METADATA = {"kind", "apiVersion", "metadata", "podClaimName", "requests"}
REQUEST, REQUEST_REQUIRED = {"name", "devices"}, {"name"}
DEVICE, DEVICE_REQUIRED = {"driver", "pool", "name", "attributes", "networkData"}, {"driver", "pool", "name"}
ATTRIBUTE = {"int", "bool", "string", "version"}


def upstream_problems(doc: dict[str, Any], version: str) -> list[str]:
    """What the upstream decoder (strict: unknown fields) and validation would refuse in `doc`."""
    problems = []

    def fields(
        where: str, obj: Any, known: set[str], required: frozenset[str] | set[str] = frozenset()
    ) -> None:
        if not isinstance(obj, dict):
            problems.append(f"{where}: not an object")
            return
        problems.extend(f"{where}.{k}: unknown field" for k in set(obj) - known)
        problems.extend(f"{where}.{k}: required" for k in required if not obj.get(k))

    fields("", doc, DEVICE_METADATA)
    if doc.get("kind") != "DeviceMetadata" or doc.get("apiVersion") != version:
        problems.append(f"kind/apiVersion: {doc.get('kind')} {doc.get('apiVersion')}")
    fields("metadata", doc.get("metadata"), OBJECT_META)
    if "podClaimName" in doc and not DNS_LABEL.match(str(doc["podClaimName"])):
        problems.append("podClaimName: not a DNS label")
    for i, request in enumerate(doc.get("requests") or []):
        fields(f"requests[{i}]", request, REQUEST, REQUEST_REQUIRED)
        for j, device in enumerate(request.get("devices") or []):
            where = f"requests[{i}].devices[{j}]"
            fields(where, device, DEVICE, DEVICE_REQUIRED)
            if len(device["driver"]) > 63 or not DNS_SUBDOMAIN.match(device["driver"]):
                problems.append(f"{where}.driver")
            if len(device["pool"]) > 253 or not all(
                DNS_SUBDOMAIN.match(p) for p in device["pool"].split("/")
            ):
                problems.append(f"{where}.pool")
            if len(device["name"]) > 63 or not DNS_LABEL.match(device["name"]):
                problems.append(f"{where}.name")
            attrs = device.get("attributes") or {}
            if len(attrs) > 32:
                problems.append(f"{where}.attributes: {len(attrs)} > 32")
            for key, value in attrs.items():
                if qualified_name_problem(key):
                    problems.append(f"{where}.attributes[{key}]: {qualified_name_problem(key)}")
                fields(f"{where}.attributes[{key}]", value, ATTRIBUTE)
                if len(value) != 1:
                    problems.append(f"{where}.attributes[{key}]: exactly one value")
                for kind, v in value.items():
                    ok = {
                        "int": isinstance(v, int) and not isinstance(v, bool),
                        "bool": isinstance(v, bool),
                        "string": isinstance(v, str) and len(v) <= 64,
                        "version": isinstance(v, str) and len(v) <= 64 and bool(SEMVER.match(v)),
                    }.get(kind, False)
                    if not ok:
                        problems.append(f"{where}.attributes[{key}].{kind}: {v!r}")
    return problems


def assert_upstream_accepts(text: str) -> list[dict[str, Any]]:
    """The file's stream: v1beta1 then v1alpha1, the same object, each one accepted upstream."""
    docs = objects(text)
    assert [d["apiVersion"] for d in docs] == list(API_VERSIONS)
    for doc, version in zip(docs, API_VERSIONS, strict=True):
        assert upstream_problems(doc, version) == []
    assert {**docs[1], "apiVersion": API_VERSIONS[0]} == docs[0]
    return docs


def metadata_checker() -> str:
    """tests/data/metadata-check built against k8s.io/dynamic-resource-allocation v0.37.2 (cached
    by its source's digest under $DRA_GPU_CACHE/bin, as deploy/build-helm.sh caches Helm)."""
    digest = hashlib.sha256(b"".join((CHECKER / f).read_bytes() for f in ("go.mod", "main.go"))).hexdigest()
    cache = Path(os.environ.get("DRA_GPU_CACHE", Path.home() / ".cache" / "dra-gpu"))
    out = cache / "bin" / f"metadata-check-{digest[:12]}" / "metadata-check"
    if out.exists():
        return str(out)
    if shutil.which("go") is None:
        pytest.skip("no Go: upstream's metadata reader cannot be built (tests/data/metadata-check)")
    with tempfile.TemporaryDirectory() as ws:
        for f in ("go.mod", "main.go"):
            shutil.copy(CHECKER / f, ws)
        env = {**os.environ, "GOFLAGS": "-mod=mod"}
        for cmd in (["go", "mod", "tidy"], ["go", "build", "-o", str(out) + ".tmp", "."]):
            r = subprocess.run(cmd, cwd=ws, env=env, capture_output=True, text=True, timeout=600)
            assert r.returncode == 0, f"{' '.join(cmd)}:\n{r.stderr[-3000:]}"
    os.replace(str(out) + ".tmp", out)
    return str(out)


# -- the files ---------------------------------------------------------------------------------


def test_a_whole_gpu_claim_from_a_template_gets_exactly_this_file(mcore: PluginCore) -> None:
    gpu = gpu_names(mcore)[0]
    c = from_template(claim(UID_DIGIT, [gpu], name="pod-gpus-x7k2q", requests=["gpus"]), "gpus")
    prepare(mcore, c)
    attrs = published(mcore, gpu)
    assert {"uuid", "productName", "type", "nvlinkDomain", "resource.kubernetes.io/pcieRoot"} <= set(attrs)
    sorted_attrs = {k: attrs[k] for k in sorted(attrs)}
    body = """{{
  "kind": "DeviceMetadata",
  "apiVersion": "{version}",
  "metadata": {{
    "name": "pod-gpus-x7k2q",
    "namespace": "default",
    "uid": "{uid}",
    "generation": 1
  }},
  "podClaimName": "gpus",
  "requests": [
    {{
      "name": "gpus",
      "devices": [
        {{
          "driver": "gpu.dra-gpu.io",
          "pool": "node-a",
          "name": "{gpu}",
          "attributes": {attributes}
        }}
      ]
    }}
  ]
}}
"""
    expected = "".join(
        body.format(version=v, uid=UID_DIGIT, gpu=gpu, attributes=indented(sorted_attrs, 5))
        for v in API_VERSIONS
    )
    path = metadata_file(mcore, c, "gpus")
    assert path.read_text() == expected
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    for d in (path.parent, path.parent.parent, path.parent.parent.parent):
        assert stat.S_IMODE(d.stat().st_mode) == 0o755 & ~_umask(), d
    docs = assert_upstream_accepts(expected)
    assert list(docs[0]["requests"][0]["devices"][0]["attributes"]) == sorted(attrs)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_a_mig_device_of_a_subrequest_shows_its_profile_and_parent_and_no_pod_claim_name(
    mcore: PluginCore,
) -> None:
    """A claim made by hand (no podClaimName); a FirstAvailable subrequest (the file is the base
    request's, the name in it as allocated)."""
    device = mig_names(mcore)[0]
    gpu = next(g for g in mcore.inventory.gpus for m in g.mig_devices if g.mig_device_name(m) == device)
    mig = next(m for m in gpu.mig_devices if gpu.mig_device_name(m) == device)
    c = claim(UID_LETTER, [device], name="training", requests=["mig/small"])
    prepare(mcore, c)
    text = metadata_file(mcore, c, "mig").read_text()
    docs = assert_upstream_accepts(text)
    doc = docs[0]
    assert doc["metadata"] == {"name": "training", "namespace": "default", "uid": UID_LETTER, "generation": 1}
    assert "podClaimName" not in doc and "podClaimName" not in text
    (request,) = doc["requests"]
    assert request["name"] == "mig/small"
    (entry,) = request["devices"]
    assert (entry["driver"], entry["pool"], entry["name"]) == (DRIVER, NODE, device)
    attrs = entry["attributes"]
    assert attrs == {k: published(mcore, device)[k] for k in sorted(published(mcore, device))}
    assert attrs["type"] == {"string": "mig"} and attrs["profile"] == {"string": mig.profile}
    assert attrs["uuid"] == {"string": mig.uuid} and attrs["parentUUID"] == {"string": gpu.uuid}
    assert text.startswith(
        '{\n  "kind": "DeviceMetadata",\n  "apiVersion": "metadata.resource.k8s.io/v1beta1",\n'
    )
    assert text.count("\n}\n") == 2 and text.endswith("\n}\n") and "\n}\n{\n" in text


def test_upstreams_reader_accepts_every_file_strictly(mcore: PluginCore) -> None:
    """The files as k8s.io/dynamic-resource-allocation v0.37.2 reads them: each object decoded
    strictly (no field its Go types lack) and validated, and the stream read into both versions."""
    g, m = gpu_names(mcore), mig_names(mcore)
    whole = from_template(claim(UID_DIGIT, g[:2], name="pod-a-x1", requests=["gpus", "gpus"]), "gpus")
    mig = claim(UID_LETTER, [m[0], m[1]], name="migs", requests=["one/small", "two"])
    for c in (whole, mig):
        prepare(mcore, c)
    files = [
        metadata_file(mcore, whole, "gpus"),
        metadata_file(mcore, mig, "one"),
        metadata_file(mcore, mig, "two"),
    ]
    r = subprocess.run([metadata_checker(), *map(str, files)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (
        r.stdout.count(': ok ["metadata.resource.k8s.io/v1beta1","metadata.resource.k8s.io/v1alpha1"]') == 3
    )
    # And it is not a checker that accepts anything: a field the Go types lack, 33 attributes.
    bad = mcore.root / "bad.json"
    doc = objects(files[0].read_text())[0]
    doc["requests"][0]["devices"][0]["attributes"].update({f"x{i}": {"int": i} for i in range(33)})
    bad.write_text(json.dumps(doc))
    typo = mcore.root / "typo.json"
    typo.write_text(
        files[1].read_text().replace('"podClaimName"', '"podClaim"').replace('"pool"', '"pools"', 1)
    )
    r = subprocess.run([metadata_checker(), str(bad), str(typo)], capture_output=True, text=True, timeout=60)
    assert (
        r.returncode == 1
        and "must have at most 32 items" in r.stdout
        and 'unknown field "requests[0].devices[0].pools"' in r.stdout
    ), r.stdout


def test_the_kept_device_parts_make_the_same_bytes_as_encoding_the_whole(core: PluginCore) -> None:
    catalog = DeviceCatalog.build(core.inventory)
    meta = DeviceMetadata(DRIVER, core.root / "plugin", core.cdi.dir, catalog, enabled=True)
    g, m = gpu_names(core), mig_names(core)
    devices = (
        PreparedDevice(["a"], NODE, g[0], []),
        PreparedDevice(["b"], NODE, m[0], []),
        PreparedDevice(["a"], NODE, g[1], []),
        PreparedDevice(["b"], NODE, "gone-from-the-node", []),
    )
    for pod_claim in (None, "gpus"):
        record = ClaimRecord(
            uid=UID_DIGIT,
            state=ClaimState.COMPLETED,
            namespace="ns",
            name="c",
            devices=devices,
            metadata=MetadataInputs(("a", "b/sub"), pod_claim),
        )
        for request in ("a", "b/sub"):
            for _ in range(2):  # encoded, then from what was kept
                assert meta.encode(record, request) == meta.stream(meta.document(record, request))
    assert objects(meta.encode(record, "b/sub").decode())[0]["requests"][0]["devices"][1] == {
        "driver": DRIVER,
        "pool": NODE,
        "name": "gone-from-the-node",  # a device the node no longer has: no attributes
    }


def test_the_cdi_spec_mounts_the_file_read_only_at_the_kubernetes_path(mcore: PluginCore) -> None:
    gpu = gpu_names(mcore)[0]
    by_hand = claim(UID_LETTER, [gpu], name="mine", requests=["gpus"])
    templated = from_template(claim(UID_DIGIT, [gpu_names(mcore)[1]], name="pod-x-abcde"), "big")
    for c in (by_hand, templated):
        prepare(mcore, c)
    for c, request, container, version in (
        (by_hand, "gpus", f"{CONTAINER_DIR}/resourceclaims/mine/gpus/{DRIVER}-metadata.json", "0.3.0"),
        (templated, "gpu", f"{CONTAINER_DIR}/resourceclaimtemplates/big/gpu/{DRIVER}-metadata.json", "0.5.0"),
    ):
        path = metadata_spec(mcore, c, request)
        spec = json.loads(path.read_text())
        validate_cdi(spec)
        assert spec == {
            "cdiVersion": version,  # a device name starting with a digit needs 0.5.0
            "kind": f"{DRIVER}/metadata",
            "devices": [
                {
                    "name": f"{c['metadata']['uid']}_{request}",
                    "containerEdits": {
                        "mounts": [
                            {
                                "hostPath": str(metadata_file(mcore, c, request)),
                                "containerPath": container,
                                "options": ["ro", "bind"],
                            }
                        ]
                    },
                }
            ],
        }
        assert stat.S_IMODE(path.stat().st_mode) == 0o644


def test_the_cdi_id_goes_on_the_first_device_of_each_request_only(mcore: PluginCore) -> None:
    g = gpu_names(mcore)
    c = claim(UID_DIGIT, [g[0], g[1], g[2], mig_names(mcore)[0]], requests=["a", "a", "b/one", "c"])
    devices = prepare(mcore, c)
    meta = [[i for i in d.cdi_device_ids if "/metadata=" in i] for d in devices]
    assert meta == [
        [f"{DRIVER}/metadata={UID_DIGIT}_a"],
        [],
        [f"{DRIVER}/metadata={UID_DIGIT}_b"],
        [f"{DRIVER}/metadata={UID_DIGIT}_c"],
    ]
    # Each device keeps its own claim CDI ID first.
    assert all(d.cdi_device_ids[0].startswith(f"k8s.{DRIVER}/claim=") for d in devices)
    record = mcore.checkpoint.get(UID_DIGIT)
    assert record is not None and record.metadata == MetadataInputs(("a", "b/one", "c"))
    assert record.raw["deviceMetadata"] == {"requests": ["a", "b/one", "c"]}
    files = sorted(
        p.relative_to(mcore.root).as_posix() for p in mcore.root.rglob("*metadata*") if p.is_file()
    )
    assert files == sorted(
        [
            *(f"cdi/{DRIVER}_metadata_{UID_DIGIT}_{r}.json" for r in "abc"),
            *(f"plugin/dra-device-metadata/default_{c['metadata']['name']}/{r}/metadata.json" for r in "abc"),
        ]
    )
    (doc_a,) = objects(metadata_file(mcore, c, "a").read_text())[:1]
    assert [d["name"] for d in doc_a["requests"][0]["devices"]] == [g[0], g[1]]


def test_unprepare_removes_the_claims_directory_and_specs(mcore: PluginCore) -> None:
    c = from_template(claim(UID_DIGIT, gpu_names(mcore)[:2], requests=["a", "b"]), "gpus")
    prepare(mcore, c)
    claim_dir = metadata_file(mcore, c, "a").parent.parent
    assert claim_dir.is_dir() and metadata_spec(mcore, c, "b").exists()
    asyncio.run(mcore.preparer.unprepare(ref_of(c)))
    assert not claim_dir.exists()
    assert os.listdir(mcore.root / "plugin" / "dra-device-metadata") == []
    assert os.listdir(mcore.cdi.dir) == []
    asyncio.run(mcore.preparer.unprepare(ref_of(c)))  # again: nothing to do, no error


def test_off_writes_nothing_and_adds_no_cdi_id(core: PluginCore) -> None:
    c = from_template(claim(UID_DIGIT, gpu_names(core)[:1]), "gpus")
    (device,) = prepare(core, c)
    assert device.cdi_device_ids == [core.cdi.device_id(UID_DIGIT, gpu_names(core)[0])]
    assert not (core.root / "plugin" / "dra-device-metadata").exists()
    assert [p.name for p in core.cdi.dir.iterdir()] == [core.cdi.path(UID_DIGIT).name]
    record = core.checkpoint.get(UID_DIGIT)
    assert record is not None and record.metadata is None and "deviceMetadata" not in record.raw


def test_two_claims_of_one_name_keep_each_others_files(mcore: PluginCore) -> None:
    """A claim deleted and made again under its name, prepared before the old one is unprepared:
    the old one's unprepare leaves the new one's file (the same path)."""
    g = gpu_names(mcore)
    old = claim(UID_DIGIT, [g[0]], name="same")
    prepare(mcore, old)
    new = claim(UID_LETTER, [g[1]], name="same")
    prepare(mcore, new)
    asyncio.run(mcore.preparer.unprepare(ref_of(old)))
    doc = objects(metadata_file(mcore, new, "gpu").read_text())[0]
    assert doc["metadata"]["uid"] == UID_LETTER
    assert not metadata_spec(mcore, old, "gpu").exists() and metadata_spec(mcore, new, "gpu").exists()
    asyncio.run(mcore.preparer.unprepare(ref_of(new)))
    assert not metadata_file(mcore, new, "gpu").parent.parent.exists()


# -- every kind of claim -----------------------------------------------------------------------


def timeslicing() -> list[dict[str, Any]]:
    params = {"apiVersion": API_VERSION, "kind": "GpuConfig", "sharing": {"strategy": "TimeSlicing"}}
    return [{"source": "FromClaim", "requests": [], "opaque": {"driver": DRIVER, "parameters": params}}]


def mps() -> list[dict[str, Any]]:
    params = {
        "apiVersion": API_VERSION,
        "kind": "GpuConfig",
        "sharing": {"strategy": "MPS", "mps": {"defaultActiveThreadPercentage": 50}},
    }
    return [{"source": "FromClaim", "requests": [], "opaque": {"driver": DRIVER, "parameters": params}}]


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs cc")
@pytest.mark.parametrize("kind", ["time-sliced", "MPS", "memory share"])
def test_shared_claims_get_their_metadata_too(mcore: PluginCore, kind: str) -> None:
    gpu = gpu_names(mcore)[0]
    c = claim(str(uuid.uuid4()), [gpu], config={"time-sliced": timeslicing(), "MPS": mps()}.get(kind))
    if kind == "memory share":
        (result,) = c["status"]["allocation"]["devices"]["results"]
        result["shareID"] = str(uuid.uuid4())
        result["consumedCapacity"] = {"memory": "20Gi"}
    (device,) = prepare(mcore, c)
    assert device.cdi_device_ids[-1] == f"{DRIVER}/metadata={c['metadata']['uid']}_gpu"
    (doc, _) = assert_upstream_accepts(metadata_file(mcore, c, "gpu").read_text())
    (entry,) = doc["requests"][0]["devices"]
    assert entry["name"] == gpu and entry["attributes"]["uuid"] == published(mcore, gpu)["uuid"]
    asyncio.run(mcore.preparer.unprepare(ref_of(c)))
    assert not metadata_file(mcore, c, "gpu").exists() and not metadata_spec(mcore, c, "gpu").exists()


@pytest.fixture(scope="module")
def h100_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from simnode.profiles import load_profile

    version = load_profile(H100_PROFILE).driver_version
    return make_root(tmp_path_factory.mktemp("driver") / "root", version)


@pytest.mark.parametrize("at_binding", [False, True], ids=["made-at-prepare", "made-at-binding"])
def test_a_dynamic_mig_device_shows_its_profile_parent_and_the_made_instances_uuid(
    tmp_path: Path, h100_root: Path, at_binding: bool
) -> None:
    node = start_node(tmp_path, h100_root)
    node.preparer.metadata.enabled = True
    device = f"{GPU0}-mig-3g40gb-4"
    c = from_template(claim(str(uuid.uuid4()), [device], name="dyn", requests=["mig"]), "mig")
    ref = node.add(c)
    if at_binding:
        asyncio.run(node.preparer.bind(ref, c))
    (prepared,) = asyncio.run(prepare_claim(node.preparer, ref))
    (inst,) = node.live()
    assert prepared.cdi_device_ids[-1] == f"{DRIVER}/metadata={ref.uid}_mig"
    path = node.root / "plugin" / "dra-device-metadata" / "default_dyn" / "mig" / "metadata.json"
    doc = assert_upstream_accepts(path.read_text())[0]
    assert doc["podClaimName"] == "mig"
    (entry,) = doc["requests"][0]["devices"]
    attrs = entry["attributes"]
    assert attrs["uuid"] == {"string": inst.uuid}  # not in the slice: made at prepare (or binding)
    assert attrs["profile"] == {"string": "3g.40gb"} and attrs["parentUUID"] == {"string": node.gpu0_uuid}
    assert list(attrs) == sorted(attrs)
    assert (node.cdi.dir / f"{DRIVER}_metadata_{ref.uid}_mig.json").exists()
    asyncio.run(node.preparer.unprepare(ref))
    assert node.live() == [] and not path.parent.parent.exists()
    assert os.listdir(node.cdi.dir) == []


def test_nvidia_compatible_mode_names_its_driver_and_attributes(core: PluginCore) -> None:
    catalog = DeviceCatalog.build(core.inventory)
    meta = DeviceMetadata(NVIDIA_DRIVER, core.root / "plugin", core.cdi.dir, catalog, enabled=True)
    gpu = gpu_names(core)[0]
    record = ClaimRecord(
        uid=UID_DIGIT,
        state=ClaimState.COMPLETED,
        namespace="default",
        name="c",
        devices=(PreparedDevice(["gpu"], NODE, gpu, []),),
        metadata=MetadataInputs(("gpu",)),
    )
    ((_, data), (spec_path, spec)) = meta.files(record)
    doc = assert_upstream_accepts(data.decode())[0]
    (entry,) = doc["requests"][0]["devices"]
    assert entry["driver"] == NVIDIA_DRIVER
    assert entry["attributes"] == {
        k: v
        for k, v in sorted(SliceBuilder(catalog, NVIDIA_DRIVER).device(catalog[gpu])["attributes"].items())
    }
    assert spec_path.name == f"{NVIDIA_DRIVER}_metadata_{UID_DIGIT}_gpu.json"
    mount = json.loads(spec)["devices"][0]["containerEdits"]["mounts"][0]
    assert mount["containerPath"] == f"{CONTAINER_DIR}/resourceclaims/c/gpu/{NVIDIA_DRIVER}-metadata.json"
    assert json.loads(spec)["kind"] == f"{NVIDIA_DRIVER}/metadata"


# -- restarts and the checkpoint ---------------------------------------------------------------


def test_a_restart_answers_the_same_ids_and_restores_missing_files(mcore: PluginCore) -> None:
    c = from_template(claim(UID_DIGIT, gpu_names(mcore)[:1]), "gpus")
    first = prepare(mcore, c)
    written = metadata_file(mcore, c, "gpu").read_bytes()
    metadata_file(mcore, c, "gpu").unlink()
    metadata_spec(mcore, c, "gpu").unlink()
    # An orphan another run left (a claim unprepared while the plugin was down) and a temp file.
    orphan = mcore.root / "plugin" / "dra-device-metadata" / "default_gone" / "gpu" / "metadata.json"
    orphan.parent.mkdir(parents=True)
    orphan.write_text("{}")
    (mcore.cdi.dir / f"{DRIVER}_metadata_{UID_LETTER}_gpu.json").write_text("{}")
    (metadata_file(mcore, c, "gpu").parent / ".metadata.json.abcd1234.tmp").write_text("x")
    # The flag is off now: a claim that has metadata keeps it (the kubelet has its CDI IDs).
    again = mcore.restart(device_metadata=False)
    counts = again.preparer.reconcile()
    assert counts["metadataRestored"] == 2 and counts["metadataRemoved"] == 2, counts
    assert metadata_file(again, c, "gpu").read_bytes() == written
    assert metadata_spec(again, c, "gpu").exists()
    assert not orphan.parent.parent.exists()
    assert os.listdir(metadata_file(again, c, "gpu").parent) == ["metadata.json"]
    assert sorted(os.listdir(again.cdi.dir)) == sorted(
        [again.cdi.path(UID_DIGIT).name, metadata_spec(again, c, "gpu").name]
    )
    assert asyncio.run(prepare_claim(again.preparer, ref_of(c))) == first
    assert again.preparer.reconcile() == {"rolledBack": 0, "rebuilt": 0, "removed": 0}  # nothing more
    asyncio.run(again.preparer.unprepare(ref_of(c)))
    assert os.listdir(again.cdi.dir) == []


def test_a_checkpoint_of_the_previous_release_is_answered_as_it_was(core: PluginCore) -> None:
    """Claims prepared by an earlier release (no metadata) keep their answer with metadata on."""
    path = core.root / "plugin" / "checkpoint.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(PREVIOUS, path)
    data = json.loads(PREVIOUS.read_text())["data"]
    loaded = make_core(
        core.root,
        core.inventory,
        core.claims,
        core.driver_root,
        data["bootId"],
        core.mps_root,
        device_metadata=True,
    )
    loaded.preparer.reconcile()
    for uid, raw in data["claims"].items():
        record = loaded.checkpoint.get(uid)
        assert record is not None and record.state == COMPLETED and record.metadata is None
        answer = asyncio.run(loaded.preparer.prepare(ClaimRef(raw["namespace"], uid, raw["name"]), {}))
        assert [d.to_dict() for d in answer] == raw["devices"]
    assert not list(loaded.cdi.dir.glob(f"{DRIVER}_metadata_*"))
    assert not (loaded.root / "plugin" / "dra-device-metadata").exists()


def test_a_rebuilt_checkpoint_keeps_the_metadata_its_specs_show(mcore: PluginCore) -> None:
    g = gpu_names(mcore)
    with_meta = from_template(claim(UID_DIGIT, [g[0]]), "gpus")
    prepare(mcore, with_meta)
    mcore.preparer.metadata.enabled = False
    without = claim(UID_LETTER, [g[1]])
    prepare(mcore, without)
    answers = {
        c["metadata"]["uid"]: mcore.checkpoint.get(c["metadata"]["uid"]).devices for c in (with_meta, without)
    }  # type: ignore[union-attr]
    mcore.checkpoint.path.write_text("not json")  # corrupt in this boot: rebuilt from specs and the API
    again = mcore.restart(device_metadata=True)
    assert again.checkpoint.rebuild_pending
    asyncio.run(again.preparer.rebuild(mcore.claims))
    again.preparer.reconcile()
    for uid, devices in answers.items():
        record = again.checkpoint.get(uid)
        assert record is not None and record.devices == devices
    assert again.checkpoint.get(UID_DIGIT).metadata == MetadataInputs(("gpu",), "gpus")  # type: ignore[union-attr]
    assert (
        metadata_spec(again, with_meta, "gpu").exists() and not metadata_spec(again, without, "gpu").exists()
    )


# -- failures ----------------------------------------------------------------------------------


def test_a_file_that_cannot_be_written_fails_the_prepare_naming_it_and_leaves_nothing(
    mcore: PluginCore,
) -> None:
    c = from_template(claim(UID_DIGIT, gpu_names(mcore)[:1], name="blocked"), "gpus")
    blocker = mcore.root / "plugin" / "dra-device-metadata" / "default_blocked"
    blocker.parent.mkdir(parents=True)
    blocker.write_text("in the way")  # its directory cannot be made
    with pytest.raises(PrepareError) as failed:
        prepare(mcore, c)
    message = str(failed.value)
    assert f"claim default/blocked (uid {UID_DIGIT}): cannot write its device metadata (KEP-5304)" in message
    assert str(metadata_file(mcore, c, "gpu")) in message, message
    assert mcore.checkpoint.get(UID_DIGIT) is None
    assert os.listdir(mcore.cdi.dir) == []  # neither the claim's spec nor the metadata's
    # The roll-back removed what stood in the claim directory's place (the tree is the plugin's):
    # the kubelet's retry succeeds.
    assert os.listdir(blocker.parent) == []
    prepare(mcore, c)
    assert metadata_file(mcore, c, "gpu").exists()


def test_a_name_that_cannot_make_a_path_is_refused() -> None:
    meta = DeviceMetadata(DRIVER, Path("/nonexistent"), Path("/nonexistent"), DeviceCatalog.build(_empty()))
    with pytest.raises(
        ValueError, match=re.escape("annotation resource.kubernetes.io/pod-claim-name '../x'")
    ):
        meta.inputs(["gpu"], "../x")
    with pytest.raises(ValueError, match="request 'A_B'"):
        meta.inputs(["A_B"], None)
    with pytest.raises(ValueError, match=re.escape("claim name '..'")):
        meta.file_path("default", "..", "gpu")


def _empty() -> Any:
    from dra_gpu.model.inventory import Inventory

    return Inventory(node_name=NODE, driver_version=None, cuda_driver_version=None)


# -- on, off, auto -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "kubelet", "on", "line"),
    [
        ("auto", "v1.37.2", True, "device metadata (KEP-5304) on: the kubelet is v1.37.2, beta from 1.37;"),
        ("auto", "v1.38.0-alpha.1", True, "on: the kubelet is v1.38.0-alpha.1"),
        (
            "auto",
            "v1.36.3",
            False,
            "device metadata (KEP-5304) off: the kubelet is v1.36.3; beta from 1.37; "
            "--device-metadata=on writes it anyway",
        ),
        ("auto", "v1.34.4", False, "off: the kubelet is v1.34.4; beta from 1.37"),
        ("auto", None, False, "off: the kubelet's version is not known (node n could not be read: 403)"),
        ("auto", "unknown", False, "off: the kubelet's version 'unknown' has no major.minor"),
        (
            "on",
            "v1.34.4",
            True,
            "device metadata (KEP-5304) on: --device-metadata=on (the kubelet is v1.34.4)",
        ),
        ("off", "v1.37.2", False, "device metadata (KEP-5304) off: --device-metadata=off"),
    ],
)
def test_auto_on_off_by_the_kubelets_version(mode: str, kubelet: str | None, on: bool, line: str) -> None:
    decision = decide(mode, kubelet, "node n could not be read: 403" if kubelet is None else "")
    assert decision.enabled is on
    assert line in decision.line()
    if on:
        assert CONTAINER_DIR in decision.line()


class FakeKube:
    def __init__(self, node: dict[str, Any] | None, error: Exception | None = None) -> None:
        self.node, self.error, self.paths = node, error, []

    async def get_json(self, path: str) -> dict[str, Any] | None:
        self.paths.append(path)
        if self.error is not None:
            raise self.error
        return self.node


def node_object(version: str) -> dict[str, Any]:
    return {"metadata": {"name": "n"}, "status": {"nodeInfo": {"kubeletVersion": version}}}


@pytest.mark.parametrize(
    ("mode", "kube", "on", "said"),
    [
        ("auto", FakeKube(node_object("v1.37.2")), True, "the kubelet is v1.37.2"),
        ("auto", FakeKube(node_object("v1.36.1")), False, "the kubelet is v1.36.1"),
        ("auto", FakeKube(None), False, "no node n in the API"),
        (
            "auto",
            FakeKube(None, OSError("connection refused")),
            False,
            "node n could not be read: connection",
        ),
        ("on", FakeKube(node_object("v1.34.4")), True, "--device-metadata=on (the kubelet is v1.34.4)"),
        (
            "on",
            FakeKube(None, OSError("refused")),
            True,
            "--device-metadata=on (the kubelet's version was not read)",
        ),
        ("off", FakeKube(None, AssertionError("not asked")), False, "off: --device-metadata=off"),
    ],
)
def test_the_plugin_reads_its_nodes_kubelet_version_once(
    mode: str, kube: FakeKube, on: bool, said: str
) -> None:
    settings = NodeSettings(
        node_name="n",
        driver=DRIVER,
        profile=None,
        plugin_dir=Path("/nonexistent"),
        registry_dir=Path("/nonexistent"),
        cdi_dir=Path("/nonexistent"),
        dev_root=Path("/"),
        driver_root=Path("/"),
    )
    plugin = KubeletPlugin(PluginConfig(node=settings, device_metadata=mode))
    decision = asyncio.run(plugin._device_metadata(kube))  # type: ignore[arg-type]
    assert decision.enabled is on and said in decision.line()
    assert kube.paths == ([] if mode == "off" else ["/api/v1/nodes/n"])
    assert kubelet_version(node_object("v1.37.2")) == "v1.37.2" and kubelet_version({}) is None


def test_the_flag_and_its_environment_variable_are_checked() -> None:
    dra_gpu = [sys.executable, "-m", "dra_gpu.cli", "kubelet-plugin", "--node-name", "n"]
    env = {**os.environ, "DRA_GPU_DEVICE_METADATA": "sometimes"}
    bad = subprocess.run(dra_gpu, capture_output=True, text=True, env=env, timeout=60)
    assert bad.returncode == 2
    assert "--device-metadata (or $DRA_GPU_DEVICE_METADATA): 'sometimes' is not auto, on or off" in bad.stderr
    flag = subprocess.run(
        [*dra_gpu, "--device-metadata", "maybe"], capture_output=True, text=True, timeout=60
    )
    assert flag.returncode == 2 and re.search(r"invalid choice: 'maybe'", flag.stderr)


def test_a_file_written_again_with_other_content_gets_the_next_generation(mcore: PluginCore) -> None:
    """The protocol's generation: a file the reconcile writes again because its content changed
    counts up from the one on disk; one that only differs in its generation is left as it is."""
    c = from_template(claim(UID_DIGIT, gpu_names(mcore)[:1]), "gpus")
    prepare(mcore, c)
    path = metadata_file(mcore, c, "gpu")
    written = path.read_bytes()
    assert written.count(b'    "generation": 1\n') == 2  # once a version
    path.write_bytes(written.replace(b'"NVIDIA', b'"OLD NVIDIA'))  # e.g. before a driver upgrade
    again = mcore.restart()
    assert again.preparer.reconcile().get("metadataRestored") == 1
    updated = path.read_bytes()
    assert updated == written.replace(b'    "generation": 1\n', b'    "generation": 2\n')
    third = again.restart()
    counts = third.preparer.reconcile()
    assert "metadataRestored" not in counts and path.read_bytes() == updated, counts
