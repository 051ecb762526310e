"""Fuzzed objects against the real apiserver: every object `validate` accepts, the apiserver
accepts too (server-side dry run), for the valid-then-mutated claims, templates and DeviceClasses
of the unit fuzz tests' generators (tests/controller/generators.py). The fixed corpus of
test_controller_validator.py covers the hand-written cases; this one covers what the generators
reach. A valid object that validate denies only because the published devices can never satisfy
it is still schema-valid, so it goes to the apiserver too, which must accept it. Fixed seed and
bounded examples, so that CI runs the same inputs each time."""

from __future__ import annotations

import sys
from collections import Counter
from typing import Any

import pytest
from controller_support import RESOURCE, status_of
from hypothesis import HealthCheck, given, settings

pytestmark = pytest.mark.e2e

EXAMPLES = 60
REACHED_APISERVER = ("valid, accepted by both", "valid, unsatisfiable here, accepted by both")


def test_what_validate_accepts_the_apiserver_accepts(dyn, namespace):
    from dra_gpu.controller.rules import ProblemKind, Validator
    from tests.controller.generators import CLASSES, SLICES, mutated, validated_objects
    from tests.controller.objects import DRIVER
    from tests.mutation import check_reach

    validator = Validator(DRIVER, SLICES, CLASSES)
    apis = {
        kind: dyn.resources.get(api_version=RESOURCE, kind=kind)
        for kind in ("ResourceClaim", "ResourceClaimTemplate", "DeviceClass")
    }
    seen: Counter[str] = Counter()
    problems: list[str] = []

    # One namespace for every example (the creates are dry runs: nothing is stored).
    @settings(
        max_examples=EXAMPLES,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(validated_objects().flatmap(mutated))
    def check(obj_n: tuple[Any, int]) -> None:
        obj, mutations = obj_n
        verdict = validator.validate(obj)
        label = "mutated" if mutations else "valid"
        unsatisfiable = bool(verdict.errors) and all(
            p.kind is ProblemKind.UNSATISFIABLE for p in verdict.errors
        )
        if not mutations and verdict.errors and not unsatisfiable:
            problems.append(f"validate denied a generated valid object: {verdict.errors} {obj}")
            return
        if not verdict.concerned or (verdict.errors and not (unsatisfiable and not mutations)):
            seen[f"{label}, denied by validate"] += 1
            return
        if unsatisfiable:
            label = "valid, unsatisfiable here"
        kind = obj.get("kind")
        api = apis.get(kind) if isinstance(kind, str) else None
        if api is None:
            problems.append(f"validate accepted an object of kind {kind!r}: {obj}")
            return
        scoped = kind != "DeviceClass"
        body = obj
        if isinstance(obj.get("metadata"), dict):  # a fresh name, in the test's namespace
            meta = {k: v for k, v in obj["metadata"].items() if k != "namespace"}
            meta["name"] = f"fuzz-{seen.total()}"
            body = {**obj, "metadata": {**meta, **({"namespace": namespace} if scoped else {})}}
        try:
            api.create(body=body, namespace=namespace if scoped else None, dry_run="All")
            seen[f"{label}, accepted by both"] += 1
        except Exception as exc:
            if status_of(exc) is None:
                raise
            seen[f"{label}, accepted by validate, refused by the apiserver"] += 1
            problems.append(f"{kind} {obj}: {getattr(exc, 'body', exc)}")

    check()
    print(f"\n[validator fuzz] {EXAMPLES} examples: {dict(sorted(seen.items()))}", file=sys.stderr)
    # A quarter of the examples reached the apiserver as valid objects.
    check_reach(seen, 0.25, REACHED_APISERVER, "validator fuzz against the apiserver")
    assert not problems, "\n".join(problems[:5])
