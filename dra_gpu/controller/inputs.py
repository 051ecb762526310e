"""Where the offline commands and the webhook's static view get their objects: YAML/JSON files
(bounded in size) or a cluster's list calls, sorted into slices, classes, claims and the rest.

Its own module so that the webhook can read files without importing the command line.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from dra_gpu.common.decoding import MAX_FILE_BYTES, DecodeError, load_yaml_all, read_bounded, yaml_problem
from dra_gpu.controller.schemas import decode_object, object_label
from dra_gpu.kube.bounds import Rejected
from dra_gpu.kube.list_decoder import ListDecoder

# A directory given with -f is read recursively: its YAML and JSON files, in sorted order, within
# these bounds (all its files together at most what one file may be), so that `-f /` is refused
# rather than read for an hour.
DIRECTORY_SUFFIXES = (".yaml", ".yml", ".json")
MAX_DIRECTORY_FILES = 1000
MAX_DIRECTORY_BYTES = MAX_FILE_BYTES
MAX_DIRECTORY_ENTRIES = 100_000  # of any kind, looked at while walking


class InputError(Exception):
    """A file that cannot be read (exit 2)."""


@dataclass
class Inputs:
    slices: list[dict[str, Any]] = field(default_factory=list)
    classes: list[dict[str, Any]] = field(default_factory=list)
    claims: list[dict[str, Any]] = field(default_factory=list)  # ResourceClaims (allocated or not)
    others: list[dict[str, Any]] = field(default_factory=list)  # templates and anything else
    problems: list[str] = field(default_factory=list)  # documents that are not objects at all
    # id() of each object read from a file -> that file and the object's place in the input (the
    # objects are held by the lists above)
    files: dict[int, tuple[str, int]] = field(default_factory=dict)
    from_directory: bool = False  # some -f named a directory

    def file_of(self, obj: Any) -> str:
        """The file `obj` was read from; "" for one from the cluster."""
        return self.files.get(id(obj), ("", 0))[0]

    def place_of(self, obj: Any) -> int:
        """Where `obj` came in the input (files in order, documents in order); the cluster's last."""
        return self.files.get(id(obj), ("", len(self.files)))[1]

    def add(self, doc: Any, where: str, file: str = "") -> None:
        if doc is None:
            return
        if not isinstance(doc, dict):
            self.problems.append(f"{where}: not a Kubernetes object (got {type(doc).__name__})")
            return
        kind = doc.get("kind")
        if kind == "List" or (str(kind or "").endswith("List") and "items" in doc):
            items = doc.get("items") or []
            if not isinstance(items, list):
                self.problems.append(f"{where}: items: must be a list")
                return
            for i, item in enumerate(items):
                self.add(item, f"{where}: items[{i}]", file)
            return
        # Decode before anything reads it: a wrong type anywhere is a field error here, not a
        # traceback in the rules, the CEL environment or the allocator.
        problems = decode_object(doc)
        if problems:
            label = object_label(doc)
            self.problems.extend(f"{label}: {path}: {msg}" for path, msg in problems)
            return
        {"ResourceSlice": self.slices, "DeviceClass": self.classes, "ResourceClaim": self.claims}.get(
            str(kind), self.others
        ).append(doc)
        if file:
            self.files[id(doc)] = (file, len(self.files))


def directory_files(directory: str) -> list[str]:
    """The YAML and JSON files under `directory` (recursively, symbolic links to directories not
    followed), sorted; InputError past the bounds above."""
    found: list[str] = []
    seen = total = 0

    def refuse(exc: OSError) -> None:
        raise InputError(f"cannot read {exc.filename or directory}: {exc.strerror or exc}")

    for root, dirs, names in os.walk(directory, onerror=refuse):
        seen += len(dirs) + len(names)
        if seen > MAX_DIRECTORY_ENTRIES:
            raise InputError(
                f"{directory}: more than {MAX_DIRECTORY_ENTRIES} entries under it; give a smaller directory"
            )
        dirs.sort()
        for name in names:
            if not name.endswith(DIRECTORY_SUFFIXES):
                continue
            path = os.path.join(root, name)
            found.append(path)
            if len(found) > MAX_DIRECTORY_FILES:
                raise InputError(
                    f"{directory}: more than {MAX_DIRECTORY_FILES} YAML/JSON files under it; "
                    "give a smaller directory or the files themselves"
                )
            try:
                total += os.stat(path).st_size
            except OSError as exc:
                refuse(exc)
            if total > MAX_DIRECTORY_BYTES:
                raise InputError(
                    f"{directory}: its YAML/JSON files hold more than {MAX_DIRECTORY_BYTES} bytes together; "
                    "give a smaller directory or the files themselves"
                )
    return sorted(found)


def _expand(paths: Sequence[str], inputs: Inputs) -> list[str]:
    """`paths` with each directory replaced by its files."""
    out: list[str] = []
    for path in paths:
        if path != "-" and os.path.isdir(path):
            inputs.from_directory = True
            out += directory_files(path)
        else:
            out.append(path)
    return out


def load_files(paths: Sequence[str], inputs: Inputs | None = None) -> Inputs:
    """The objects of these files (a directory: its YAML and JSON files, recursively)."""
    inputs = inputs or Inputs()
    for path in _expand(paths, inputs):
        try:
            text = sys.stdin.read(MAX_FILE_BYTES + 1) if path == "-" else read_bounded(path, MAX_FILE_BYTES)
        except (OSError, UnicodeDecodeError) as exc:
            raise InputError(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from exc
        except DecodeError as exc:
            raise InputError(str(exc)) from exc
        if len(text) > MAX_FILE_BYTES:
            raise InputError(f"{path}: larger than {MAX_FILE_BYTES} bytes")
        try:
            for i, doc in enumerate(load_yaml_all(text)):
                inputs.add(doc, f"{path}: document {i + 1}", path)
        except (yaml.YAMLError, RecursionError) as exc:
            inputs.problems.append(f"{path}{yaml_problem(exc)}")
    return inputs


def _say_left_out(rejected: Rejected) -> None:
    print(f"warning: {rejected.describe()}; left out", file=sys.stderr)


def load_cluster(
    kubeconfig: str | None, inputs: Inputs, context: str | None = None, templates: bool = False
) -> None:
    """Add the cluster's slices, classes and claims to `inputs` (read-only list calls); its
    ResourceClaimTemplates too (to `others`) with `templates`. `kubeconfig` None: $KUBECONFIG or
    ~/.kube/config; `context` None: the kubeconfig's current context."""
    from kubernetes import client, config

    named = f"{kubeconfig or 'the default kubeconfig'}" + (f", context {context}" if context else "")
    try:
        api_client = config.new_client_from_config(config_file=kubeconfig, context=context)  # type: ignore[no-untyped-call]
        api = client.ResourceV1Api(api_client)
        fns: list[tuple[Any, str, str, list[dict[str, Any]]]]
        fns = [
            (api.list_resource_slice, "ResourceSlice", "resourceslices", inputs.slices),
            (api.list_device_class, "DeviceClass", "deviceclasses", inputs.classes),
            (api.list_resource_claim_for_all_namespaces, "ResourceClaim", "resourceclaims", inputs.claims),
        ]
        if templates:
            fns.append(
                (
                    api.list_resource_claim_template_for_all_namespaces,
                    "ResourceClaimTemplate",
                    "resourceclaimtemplates",
                    inputs.others,
                )
            )
        for fn, kind, plural, dest in fns:
            resp: Any = fn(_preload_content=False)
            # Under the bounds every reader of the apiserver keeps (dra_gpu.kube.bounds): a tenant's
            # claim nested 1,500 levels is left out, said on stderr, and the rest is read.
            page = ListDecoder(resource=plural, on_rejected=_say_left_out)
            page.feed(resp.data)
            page.close()
            for item in page.items:
                # A list's items carry no kind of their own.
                item.setdefault("apiVersion", "resource.k8s.io/v1")
                item.setdefault("kind", kind)
                dest.append(item)
    except Exception as exc:  # config errors, connection errors, API errors: all exit 2
        raise InputError(f"cannot read the cluster with {named}: {str(exc).splitlines()[0]}") from exc
