"""Device metadata (KEP-5304, the DRA Device Attributes Downward API): a pod learns which devices it
got (UUIDs, MIG profile and parent, NVLink domain, ...) from a file, without NVML.

The driver writes it; the kubelet has no part in it beyond passing CDI IDs on. For each prepared
claim and each of its base requests (`req/sub` -> `req`) with at least one device:

- a file `<plugin dir>/dra-device-metadata/<namespace>_<claim>/<request>/metadata.json`: a JSON
  stream of one `DeviceMetadata` object a version (metadata.resource.k8s.io/v1beta1, then
  v1alpha1, which 1.36's readers know), each pretty-printed and followed by a newline: the claim
  (name, namespace, uid, generation: 1, one more each time the start-up reconcile writes a
  changed file), `podClaimName` for a claim made from a template, and the
  request (its name as allocated) with its devices: driver, pool, name and the attributes the
  device has in this node's ResourceSlice, sorted, at most 32 (a dynamic MIG device also gets the
  `uuid` of the instance made for it, which its slice cannot publish before it exists);
- a CDI spec `<cdi dir>/<driver>_metadata_<claimUID>_<request>.json`, kind `<driver>/metadata`, one
  device `<claimUID>_<request>` that bind-mounts the file read-only at
  `/var/run/kubernetes.io/dra-device-attributes/resourceclaimtemplates/<podClaimName>/<request>/<driver>-metadata.json`
  (a claim made from a template) or `.../resourceclaims/<claimName>/<request>/<driver>-metadata.json`;
- its CDI ID `<driver>/metadata=<claimUID>_<request>` on the first device of that request in the
  answer to the kubelet (which gives a container the CDI IDs of the devices of its requests).

The plan adds the CDI IDs to the claim's devices and records what the files are made from
(`record.MetadataInputs`), so the files of a prepared claim can be made again from its record (the
start-up reconcile restores a missing or stale one) and a re-prepare answers the same IDs; a record
of an earlier version, without metadata, is answered as it was. The journal writes the files
beside the claim's CDI spec, before its record is `completed`, and removes them with it.

Not fsynced, like the claim CDI specs (dra_gpu.common.durable): the files are scoped to the boot
as the checkpoint's records are; after a power loss the start-up reconcile removes what no record of
this boot owns, and the kubelet prepares its claims again.

A file that cannot be written fails the prepare, naming the claim and the file, and nothing of the
claim is left (upstream's helper logs such an error and goes on; the KEP says a driver should fail):
a pod that reads its devices from the file would otherwise start without it, and a kubelet retry of
a failed prepare costs seconds.

Whether it is written (`--device-metadata=auto|on|off`, see `decide`): by default where the node's
kubelet is 1.37 or newer (beta there; alpha in 1.36, nothing before).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from dra_gpu.common.durable import remove_file, remove_stale_temps, replace_atomically
from dra_gpu.kube.values import DNS_LABEL, DNS_SUBDOMAIN
from dra_gpu.node.catalog import DeviceCatalog
from dra_gpu.node.slices import SliceBuilder
from dra_gpu.plugin.cdi import minimum_version
from dra_gpu.plugin.record import ClaimRecord, ClaimState, MetadataInputs, PreparedDevice
from dra_gpu.plugin.write_rounds import make_directories

log = logging.getLogger(__name__)

METADATA_DIR = "dra-device-metadata"  # under the plugin's directory
FILE_NAME = "metadata.json"
CONTAINER_DIR = "/var/run/kubernetes.io/dra-device-attributes"
CLAIMS_SUBDIR = "resourceclaims"
TEMPLATES_SUBDIR = "resourceclaimtemplates"
POD_CLAIM_NAME_ANNOTATION = "resource.kubernetes.io/pod-claim-name"
API_GROUP = "metadata.resource.k8s.io"
API_VERSIONS = (
    f"{API_GROUP}/v1beta1",
    f"{API_GROUP}/v1alpha1",
)  # the newest first: readers take the first they know
KIND = "DeviceMetadata"
MAX_ATTRIBUTES = 32  # a device's, as the API's validation allows
FILE_MODE = 0o644  # read by the container's user, whoever it is
DIR_MODE = 0o755
MODES = ("auto", "on", "off")
BETA_SINCE = (1, 37)
_VERSION = re.compile(r"^v?(\d+)\.(\d+)")
MAX_KEPT_TEXTS = 4096


class MetadataWriteError(OSError):
    """A device metadata file or its CDI spec that could not be written; says which file."""

    def __init__(self, errno_: int | None, strerror: str | None, path: Path) -> None:
        super().__init__(errno_, strerror)
        self.path = path

    def __str__(self) -> str:
        return f"device metadata {self.path}: {self.strerror}"


@dataclass(frozen=True)
class Decision:
    """Whether this plugin writes device metadata, and why (said once, at start)."""

    enabled: bool
    reason: str

    def line(self) -> str:
        return f"device metadata (KEP-5304) {'on' if self.enabled else 'off'}: {self.reason}"


def kubelet_version(node: Mapping[str, Any] | None) -> str | None:
    """The kubelet's version a Node object reports (status.nodeInfo.kubeletVersion)."""
    info = ((node or {}).get("status") or {}).get("nodeInfo") or {}
    version = info.get("kubeletVersion")
    return str(version) if version else None


def decide(mode: str, kubelet: str | None, problem: str = "") -> Decision:
    """`--device-metadata`: on and off as said; auto, on where the node's kubelet (`kubelet`, its
    version; None: not known, `problem` says why) is BETA_SINCE or newer."""
    if mode == "off":
        return Decision(False, "--device-metadata=off")
    if mode == "on":
        seen = f"the kubelet is {kubelet}" if kubelet else "the kubelet's version was not read"
        return Decision(
            True, f"--device-metadata=on ({seen}); a container finds its claims' under {CONTAINER_DIR}"
        )
    if mode != "auto":
        raise ValueError(f"--device-metadata: {mode!r} is not one of {', '.join(MODES)}")
    beta = "beta from {}.{}".format(*BETA_SINCE)
    anyway = "--device-metadata=on writes it anyway"
    if kubelet is None:
        return Decision(False, f"the kubelet's version is not known ({problem or 'not reported'}); {anyway}")
    m = _VERSION.match(kubelet)
    if m is None:
        return Decision(False, f"the kubelet's version {kubelet!r} has no major.minor; {anyway}")
    if (int(m[1]), int(m[2])) < BETA_SINCE:
        return Decision(False, f"the kubelet is {kubelet}; {beta}; {anyway}")
    return Decision(
        True, f"the kubelet is {kubelet}, {beta}; a container finds its claims' under {CONTAINER_DIR}"
    )


def pod_claim_name(claim: Mapping[str, Any]) -> str | None:
    """The name under which the pod names a claim made from its template (the claim's annotation
    resource.kubernetes.io/pod-claim-name); None for a claim made by hand."""
    annotations = (claim.get("metadata") or {}).get("annotations") or {}
    value = annotations.get(POD_CLAIM_NAME_ANNOTATION) if isinstance(annotations, Mapping) else None
    return str(value) if value else None


def _checked(what: str, value: str, pattern: re.Pattern[str], limit: int) -> str:
    """A name that becomes a path component: as the apiserver allows it (never "/", "." or "..")."""
    if len(value) > limit or not pattern.match(value):
        raise ValueError(
            f"{what} {value!r} is not a valid name (a path of the device metadata is made of it)"
        )
    return value


class DeviceMetadata:
    """The driver's device metadata files and their CDI specs: their names, their content (made
    from a claim's record) and, at start, their reconcile. The journal writes and removes them."""

    def __init__(
        self, driver: str, plugin_dir: Path, cdi_dir: Path, catalog: DeviceCatalog, enabled: bool = False
    ) -> None:
        self.driver = driver
        self.root = plugin_dir / METADATA_DIR
        self.cdi_dir = cdi_dir
        self.catalog = catalog
        self.enabled = enabled  # written for new claims; records that have them keep them either way
        self.kind = f"{driver}/metadata"
        self.spec_prefix = f"{driver}_metadata_"
        self._slices: SliceBuilder | None = None  # made on first use
        self._attributes: dict[str, dict[str, dict[str, Any]]] = {}
        self._texts: dict[tuple[str, str, str | None], str] = {}  # a device's part of the file

    # -- names ---------------------------------------------------------------------------------

    def claim_dir(self, namespace: str, name: str) -> Path:
        namespace = _checked("namespace", namespace, DNS_LABEL, 63)
        return self.root / f"{namespace}_{_checked('claim name', name, DNS_SUBDOMAIN, 253)}"

    def file_path(self, namespace: str, name: str, request: str) -> Path:
        return self.claim_dir(namespace, name) / _checked("request", request, DNS_LABEL, 63) / FILE_NAME

    def spec_path(self, uid: str, request: str) -> Path:
        return self.cdi_dir / f"{self.spec_prefix}{self.device_name(uid, request)}.json"

    def is_spec_name(self, name: str) -> bool:
        return name.startswith(self.spec_prefix) and name.endswith(".json")

    def claims_with_specs(self) -> set[str]:
        """The UIDs of the claims that have a metadata CDI spec in the CDI directory."""
        return {
            e.name[len(self.spec_prefix) :].split("_", 1)[0]
            for e in _entries(self.cdi_dir)
            if self.is_spec_name(e.name)
        }

    @staticmethod
    def device_name(uid: str, request: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9-]*", uid):
            raise ValueError(f"claim uid {uid!r} cannot name a CDI device")
        return f"{uid}_{request}"

    def cdi_id(self, uid: str, request: str) -> str:
        return f"{self.kind}={self.device_name(uid, request)}"

    def container_path(self, name: str, inputs: MetadataInputs, request: str) -> str:
        if inputs.pod_claim_name:
            where = f"{TEMPLATES_SUBDIR}/{inputs.pod_claim_name}"
        else:
            where = f"{CLAIMS_SUBDIR}/{name}"
        return f"{CONTAINER_DIR}/{where}/{request}/{self.driver}-metadata.json"

    # -- the plan: inputs and CDI IDs ------------------------------------------------------------

    def inputs(self, requests: Iterable[str], pod_claim: str | None) -> MetadataInputs:
        """What the claim's files are made from: its requests as allocated (one a base request,
        the first seen), checked to make paths (ValueError)."""
        names: dict[str, str] = {}
        for request in requests:
            base = request.split("/", 1)[0]
            _checked("request", base, DNS_LABEL, 63)
            names.setdefault(base, request)
        if pod_claim is not None:
            _checked(f"annotation {POD_CLAIM_NAME_ANNOTATION}", pod_claim, DNS_LABEL, 63)
        return MetadataInputs(tuple(names.values()), pod_claim)

    def with_cdi_ids(
        self, uid: str, inputs: MetadataInputs, devices: Sequence[PreparedDevice]
    ) -> list[PreparedDevice]:
        """`devices` with the metadata's CDI ID of each request added to its first device."""
        ids = {base: self.cdi_id(uid, base) for base in inputs.base_requests}
        out = []
        for device in devices:
            added = [ids.pop(r) for r in device.request_names if r in ids]
            if added:
                device = replace(device, cdi_device_ids=[*device.cdi_device_ids, *added])
            out.append(device)
        return out

    # -- content -------------------------------------------------------------------------------

    def attributes(self, device: str, instance_uuid: str | None = None) -> dict[str, dict[str, Any]]:
        """The device's attributes as this node's ResourceSlice publishes them, sorted, at most
        MAX_ATTRIBUTES; `instance_uuid`: a dynamic MIG device's, once made. Empty for a device the
        node no longer has."""
        cached = self._attributes.get(device)
        if cached is None:
            found = self.catalog.get(device)
            if found is None:
                return {}
            if self._slices is None:
                self._slices = SliceBuilder(self.catalog, self.driver)
            cached = dict(self._slices.device(found).get("attributes") or {})
            self._attributes[device] = cached
        attrs = dict(cached)
        if instance_uuid is not None and "uuid" not in attrs:
            attrs["uuid"] = {"string": instance_uuid}
        keys = sorted(attrs)
        if len(keys) > MAX_ATTRIBUTES:
            log.warning(
                "device metadata of a device keeps %d of its %d attributes device=%s left_out=%s",
                MAX_ATTRIBUTES,
                len(keys),
                device,
                ",".join(keys[MAX_ATTRIBUTES:]),
            )
            keys = keys[:MAX_ATTRIBUTES]
        return {k: dict(attrs[k]) for k in keys}

    def _entry(self, pool: str, device: str, instance_uuid: str | None) -> dict[str, Any]:
        entry: dict[str, Any] = {"driver": self.driver, "pool": pool, "name": device}
        attrs = self.attributes(device, instance_uuid)
        if attrs:
            entry["attributes"] = attrs
        return entry

    def _devices(self, record: ClaimRecord, request: str) -> list[tuple[str, str, str | None]]:
        """(pool, device, made instance's UUID) of each device of a request, in allocation order."""
        base = request.split("/", 1)[0]
        made = {m.device: m.uuid for m in record.mig_steps if m.uuid is not None}
        return [
            (d.pool_name, d.device_name, made.get(d.device_name))
            for d in record.devices
            if base in d.request_names
        ]

    @staticmethod
    def _head(record: ClaimRecord, request: str, devices: list[Any]) -> dict[str, Any]:
        assert record.metadata is not None
        doc: dict[str, Any] = {
            "kind": KIND,
            "apiVersion": API_VERSIONS[0],
            "metadata": {
                "name": record.name,
                "namespace": record.namespace,
                "uid": record.uid,
                "generation": 1,
            },
        }
        if record.metadata.pod_claim_name:
            doc["podClaimName"] = record.metadata.pod_claim_name
        doc["requests"] = [{"name": request, "devices": devices}]
        return doc

    def document(self, record: ClaimRecord, request: str) -> dict[str, Any]:
        """The DeviceMetadata object of one request (`request` as allocated) of a claim's record,
        in the upstream type's field order (apiVersion: the newest)."""
        return self._head(record, request, [self._entry(*d) for d in self._devices(record, request)])

    @staticmethod
    def stream(doc: dict[str, Any]) -> bytes:
        """The file of a document: the object once a version, newest first, each indented and
        ended by a newline. The versions differ only in the apiVersion line, the object's second,
        which no string inside it can mimic (their quotes are escaped)."""
        doc = {**doc, "apiVersion": API_VERSIONS[0]}
        return _versions(json.dumps(doc, indent=2, ensure_ascii=False) + "\n")

    def encode(self, record: ClaimRecord, request: str) -> bytes:
        """`stream(document(record, request))`, byte for byte, with each device's part (most of the
        file, the same in every claim of the device) indented once and kept: indented JSON is
        the pure-Python encoder's, which was most of what the metadata added to a prepare."""
        devices = self._devices(record, request)
        texts = []
        for key in devices:
            text = self._texts.get(key)
            if text is None:
                text = json.dumps(self._entry(*key), indent=2, ensure_ascii=False).replace(
                    "\n", "\n" + " " * 8
                )
                if len(self._texts) >= MAX_KEPT_TEXTS:
                    self._texts.clear()  # dynamic MIG instances come and go; the catalog's devices stay
                self._texts[key] = text
            texts.append(text)
        # Markers in place of the devices: the head's strings (names, UIDs) hold no "@".
        head = json.dumps(self._head(record, request, [f"@{i}@" for i in range(len(texts))]), indent=2)
        for i, text in enumerate(texts):
            head = head.replace(f'"@{i}@"', text, 1)
        return _versions(head + "\n")

    def spec(self, record: ClaimRecord, request: str) -> dict[str, Any]:
        """The CDI spec that mounts one request's file into the claim's containers."""
        assert record.metadata is not None
        mount = {
            "hostPath": str(self.file_path(record.namespace, record.name, request)),
            "containerPath": self.container_path(record.name, record.metadata, request),
            "options": ["ro", "bind"],
        }
        spec: dict[str, Any] = {
            "cdiVersion": "",
            "kind": self.kind,
            "devices": [
                {"name": self.device_name(record.uid, request), "containerEdits": {"mounts": [mount]}}
            ],
        }
        spec["cdiVersion"] = minimum_version(spec)
        return spec

    def files(self, record: ClaimRecord) -> list[tuple[Path, bytes]]:
        """Every file of a claim's record that has metadata: each request's metadata file, then
        its CDI spec (ValueError: a name that cannot make a path)."""
        if record.metadata is None:
            return []
        out = []
        for request in record.metadata.requests:
            base = request.split("/", 1)[0]
            if not any(base in d.request_names for d in record.devices):
                continue  # no device: no file (as upstream)
            out.append(
                (
                    self.file_path(record.namespace, record.name, base),
                    self.stream(self.document(record, request)),
                )
            )
            spec = json.dumps(self.spec(record, base), separators=(",", ":")) + "\n"
            out.append((self.spec_path(record.uid, base), spec.encode()))
        return out

    # -- removal -------------------------------------------------------------------------------

    def removals(
        self, record: ClaimRecord, others: Sequence[ClaimRecord] = ()
    ) -> tuple[list[Path], list[Path]]:
        """What unprepare removes of a claim: its CDI specs (files) and its metadata directory
        (a tree). `others`: other records of a claim of the same namespace and name (deleted and
        made again): their requests' directories stay."""
        if record.metadata is None:
            return [], []
        bases = record.metadata.base_requests
        files = [self.spec_path(record.uid, base) for base in bases]
        claim_dir = self.claim_dir(record.namespace, record.name)
        if not others:
            return files, [claim_dir]
        kept = {b for o in others if o.metadata is not None for b in o.metadata.base_requests}
        return files, [claim_dir / base for base in bases if base not in kept]

    # -- at start ------------------------------------------------------------------------------

    def reconcile_now(self, records: Iterable[ClaimRecord]) -> dict[str, int]:
        """Before serving: each completed claim's files as its record makes them (written again
        where missing or different), and every other file of this driver's metadata removed (a
        claim unprepared while the plugin was down, a prepare a crash interrupted, another boot's)."""
        counts = {"metadataRestored": 0, "metadataRemoved": 0}
        specs: set[str] = set()
        requests: dict[str, set[str]] = {}  # claim directory -> its requests' directories
        for rec in records:
            if rec.state != ClaimState.COMPLETED or rec.metadata is None:
                continue
            try:
                files = self.files(rec)
            except ValueError as exc:
                log.error(
                    "device metadata of a prepared claim cannot be made claim=%s error=%s", rec.ref(), exc
                )
                continue
            for path, data in files:
                if path.parent == self.cdi_dir:
                    specs.add(path.name)
                else:
                    requests.setdefault(path.parent.parent.name, set()).add(path.parent.name)
                old = _read(path)
                if path.parent != self.cdi_dir and old is not None:
                    data = _next_generation(old, data)
                if old != data:
                    make_directories(path.parent, DIR_MODE)
                    replace_atomically(path, data, FILE_MODE)
                    counts["metadataRestored"] += 1
                    log.warning(
                        "device metadata of a prepared claim written again claim=%s file=%s", rec.ref(), path
                    )
        for entry in _entries(self.cdi_dir):
            if self.is_spec_name(entry.name) and entry.name not in specs and remove_file(Path(entry.path)):
                counts["metadataRemoved"] += 1
                log.warning("device metadata CDI spec owned by no claim removed file=%s", entry.path)
        for claim in _entries(self.root):
            if claim.name not in requests:
                _remove_tree(Path(claim.path))
                counts["metadataRemoved"] += 1
                log.warning("device metadata owned by no claim removed dir=%s", claim.path)
                continue
            for request in _entries(Path(claim.path)):
                if request.name not in requests[claim.name]:
                    _remove_tree(Path(request.path))
                else:
                    remove_stale_temps(Path(request.path), FILE_NAME.__eq__)
        return {k: v for k, v in counts.items() if v}


def _versions(first: str) -> bytes:
    """The stream of an object encoded as the newest version: once a version."""
    line = f'"apiVersion": "{API_VERSIONS[0]}"'
    assert first.split("\n", 3)[2].strip().rstrip(",") == line
    return "".join(
        [first, *(first.replace(line, f'"apiVersion": "{v}"', 1) for v in API_VERSIONS[1:])]
    ).encode()


# The head's generation line: the metadata object's last field, at its depth (a device's fields
# are deeper), once in each version's object.
GENERATION = re.compile(rb'^    "generation": (\d+)$', re.M)


def _next_generation(old: bytes, new: bytes) -> bytes:
    """`new` (generation 1) as the update of the file `old`: `old` itself where only its
    generation differs, else `new` with the generation after `old`'s, as the protocol asks of a
    file that changes (a reader may watch the generation). A file that names none: `new`."""
    found = GENERATION.search(old)
    if found is None:
        return new
    generation = int(found.group(1))
    if GENERATION.sub(rb'    "generation": 1', old) == new:
        return old
    return GENERATION.sub(b'    "generation": %d' % (generation + 1), new)


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None


def _entries(directory: Path) -> list[os.DirEntry[str]]:
    try:
        return list(os.scandir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return []


def _remove_tree(path: Path) -> None:
    """Remove a directory of the plugin's own making (a file or link in its place: unlinked; links
    in it are removed, never followed)."""
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        remove_file(path)
        return
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(path)
