"""The controller (issue 5) against the real cluster: every claim, template and class the validator
accepts is also accepted by the real kube-apiserver (server-side dry run), and what the validator
does not model is never denied.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from controller_support import HGX, PROFILES, RESOURCE, corpus, k8s_library_claims, status_of

pytestmark = pytest.mark.e2e


def test_validator_accepts_only_what_the_apiserver_accepts(dyn, namespace, published):
    from dra_gpu.controller.rules import Validator

    claims_api = dyn.resources.get(api_version=RESOURCE, kind="ResourceClaim")
    templates_api = dyn.resources.get(api_version=RESOURCE, kind="ResourceClaimTemplate")
    classes_api = dyn.resources.get(api_version=RESOURCE, kind="DeviceClass")
    validators = {d: Validator(d, published["slices"][d], published["classes"]) for d in PROFILES}
    objects: list[tuple[Any, dict[str, Any]]] = []
    for c in corpus():
        claim = {**c, "metadata": {"name": c["metadata"]["name"], "namespace": namespace}}
        tmpl = {
            "apiVersion": RESOURCE,
            "kind": "ResourceClaimTemplate",
            "metadata": {"name": "t-" + c["metadata"]["name"], "namespace": namespace},
            "spec": {"spec": c["spec"]},
        }
        objects += [(claims_api, claim), (templates_api, tmpl)]
    lib_claims = []
    for c in k8s_library_claims():
        claim = {**c, "metadata": {"name": c["metadata"]["name"], "namespace": namespace}}
        objects.append((claims_api, claim))
        lib_claims.append(claim)
    for cls in published["classes"]:
        body = {
            "apiVersion": RESOURCE,
            "kind": "DeviceClass",
            "metadata": {"name": "dry-" + cls["metadata"]["name"]},
            "spec": cls["spec"],
        }
        objects.append((classes_api, body))
    examples = Path(__file__).resolve().parents[2] / "deploy" / "examples"
    for path in sorted(examples.glob("*.yaml")) if examples.is_dir() else []:
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict) and doc.get("kind") in (
                "ResourceClaim",
                "ResourceClaimTemplate",
                "DeviceClass",
            ):
                api = {
                    "ResourceClaim": claims_api,
                    "ResourceClaimTemplate": templates_api,
                    "DeviceClass": classes_api,
                }[doc["kind"]]
                if doc["kind"] != "DeviceClass":
                    doc.setdefault("metadata", {})["namespace"] = namespace
                objects.append((api, doc))
    accepted_by_validator = refused_by_apiserver = 0
    problems = []
    for api, obj in objects:
        verdicts = [v.validate(obj) for v in validators.values()]
        if not any(v.concerned and v.allowed for v in verdicts):
            continue
        accepted_by_validator += 1
        try:
            api.create(body=obj, namespace=obj["metadata"].get("namespace"), dry_run="All")
        except Exception as exc:
            if status_of(exc) is None:
                raise
            refused_by_apiserver += 1
            problems.append(f"{obj['kind']} {obj['metadata']['name']}: {getattr(exc, 'body', exc)}")
    # The other way round for what the validator cannot model: valid in Kubernetes, never denied.
    for claim in lib_claims:
        api_ok = claims_api.create(body=claim, namespace=namespace, dry_run="All")
        assert api_ok.metadata.name == claim["metadata"]["name"]
        verdict = validators[HGX].validate(claim)
        assert verdict.allowed, (claim["spec"], verdict.errors)
        assert any("does not model" in w.message for w in verdict.warnings), verdict.warnings
    print(
        f"\n[validator] {len(lib_claims)} claims with Kubernetes CEL library functions not modelled: "
        "accepted by the apiserver, allowed with a warning by the validator",
        file=sys.stderr,
    )
    print(
        f"\n[validator] {len(objects)} objects, {accepted_by_validator} accepted by the validator, "
        f"{accepted_by_validator - refused_by_apiserver} of them accepted by the apiserver "
        f"(server-side dry run)",
        file=sys.stderr,
    )
    assert accepted_by_validator >= 80
    assert not problems, "\n".join(problems)
