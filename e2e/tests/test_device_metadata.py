"""Device metadata (KEP-5304) in the real cluster (Kubernetes 1.37, where it is beta): a pod reads
which GPUs it got from the file the plugin writes and containerd mounts through the metadata's CDI
spec; the file is what upstream's reader accepts, its UUIDs are the allocated devices', and it goes
with the claim. On an older kubelet the plugin writes none and says why: test_compat.py."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from kubernetes.client.exceptions import ApiException
from support import CACHE, ROOT, wait_for
from test_kubelet_plugin import (
    CDI_DIR,
    DRIVER,
    MIG_CLASS,
    PLUGIN_DIR,
    PROFILE,
    Plugin,
    allocated,
    claim_pod,
    device_attrs,
    ensure_device_classes,
    our_slices,
    template,
)

pytestmark = pytest.mark.e2e

CONTAINER_DIR = "/var/run/kubernetes.io/dra-device-attributes"
METADATA_DIR = PLUGIN_DIR / "dra-device-metadata"
VERSIONS = ["metadata.resource.k8s.io/v1beta1", "metadata.resource.k8s.io/v1alpha1"]
CHECKER = ROOT / "tests" / "data" / "metadata-check"


def metadata_checker() -> str:
    """tests/data/metadata-check (upstream's reader of the files, k8s.io/dynamic-resource-allocation
    v0.37.2, decoding strictly and validating), built once and cached like the e2e's programs."""
    digest = hashlib.sha256(b"".join((CHECKER / f).read_bytes() for f in ("go.mod", "main.go"))).hexdigest()
    out = CACHE / "bin" / f"metadata-check-{digest[:12]}" / "metadata-check"
    if out.exists():
        return str(out)
    assert shutil.which("go"), "the e2e tier builds its programs with Go"
    with tempfile.TemporaryDirectory() as ws:
        for f in ("go.mod", "main.go"):
            shutil.copy(CHECKER / f, ws)
        env = {**os.environ, "GOFLAGS": "-mod=mod"}
        for cmd in (["go", "mod", "tidy"], ["go", "build", "-o", f"{out}.tmp", "."]):
            r = subprocess.run(cmd, cwd=ws, env=env, capture_output=True, text=True, timeout=600)
            assert r.returncode == 0, f"{' '.join(cmd)}:\n{r.stderr[-3000:]}"
    os.replace(f"{out}.tmp", out)
    return str(out)


def objects(text: str) -> list[dict]:
    """The objects of a JSON stream, in order."""
    decoder, out, i = json.JSONDecoder(), [], 0
    text = text.strip()
    while i < len(text):
        obj, i = decoder.raw_decode(text, i)
        out.append(obj)
        while i < len(text) and text[i].isspace():
            i += 1
    return out


def plugin_said(plugin: Plugin, text: str) -> str:
    """The plugin's log line containing `text` (its message part)."""

    def line():
        lines = plugin.log_path.read_text(errors="replace").splitlines()
        return next((x for x in lines if text in x), None)

    return wait_for(f"the plugin to say {text!r}", line, timeout=30).split(" msg=", 1)[-1]


END = "--end--"


def reading(path: str) -> str:
    """A pod's command: print the file, then stay (a template's claim goes with its pod)."""
    return f"cat {path}; echo {END}; sleep 3600"


def printed(core, namespace: str, pod: str) -> str:
    """What a `reading` pod printed of its file (it runs on)."""

    def log():
        if core.read_namespaced_pod(pod, namespace).status.phase != "Running":
            return None
        text = core.read_namespaced_pod_log(pod, namespace)
        return text if END in text else None

    text = wait_for(f"pod {pod} to run and print its file", log, timeout=120)
    return text.split(END, 1)[0]


def claim_of(dyn, namespace: str, pod: str) -> dict:
    claims = dyn.resources.get(api_version="resource.k8s.io/v1", kind="ResourceClaim")
    for c in claims.get(namespace=namespace).to_dict()["items"]:
        if pod in [o.get("name") for o in c["metadata"].get("ownerReferences") or []]:
            return c
    raise AssertionError(f"no claim of pod {pod}")


def host_files(namespace: str, claim_name: str, uid: str) -> list[Path]:
    """The claim's metadata files and metadata CDI specs on the node."""
    return [
        *(METADATA_DIR / f"{namespace}_{claim_name}").rglob("*"),
        *CDI_DIR.glob(f"{DRIVER}_metadata_{uid}_*"),
    ]


def delete_and_wait_gone(core, namespace: str, pods: list[str], files: list[Path]) -> None:
    for pod in pods:
        core.delete_namespaced_pod(pod, namespace, grace_period_seconds=0)
    wait_for(
        "the claim's device metadata to be removed at unprepare",
        lambda: not any(p.exists() for p in files),
        timeout=90,
    )


@pytest.fixture(scope="module")
def metadata_plugin(target, core, dyn, tmp_path_factory):
    """The plugin as the chart runs it by default (--device-metadata auto), on the hgx-2x4 node."""
    if not target.local:
        pytest.skip("the plugin runs as a host process only on the local e2e cluster")
    node = core.list_node().items[0].metadata.name
    p = Plugin(target.kubeconfig, node, tmp_path_factory.mktemp("plugin") / "plugin.log")
    ensure_device_classes(dyn)
    p.start()
    yield p
    p.stop()
    api, items = our_slices(dyn)
    for s in items:
        api.delete(name=s["metadata"]["name"])


def restarted(plugin: Plugin, profile: str = PROFILE, extra_args: list[str] | None = None) -> None:
    plugin.stop()
    plugin.profile, plugin.extra_args = profile, extra_args or []
    plugin.start()


def test_the_plugin_says_it_writes_metadata_for_this_kubelet(metadata_plugin, core):
    (node,) = core.list_node().items
    kubelet = node.status.node_info.kubelet_version
    assert re.match(r"v1\.(3[7-9]|[4-9]\d)\.", kubelet), f"this file wants a 1.37+ kubelet, not {kubelet}"
    said = plugin_said(metadata_plugin, "device metadata (KEP-5304)")
    print(f"\n[e2e] plugin: {said}")
    assert f"device metadata (KEP-5304) on: the kubelet is {kubelet}, beta from 1.37" in said, said


def test_two_nvlink_gpus_from_a_template_read_their_uuids_and_domain(
    metadata_plugin, core, dyn, namespace, busybox_image, wait_pod
):
    template(dyn, namespace, "two-nvlink", count=2, nvlink=True)
    path = f"{CONTAINER_DIR}/resourceclaimtemplates/gpus/gpus/{DRIVER}-metadata.json"
    claim_pod(
        core,
        namespace,
        "reader",
        {"resource_claim_template_name": "two-nvlink"},
        reading(path),
        busybox_image,
    )
    text = printed(core, namespace, "reader")
    print(f"\n[e2e] {path} in the pod:\n{text}")
    claim = claim_of(dyn, namespace, "reader")
    meta = claim["metadata"]
    devices = [r["device"] for r in claim["status"]["allocation"]["devices"]["results"]]
    docs = objects(text)
    assert [d["apiVersion"] for d in docs] == VERSIONS and docs[0] == {**docs[1], "apiVersion": VERSIONS[0]}
    doc = docs[0]
    assert doc["kind"] == "DeviceMetadata" and doc["podClaimName"] == "gpus"
    assert doc["metadata"] == {
        "name": meta["name"],
        "namespace": namespace,
        "uid": meta["uid"],
        "generation": 1,
    }
    (request,) = doc["requests"]
    assert request["name"] == "gpus" and [d["name"] for d in request["devices"]] == devices
    published = {d["name"]: d["attributes"] for s in our_slices(dyn)[1] for d in s["spec"]["devices"]}
    uuids = [d["attributes"]["uuid"]["string"] for d in request["devices"]]
    assert uuids == [published[d]["uuid"]["string"] for d in devices] and len(set(uuids)) == 2
    domains = {d["attributes"]["nvlinkDomain"]["string"] for d in request["devices"]}
    assert len(domains) == 1, domains
    for d in request["devices"]:
        assert d["driver"] == DRIVER and d["pool"] == metadata_plugin.node
        assert d["attributes"] == {k: published[d["name"]][k] for k in sorted(published[d["name"]])}
        assert list(d["attributes"]) == sorted(d["attributes"])
    # On the node: the file (the same bytes), read by upstream's reader; its CDI spec; the record.
    host = METADATA_DIR / f"{namespace}_{meta['name']}" / "gpus" / "metadata.json"
    assert host.read_text() == text
    r = subprocess.run([metadata_checker(), str(host)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and f"ok {json.dumps(VERSIONS, separators=(',', ':'))}" in r.stdout, r.stdout
    spec = json.loads((CDI_DIR / f"{DRIVER}_metadata_{meta['uid']}_gpus.json").read_text())
    (mount,) = spec["devices"][0]["containerEdits"]["mounts"]
    assert mount == {"hostPath": str(host), "containerPath": path, "options": ["ro", "bind"]}
    record = json.loads((PLUGIN_DIR / "checkpoint.json").read_text())["data"]["claims"][meta["uid"]]
    ids = [[i for i in d["cdiDeviceIds"] if "/metadata=" in i] for d in record["devices"]]
    assert ids == [[f"{DRIVER}/metadata={meta['uid']}_gpus"], []], ids
    delete_and_wait_gone(
        core, namespace, ["reader"], [host, *host_files(namespace, meta["name"], meta["uid"])]
    )
    assert not host.parent.parent.exists()


def test_a_mig_claim_reads_its_profile_and_parent(
    metadata_plugin, core, dyn, namespace, busybox_image, wait_pod
):
    restarted(metadata_plugin, "dgx-a100-mig")
    try:
        wait_for(
            "MIG devices published",
            lambda: any(a.get("type") == "mig" for a in device_attrs(dyn).values()),
            timeout=10,
        )
        template(
            dyn,
            namespace,
            "mig",
            device_class=MIG_CLASS,
            selectors=[f"device.attributes['{DRIVER}'].profile == '3g.40gb'"],
        )
        path = f"{CONTAINER_DIR}/resourceclaimtemplates/gpus/gpus/{DRIVER}-metadata.json"
        claim_pod(
            core, namespace, "mig", {"resource_claim_template_name": "mig"}, reading(path), busybox_image
        )
        text = printed(core, namespace, "mig")
        print(f"\n[e2e] {path} in the MIG pod:\n{text}")
        (device,) = allocated(dyn, namespace, "mig")
        published = device_attrs(dyn)[device]
        doc = objects(text)[0]
        (entry,) = doc["requests"][0]["devices"]
        attrs = {k: next(iter(v.values())) for k, v in entry["attributes"].items()}
        assert entry["name"] == device and attrs["type"] == "mig" and attrs["profile"] == "3g.40gb"
        assert attrs["uuid"] == published["uuid"] and attrs["uuid"].startswith("MIG-")
        assert attrs["parentUUID"] == published["parentUUID"] and attrs["parentUUID"].startswith("GPU-")
        assert attrs["parentIndex"] == published["parentIndex"]
        meta = claim_of(dyn, namespace, "mig")["metadata"]
        host = METADATA_DIR / f"{namespace}_{meta['name']}" / "gpus" / "metadata.json"
        r = subprocess.run([metadata_checker(), str(host)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout
        delete_and_wait_gone(core, namespace, ["mig"], host_files(namespace, meta["name"], meta["uid"]))
    finally:
        with contextlib.suppress(ApiException):  # gone already when the test got that far
            core.delete_namespaced_pod("mig", namespace, grace_period_seconds=0)
        restarted(metadata_plugin)


def test_a_claim_by_name_keeps_its_metadata_across_a_plugin_restart(
    metadata_plugin, core, dyn, namespace, busybox_image, wait_pod
):
    """A ResourceClaim made by hand (its file under resourceclaims/<name>/), used by a pod before
    and one after a plugin restart: the restarted plugin keeps the prepared claim's file and CDI
    spec (its reconcile), so the second pod's container gets the same file."""
    claims = dyn.resources.get(api_version="resource.k8s.io/v1", kind="ResourceClaim")
    claims.create(
        namespace=namespace,
        body={
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": "mine"},
            "spec": {"devices": {"requests": [{"name": "gpus", "exactly": {"deviceClassName": DRIVER}}]}},
        },
    )
    path = f"{CONTAINER_DIR}/resourceclaims/mine/gpus/{DRIVER}-metadata.json"
    claim_pod(core, namespace, "before", {"resource_claim_name": "mine"}, reading(path), busybox_image)
    before = printed(core, namespace, "before")
    doc = objects(before)[0]
    assert "podClaimName" not in doc and doc["metadata"]["name"] == "mine"
    uid = doc["metadata"]["uid"]
    restarted(metadata_plugin)
    claim_pod(core, namespace, "after", {"resource_claim_name": "mine"}, reading(path), busybox_image)
    assert printed(core, namespace, "after") == before
    files = host_files(namespace, "mine", uid)
    assert len([f for f in files if f.is_file()]) == 2  # the file and its CDI spec
    delete_and_wait_gone(core, namespace, ["before", "after"], files)


def test_off_writes_nothing_and_the_container_has_no_metadata(
    metadata_plugin, core, dyn, namespace, busybox_image, wait_pod
):
    restarted(metadata_plugin, extra_args=["--device-metadata=off"])
    try:
        assert "device metadata (KEP-5304) off: --device-metadata=off" in plugin_said(
            metadata_plugin, "device metadata (KEP-5304) off"
        )
        template(dyn, namespace, "one")
        show = f"env | grep ^DRA_GPU_VISIBLE; ls {CONTAINER_DIR} 2>&1; echo {END}; sleep 3600"
        claim_pod(core, namespace, "plain", {"resource_claim_template_name": "one"}, show, busybox_image)
        log = printed(core, namespace, "plain")
        assert "DRA_GPU_VISIBLE_DEVICES=GPU-" in log and "No such file or directory" in log, log
        meta = claim_of(dyn, namespace, "plain")["metadata"]
        assert host_files(namespace, meta["name"], meta["uid"]) == []
        core.delete_namespaced_pod("plain", namespace, grace_period_seconds=0)
    finally:
        restarted(metadata_plugin)
