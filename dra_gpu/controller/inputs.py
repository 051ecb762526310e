"""Where the offline commands and the webhook's static view get their objects: YAML/JSON files
(bounded in size) or a cluster's list calls, sorted into slices, classes, claims and the rest.

Its own module so that the webhook can read files without importing the command line.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

MAX_FILE_BYTES = 64 * 1024 * 1024


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
        if doc.get("kind") == "List" or (str(doc.get("kind", "")).endswith("List") and "items" in doc):
            for i, item in enumerate(doc.get("items") or []):
                self.add(item, f"{where}: items[{i}]")
            return
        kind = doc.get("kind")
        {"ResourceSlice": self.slices, "DeviceClass": self.classes, "ResourceClaim": self.claims}.get(
            str(kind), self.others
        ).append(doc)


def load_files(paths: Sequence[str], inputs: Inputs | None = None) -> Inputs:
    inputs = inputs or Inputs()
    for path in paths:
        try:
            if path == "-":
                text = sys.stdin.read(MAX_FILE_BYTES + 1)
            else:
                p = Path(path)
                if p.stat().st_size > MAX_FILE_BYTES:
                    raise InputError(f"{path}: larger than {MAX_FILE_BYTES} bytes")
                text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise InputError(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from exc
        if len(text) > MAX_FILE_BYTES:
            raise InputError(f"{path}: larger than {MAX_FILE_BYTES} bytes")
        try:
            for i, doc in enumerate(yaml.safe_load_all(text)):
                inputs.add(doc, f"{path}: document {i + 1}")
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            line = f":{mark.line + 1}" if mark is not None else ""
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            inputs.problems.append(f"{path}{line}: not valid YAML: {problem}")
        except RecursionError:
            inputs.problems.append(f"{path}: not valid YAML: nested too deeply")
    return inputs


def load_cluster(kubeconfig: str, inputs: Inputs) -> None:
    """Add the cluster's slices, classes and claims to `inputs` (read-only list calls)."""
    from kubernetes import client, config

    try:
        api_client = config.new_client_from_config(config_file=kubeconfig)  # type: ignore[no-untyped-call]
        api = client.ResourceV1Api(api_client)
        fns: tuple[tuple[Any, str, list[dict[str, Any]]], ...]
        fns = (
            (api.list_resource_slice, "ResourceSlice", inputs.slices),
            (api.list_device_class, "DeviceClass", inputs.classes),
            (api.list_resource_claim_for_all_namespaces, "ResourceClaim", inputs.claims),
        )
        for fn, kind, dest in fns:
            resp: Any = fn(_preload_content=False)
            for item in json.loads(resp.data).get("items") or []:
                # A list's items carry no kind of their own.
                item.setdefault("apiVersion", "resource.k8s.io/v1")
                item.setdefault("kind", kind)
                dest.append(item)
    except Exception as exc:  # config errors, connection errors, API errors: all exit 2
        raise InputError(f"cannot read the cluster with {kubeconfig}: {str(exc).splitlines()[0]}") from exc
