"""Property-based fuzzing (Hypothesis) of everything the controller decodes: Kubernetes objects of
every kind it reads, AdmissionReviews, opaque configs, quantities, YAML and node profiles.

The inputs are built valid (tests/controller/generators.py: claims over the published devices of
two simulated nodes, classes, slices, templates, configs, profiles) and a third of them mutated
(one to three values replaced, mostly by a value of the same type), so most examples get past
decoding into the rules, the allocator and the profile checks. Checked beyond "no exception":
explain's placement satisfies every request, selector and constraint of the claim (an oracle
written from the slices' JSON); a valid claim is never rejected as invalid; an opaque config is
accepted exactly when the API's rules say so, and a rejected one is denied with its field path;
quantities parse to the value of their parts; a valid profile is served with its GPUs; the webhook
over HTTPS answers as `dra-gpu validate` does. Each input is answered in bounded time.

What the examples reached is counted (tests/mutation.py) and printed at the end of the run; each
test fails when too few reach the logic it is about (`reaches`: about half the lowest share seen
over several random seeds; quantity_text_is_bounded has none, its free text rarely forms a
quantity and every answer, parsed or refused, is its logic). CI: the
"ci" Hypothesis profile (fixed seed); the longer run: HYPOTHESIS_PROFILE=nightly.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st
from simnode.profiles import ProfileError, parse_profile

from dra_gpu.common.decoding import decode as decode_shape
from dra_gpu.common.decoding import load_yaml_all
from dra_gpu.controller.allocator_view import Cluster
from dra_gpu.controller.explain import explain
from dra_gpu.controller.inputs import Inputs
from dra_gpu.controller.rules import ProblemKind, Validator
from dra_gpu.controller.schemas import ADMISSION_REVIEW, decode_object
from dra_gpu.kube.values import parse_quantity
from dra_gpu.model.config import ConfigError, decode
from tests.conftest import discover_doc
from tests.mutation import fuzz_settings, reach, reaches

from .generators import (
    CLASSES,
    SLICES,
    claim_models,
    json_values,
    mutated,
    objects,
    profiles,
    quantity_texts,
    validated_objects,
)
from .objects import DRIVER, GPU_CLASS, allocated, device_names, node_slices

BOUND_S = 5.0  # per input
RESOURCE = "resource.k8s.io/v1"
FUZZ = fuzz_settings(60)
VALIDATOR = Validator(DRIVER, SLICES, CLASSES)
CLUSTER = Cluster(VALIDATOR.env, SLICES, {c["metadata"]["name"]: c for c in CLASSES})


def timed(fn: Any, *args: Any) -> Any:
    """fn(*args), which must take less than BOUND_S of this process's CPU (not wall-clock time:
    a busy machine slows the run, not the work)."""
    start = time.process_time()
    out = fn(*args)
    assert time.process_time() - start < BOUND_S, f"{fn.__name__} took {time.process_time() - start:.1f} s"
    return out


def outcome(verdict: Any) -> str:
    if verdict.allowed:
        return "allowed"
    kinds = sorted({p.kind.value for p in verdict.errors})
    return "denied " + "+".join(kinds)


@reaches(
    0.25, "valid allowed", "mutated allowed", "valid denied unsatisfiable", "mutated denied unsatisfiable"
)
@FUZZ
@given(validated_objects().flatmap(mutated))
def test_validator_answers_every_object(obj_n: tuple[Any, int]) -> None:
    obj, mutations = obj_n
    v = timed(VALIDATOR.validate, obj)
    for line in v.lines() + v.warning_lines():
        assert isinstance(line, str)
    if not mutations:
        # Built valid: never rejected as wrongly written (it may not fit the devices).
        invalid = [p for p in v.errors if p.kind is ProblemKind.INVALID]
        assert not invalid, (obj, v.lines())
    reach(("valid " if not mutations else "mutated ") + outcome(v))


@reaches(0.15, "allocatable, placement checked")
@FUZZ
@given(claim_models())
def test_explain_placement_satisfies_the_claim(model: Any) -> None:
    """explain's placement gives each request its count of devices matching its class and
    selectors, no device twice, and every constraint holds (checked by the generator's oracle)."""
    from .generators import placement_problems

    spec = model.json()["spec"]
    e = timed(explain, CLUSTER, spec)
    if not e.allocatable:
        assert e.reason, "a claim that is not allocatable without a reason"
        reach(f"not allocatable ({e.failure.value})")
        return
    for p in (e.placement, e.best):
        assert p is not None
        problems = placement_problems(model, p.node, [(r, d.name) for r, d in p.results])
        assert not problems, (spec, p.node, p.devices, problems)
    # and the admission rules agree that it fits
    assert VALIDATOR.validate(model.json()).allowed
    reach("allocatable, placement checked")


@reaches(0.4, "accepted")
@FUZZ
@given(objects().flatmap(mutated))
def test_inputs_sort_every_document(obj_n: tuple[Any, int]) -> None:
    obj, mutations = obj_n
    inputs = Inputs()
    timed(inputs.add, obj, "doc")
    sorted_in = len(inputs.slices) + len(inputs.classes) + len(inputs.claims) + len(inputs.others)
    assert sorted_in + (1 if inputs.problems else 0) == (obj is not None), inputs  # null: an empty document
    if not mutations:
        assert not inputs.problems, inputs.problems
    reach("accepted" if not inputs.problems else "refused with a field error")


@st.composite
def reviews(draw: st.DrawFn) -> tuple[dict[str, Any], int]:
    obj = draw(validated_objects())
    request = {
        "uid": draw(st.uuids()).hex,
        "kind": {"group": "resource.k8s.io", "version": "v1", "kind": obj["kind"]},
        "operation": draw(st.sampled_from(["CREATE", "UPDATE"])),
        "object": obj,
    }
    review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}
    return draw(mutated(review))


@reaches(0.3, "decoded")
@FUZZ
@given(reviews())
def test_admission_review_shape(review_n: tuple[dict[str, Any], int]) -> None:
    review, mutations = review_n
    problems = timed(decode_shape, review, ADMISSION_REVIEW)
    for path, message in problems:
        assert isinstance(path, str) and message
    if not mutations:
        assert not problems, problems
    reach("decoded" if not problems else "refused with a field error")


@st.composite
def opaque_configs(draw: st.DrawFn) -> tuple[Any, bool]:
    """(parameters, whether the API accepts them): each field drawn valid or not, the verdict
    stated here from the API's rules (api/README.md), not from the decoder."""
    kind = draw(st.sampled_from(["GpuConfig", "MigDeviceConfig"]))
    params: dict[str, Any] = {"apiVersion": "gpu.dra-gpu.io/v1alpha1", "kind": kind}
    ok = True
    strategy = draw(st.sampled_from([None, "Exclusive", "TimeSlicing", "MPS"]))
    if strategy is not None or draw(st.booleans()):
        sharing: dict[str, Any] = {}
        if strategy is not None:
            sharing["strategy"] = strategy
        ok &= not (strategy == "TimeSlicing" and kind == "MigDeviceConfig")
        coherent = draw(st.integers(0, 3)) > 0  # the block of the strategy, if any; else any block
        if (strategy == "TimeSlicing") if coherent else draw(st.booleans()):  # timeSlicing
            interval = draw(st.sampled_from(["Default", "Short", "Medium", "Long", "short", "Never"]))
            sharing["timeSlicing"] = {"interval": interval}
            ok &= strategy == "TimeSlicing" and interval in ("Default", "Short", "Medium", "Long")
        if (strategy == "MPS") if coherent else draw(st.booleans()):  # mps
            mps: dict[str, Any] = {}
            if draw(st.booleans()):
                pct = draw(st.integers(-1, 101) | st.integers(1, 100))
                mps["defaultActiveThreadPercentage"] = pct
                ok &= 1 <= pct <= 100
            if draw(st.booleans()):
                limit, fits = draw(
                    st.sampled_from([("10Gi", True), ("1Mi", True), ("1Ki", False), ("512Mi", True),
                                     (1 << 30, True), ("ten", False), ("-1Gi", False)])
                )  # fmt: skip
                mps["defaultPinnedDeviceMemoryLimit"] = limit
                ok &= fits
            sharing["mps"] = mps
            ok &= strategy == "MPS"
        params["sharing"] = sharing
    params, mutations = draw(mutated(params, rate=4))
    return params, ok and not mutations


@reaches(0.2, "invalid, denied at its field")
@reaches(0.1, "valid, accepted", "mutated, still valid, accepted")
@FUZZ
@given(opaque_configs())
def test_opaque_config_accepted_exactly_when_valid(params_ok: tuple[Any, bool]) -> None:
    """decode() accepts exactly the valid configs; through the admission rules (bounds, size and
    decoding, as the webhook and the kubelet plugin see it) a rejected one is denied with an
    error at its own field path, never anything else."""
    params, ok = params_ok
    try:
        timed(decode, params)
        decoded = True
    except ConfigError as exc:
        decoded = False
        assert exc.message and exc.path is not None
    if ok:
        assert decoded, params
    claim = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "c", "namespace": "default"},
        "spec": {
            "devices": {
                "requests": [{"name": "gpu", "exactly": {"deviceClassName": GPU_CLASS["metadata"]["name"]}}],
                "config": [{"opaque": {"driver": DRIVER, "parameters": params}}],
            }
        },
    }
    v = timed(VALIDATOR.validate, claim)
    if decoded and not decode_object(claim):
        assert v.allowed, v.lines()
        reach("valid, accepted" if ok else "mutated, still valid, accepted")
        return
    assert not ok, params
    assert not v.allowed
    where = "spec.devices.config[0].opaque.parameters"
    assert all(p.path.startswith(where) for p in v.errors), v.lines()
    reach("invalid, denied at its field")


@reaches(0.8, "parsed to its value")
@FUZZ
@given(quantity_texts())
def test_quantities_parse_to_their_value(text_value: tuple[str, Decimal]) -> None:
    text, want = text_value
    try:
        q = timed(parse_quantity, text)
    except ValueError:
        # refused only where Kubernetes refuses too: a fraction of the smallest unit
        assert (want * 1000) % 1 != 0, text
        reach("refused (below 1m)")
        return
    assert q == want, (text, q, want)
    reach("parsed to its value")


@FUZZ
@given(
    st.text(max_size=40) | st.from_regex(r"[+-]?[0-9]{0,5}(\.[0-9]{0,3})?([eE][+-]?[0-9]{1,12}|Ki|Gi|m|k)?")
)
def test_quantity_text_is_bounded(text: str) -> None:
    try:
        q = timed(parse_quantity, text)
    except ValueError:
        reach("refused")
        return
    assert q.is_finite()
    reach("parsed")


@st.composite
def yaml_texts(draw: st.DrawFn) -> tuple[str, bool]:
    docs = draw(st.lists(objects(), min_size=1, max_size=3))
    text = yaml.safe_dump_all(docs)
    if draw(st.integers(0, 2)):
        return text, True
    at = draw(st.integers(0, len(text)))
    cut = draw(st.integers(0, 5))
    insert = draw(st.sampled_from(["", ":", "- ", "&a ", "*a", "{", "\t", "'", "!!python/object ", "\n  "]))
    return text[:at] + insert + text[at + cut :], False


@reaches(0.5, "valid, loaded", "mutated, loaded")
@FUZZ
@given(yaml_texts())
def test_yaml_loads_as_pyyaml_does(text_valid: tuple[str, bool]) -> None:
    """Valid YAML of generated objects loads to the same documents as PyYAML's safe loader; a
    mutated text loads or raises a YAML error (nothing else)."""
    text, valid = text_valid
    try:
        docs = list(load_yaml_all(text))
    except yaml.YAMLError:
        assert not valid, text
        reach("mutated, refused")
        return
    if valid:
        assert docs == list(yaml.safe_load_all(text))
    reach(
        ("valid" if valid else "mutated") + ", loaded: " + "+".join(sorted({type(d).__name__ for d in docs}))
    )


@reaches(0.25, "valid, served")
@FUZZ
@given(profiles().flatmap(lambda p: mutated(p, rate=4)))
def test_profiles_are_served_or_refused_by_field(doc_n: tuple[Any, int]) -> None:
    """A valid profile is served with its GPUs (discovered through the simulated NVML); a mutated
    one is served or refused with an error naming the file."""
    doc, mutations = doc_n
    try:
        timed(parse_profile, yaml.safe_dump(doc), "fuzz.yaml")
    except ProfileError as exc:
        assert mutations, (exc, doc)
        assert str(exc).startswith("fuzz.yaml: "), exc
        reach("mutated, refused")
        return
    if not mutations:
        inventory = discover_doc(doc)
        assert sorted(g.uuid for g in inventory.gpus) == sorted(g["uuid"] for g in doc["gpus"])
    reach("valid, served" if not mutations else "mutated, parsed")


WEBHOOK_SLICES = node_slices()
BUSY = allocated("busy", "node-a", [device_names(WEBHOOK_SLICES)[0], device_names(WEBHOOK_SLICES)[4]])
WEBHOOK_VALIDATOR = Validator(DRIVER, WEBHOOK_SLICES, [GPU_CLASS], [BUSY])  # the server's view


@reaches(0.7, "valid allowed", "valid denied", "mutated allowed", "mutated denied")
@reaches(0.2, "valid allowed", "mutated allowed")
@fuzz_settings(20)
@given(claim_models().map(lambda m: m.json()).flatmap(mutated), json_values)
def test_webhook_answers_as_validate(tmp_path_factory: Any, obj_n: tuple[Any, int], request: Any) -> None:
    """Generated claims in AdmissionReviews to the real webhook over HTTPS: 200 with the verdict
    `dra-gpu validate` gives over the same view; arbitrary requests: 200 or 400, never a 500. One
    server for all examples (starting one is the slow part)."""
    obj, mutations = obj_n
    server = _webhook_server(tmp_path_factory)
    review = {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "u",
            "kind": {"group": "resource.k8s.io", "version": "v1", "kind": "ResourceClaim"},
            "operation": "CREATE",
            "object": obj,
        },
    }
    status, raw = server.request("/validate", json.dumps(review, allow_nan=True).encode())
    if isinstance(obj, dict):  # what the webhook validates: kind and apiVersion from the review if unset
        obj = {
            **obj,
            "kind": obj.get("kind") or "ResourceClaim",
            "apiVersion": obj.get("apiVersion") or RESOURCE,
        }
    want = WEBHOOK_VALIDATOR.validate(obj)
    if status == 400:
        reach("mutated, 400")  # a wrong type where the review's shape reads it (the object, metadata)
        assert mutations
    else:
        assert status == 200, (status, raw)
        assert json.loads(raw)["response"]["allowed"] == want.allowed, (raw, want.lines())
        reach(("valid " if not mutations else "mutated ") + ("allowed" if want.allowed else "denied"))
    review["request"] = request
    try:
        body = json.dumps(review, allow_nan=True).encode()
    except (TypeError, ValueError):
        return
    status, _ = server.request("/validate", body)
    assert status in (200, 400), (status, review)


_SERVERS: list[Any] = []


def _webhook_server(tmp_path_factory: Any) -> Any:
    from .test_webhook import Server

    if not _SERVERS:
        _SERVERS.append(Server(tmp_path_factory.mktemp("webhook")))
    return _SERVERS[0]


@pytest.fixture(scope="module", autouse=True)
def _stop_servers() -> Iterator[None]:
    yield
    while _SERVERS:
        _SERVERS.pop().stop()
