"""Where the offline commands and the webhook's static view get their objects: YAML/JSON files
(bounded in size) or a cluster's list calls, sorted into slices, classes, claims and the rest.

Its own module so that the webhook can read files without importing the command line.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from dra_gpu.common.decoding import MAX_FILE_BYTES, DecodeError, load_yaml_all, read_bounded, yaml_problem
from dra_gpu.controller.schemas import decode_object, object_label
from dra_gpu.kube.bounds import Rejected
from dra_gpu.kube.list_decoder import ListDecoder


class InputError(Exception):
    """A file that cannot be read (exit 2)."""


@dataclass
class Inputs:
    slices: list[dict[str, Any]] = field(default_factory=list)
    classes: list[dict[str, Any]] = field(default_factory=list)
    claims: list[dict[str, Any]] = field(default_factory=list)  # ResourceClaims (allocated or not)
    others: list[dict[str, Any]] = field(default_factory=list)  # templates and anything else
    problems: list[str] = field(default_factory=list)  # documents that are not objects at all

    def add(self, doc: Any, where: str) -> None:
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
                self.add(item, f"{where}: items[{i}]")
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


def load_files(paths: Sequence[str], inputs: Inputs | None = None) -> Inputs:
    inputs = inputs or Inputs()
    for path in paths:
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
                inputs.add(doc, f"{path}: document {i + 1}")
        except (yaml.YAMLError, RecursionError) as exc:
            inputs.problems.append(f"{path}{yaml_problem(exc)}")
    return inputs


def _say_left_out(rejected: Rejected) -> None:
    print(f"warning: {rejected.describe()}; left out", file=sys.stderr)


def load_cluster(kubeconfig: str, inputs: Inputs) -> None:
    """Add the cluster's slices, classes and claims to `inputs` (read-only list calls)."""
    from kubernetes import client, config

    try:
        api_client = config.new_client_from_config(config_file=kubeconfig)  # type: ignore[no-untyped-call]
        api = client.ResourceV1Api(api_client)
        fns: tuple[tuple[Any, str, str, list[dict[str, Any]]], ...]
        fns = (
            (api.list_resource_slice, "ResourceSlice", "resourceslices", inputs.slices),
            (api.list_device_class, "DeviceClass", "deviceclasses", inputs.classes),
            (api.list_resource_claim_for_all_namespaces, "ResourceClaim", "resourceclaims", inputs.claims),
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
        raise InputError(f"cannot read the cluster with {kubeconfig}: {str(exc).splitlines()[0]}") from exc
