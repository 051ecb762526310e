"""Property-based fuzzing (Hypothesis) of everything the tools decode: Kubernetes objects of every
kind the controller accepts, AdmissionReviews, opaque configs, quantities and node profiles.

Checked: no exception escapes (every problem is a field error), and each input is answered in
bounded time. CI runs a fixed-seed, small run (`derandomize=True`); a longer run:

    DRA_GPU_FUZZ_EXAMPLES=5000 .venv/bin/python -m pytest -q tests/controller/test_fuzz.py
"""

from __future__ import annotations

import contextlib
import copy
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from dra_gpu.api import ConfigError, decode
from dra_gpu.controller.inputs import Inputs
from dra_gpu.controller.rules import Validator
from dra_gpu.controller.schemas import ADMISSION_REVIEW
from dra_gpu.decoding import check_bounds, load_yaml_all
from dra_gpu.decoding import decode as decode_shape
from dra_gpu.kubernetes_values import parse_quantity
from dra_gpu.simnode.profiles import ProfileError, parse_profile
from tests.mutation import fuzz_settings, paths

from .objects import GPU_CLASS, claim, node_slices

EXAMPLES, FUZZ = fuzz_settings(60)
BOUND_S = 5.0  # per input

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
    | st.sampled_from(["1e999999999", "NaN", "Infinity", "80Gi", "-1", "gpu.dra-gpu.io", "ExactCount"])
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
SLICES = node_slices()
VALIDATOR = Validator("gpu.dra-gpu.io", SLICES, [GPU_CLASS])
BASES: list[dict[str, Any]] = [
    claim("c", 2, selectors=['device.attributes["gpu.dra-gpu.io"].type == "gpu"']),
    GPU_CLASS,
    {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": "t"},
     "spec": {"spec": claim("c")["spec"]}},
    SLICES[0],
]  # fmt: skip


@st.composite
def mutated_objects(draw: st.DrawFn) -> Any:
    """A valid object of one kind with one to three fields replaced by arbitrary JSON values."""
    obj = copy.deepcopy(draw(st.sampled_from(BASES)))
    for _ in range(draw(st.integers(1, 3))):
        where = draw(st.sampled_from(paths(obj)))
        value = draw(json_values)
        if not where:
            return value
        target = obj
        for key in where[:-1]:
            target = target[key]
        target[where[-1]] = value
    return obj


def timed(fn: Any, *args: Any) -> Any:
    start = time.monotonic()
    out = fn(*args)
    assert time.monotonic() - start < BOUND_S
    return out


@FUZZ
@given(mutated_objects())
def test_validator_never_raises(obj: Any) -> None:
    v = timed(VALIDATOR.validate, obj)
    for line in v.lines() + v.warning_lines():
        assert isinstance(line, str)


@FUZZ
@given(mutated_objects())
def test_inputs_never_raise(obj: Any) -> None:
    inputs = Inputs()
    timed(inputs.add, obj, "doc")


@FUZZ
@given(json_values)
def test_admission_review_shape_never_raises(request: Any) -> None:
    review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}
    timed(decode_shape, review, ADMISSION_REVIEW)


@FUZZ
@given(json_values)
def test_opaque_config_never_raises(sharing: Any) -> None:
    params = {"apiVersion": "gpu.dra-gpu.io/v1alpha1", "kind": "GpuConfig", "sharing": sharing}
    if check_bounds(params):
        return
    with contextlib.suppress(ConfigError):
        timed(decode, params)


@FUZZ
@given(
    st.text(max_size=40) | st.from_regex(r"[+-]?[0-9]{0,5}(\.[0-9]{0,3})?([eE][+-]?[0-9]{1,12}|Ki|Gi|m|k)?")
)
def test_quantities_are_bounded(text: str) -> None:
    try:
        q = timed(parse_quantity, text)
    except ValueError:
        return
    assert q.is_finite()


@FUZZ
@given(st.text(max_size=200))
def test_yaml_never_raises_unexpectedly(text: str) -> None:
    try:
        for doc in load_yaml_all(text):
            check_bounds(doc)
    except (yaml.YAMLError, RecursionError):
        pass


PROFILE = {
    "name": "p",
    "driverVersion": "570.133.20",
    "cudaDriverVersion": 12080,
    "gpus": [
        {"index": 0, "uuid": "GPU-00000000-0000-0000-0000-000000000000", "name": "NVIDIA H100 80GB HBM3",
         "brand": "nvidia", "architecture": "hopper", "computeCapability": "9.0", "memoryMiB": 81559,
         "pciBusId": "00000000:18:00.0", "nvlinkCount": 18, "mig": {"enabled": False}},
    ],
}  # fmt: skip


@FUZZ
@given(st.data())
def test_profiles_never_raise(data: st.DataObject) -> None:
    doc = copy.deepcopy(PROFILE)
    for _ in range(data.draw(st.integers(1, 3))):
        where = data.draw(st.sampled_from(paths(doc)))
        value = data.draw(json_values)
        if not where:
            doc = value
            break
        target = doc
        for key in where[:-1]:
            target = target[key]
        target[where[-1]] = value
    with contextlib.suppress(ProfileError):
        timed(parse_profile, yaml.safe_dump(doc), "fuzz.yaml")


@settings(FUZZ, max_examples=max(10, EXAMPLES // 3))
@given(st.lists(mutated_objects(), min_size=1, max_size=1), json_values)
def test_webhook_over_https_never_500(tmp_path_factory: Any, objs: list[Any], request: Any) -> None:
    """Mutated objects inside AdmissionReviews, and mutated requests, to the real webhook: 200 or
    400, never a 500. One server for all examples (starting one is the slow part)."""
    server = _webhook_server(tmp_path_factory)
    for req in (
        {"uid": "u", "kind": {"group": "resource.k8s.io", "version": "v1", "kind": "ResourceClaim"},
         "operation": "CREATE", "object": objs[0]},
        request,
    ):  # fmt: skip
        review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": req}
        try:
            body = json.dumps(review, allow_nan=True).encode()
        except (TypeError, ValueError):
            continue
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
