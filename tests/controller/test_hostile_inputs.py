"""Hostile inputs, as a user gives them: `dra-gpu validate` / `explain` / `inventory --profile` must
answer each with a field error and exit 0, 1 or 2, quickly, never a traceback."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from .objects import GPU_CLASS, claim, node_slices

MPS = {"apiVersion": "gpu.dra-gpu.io/v1alpha1", "kind": "GpuConfig", "sharing": {"strategy": "MPS"}}


def run(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "dra_gpu.cli", *args], capture_output=True, text=True, timeout=timeout
    )
    assert time.monotonic() - start < timeout
    assert "Traceback" not in out.stderr, out.stderr
    assert out.returncode in (0, 1, 2, 5), (out.returncode, out.stderr)
    return out


def with_limit(limit: Any) -> dict[str, Any]:
    params = copy.deepcopy(MPS)
    params["sharing"]["mps"] = {"defaultPinnedDeviceMemoryLimit": limit}
    return claim("q", config=[{"opaque": {"driver": "gpu.dra-gpu.io", "parameters": params}}])


def wrong(path: list[Any], value: Any) -> dict[str, Any]:
    c = claim("w")
    target: Any = c
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return c


def slice_with(path: list[str], value: Any) -> dict[str, Any]:
    """node-a's first slice with one field of its first device replaced."""
    s = node_slices()[0]
    target: Any = s["spec"]["devices"][0]
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return s


HOSTILE: dict[str, tuple[str, str]] = {
    "huge-exponent": (yaml.safe_dump(with_limit("1e999999999")), "is not a quantity"),
    "nan": (yaml.safe_dump(with_limit("NaN")), "is not a quantity"),
    "infinity": (yaml.safe_dump(with_limit("Infinity")), "is not a quantity"),
    "float-nan": (yaml.safe_dump(with_limit(float("nan"))), "not a number"),
    "billion-laughs": (
        'a: &a ["x","x","x","x","x","x","x","x","x"]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\n'
        "c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\nd: [*c,*c,*c,*c,*c,*c,*c,*c,*c]\n",
        "aliases",
    ),
    "number-for-list": (yaml.safe_dump(wrong(["spec", "devices", "requests"], 3)), "must be a list"),
    "string-metadata": (yaml.safe_dump(wrong(["metadata"], "x")), "metadata: must be an object"),
    "string-status": (yaml.safe_dump(wrong(["status"], "x")), "status: must be an object"),
    "null-request": (yaml.safe_dump(wrong(["spec", "devices", "requests"], [None])), "must not be null"),
    "list-selector": (
        yaml.safe_dump(wrong(["spec", "devices", "requests", 0, "exactly", "selectors"], [{"cel": [1]}])),
        "cel: must be an object",
    ),
    "deep": ("a: " + "[" * 5000 + "]" * 5000 + "\n", "nest"),
    "slice-wrong-types": (
        yaml.safe_dump_all([{**node_slices()[0], "spec": {"driver": 1, "devices": "x"}}, claim("c")]),
        "spec.driver: must be a string",
    ),
    # A ResourceSlice is decoded before the allocator reads it: missing fields are field errors too.
    "slice-without-spec": (
        yaml.safe_dump_all([{k: v for k, v in node_slices()[0].items() if k != "spec"}, claim("c")]),
        "ResourceSlice/node-a-gpu.dra-gpu.io-0: spec: required",
    ),
    "capacity-without-value": (
        yaml.safe_dump_all([slice_with(["capacity", "memory"], {}), claim("c")]),
        "spec.devices[0].capacity.memory.value: required",
    ),
    "attribute-without-type": (
        yaml.safe_dump_all([slice_with(["attributes", "productName"], {}), claim("c")]),
        "spec.devices[0].attributes.productName: needs exactly one of int, bool, string, version; got none",
    ),
    "class-config-string": (
        yaml.safe_dump({**GPU_CLASS, "spec": {"config": "x"}}),
        "spec.config: must be a list",
    ),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_validate_refuses_with_a_field_error(tmp_path: Path, name: str) -> None:
    text, message = HOSTILE[name]
    p = tmp_path / "in.yaml"
    p.write_text(text)
    out = run("validate", "-f", str(p), timeout=20)
    assert out.returncode in (1, 2)
    assert message in out.stdout + out.stderr


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_explain_refuses(tmp_path: Path, name: str) -> None:
    p = tmp_path / "in.yaml"
    p.write_text(HOSTILE[name][0])
    run("explain", "-f", str(p), timeout=20)


def test_special_files_are_refused(tmp_path: Path) -> None:
    out = run("validate", "-f", "/dev/zero", timeout=10)
    assert out.returncode == 2 and "not a regular file" in out.stderr
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    out = run("validate", "-f", str(fifo), timeout=10)
    assert out.returncode == 2 and "not a regular file" in out.stderr
    out = run("inventory", "--profile", "/dev/zero", timeout=10)
    assert out.returncode in (1, 2) and "not a regular file" in out.stderr


def profile(gpus: list[dict[str, Any]], **top: Any) -> str:
    doc = {"name": "p", "driverVersion": "570.133.20", "cudaDriverVersion": 12080, "gpus": gpus, **top}
    return yaml.safe_dump(doc)


def gpu(i: int, **extra: Any) -> dict[str, Any]:
    g = {
        "index": i,
        "uuid": f"GPU-{i:08x}-0000-0000-0000-000000000000",
        "name": "NVIDIA H100 80GB HBM3",
        "brand": "nvidia",
        "architecture": "hopper",
        "computeCapability": "9.0",
        "memoryMiB": 81559,
        "pciBusId": f"00000000:{i // 256:02x}:{i % 256:02x}.0",
    }
    g.update(extra)
    return g


BAD_PROFILES = {
    "negative-memory": (profile([gpu(0, memoryMiB=-1)]), "memoryMiB"),
    "unhashable-brand": (profile([gpu(0, brand=["x"])]), "brand"),
    "unhashable-error": (profile([gpu(0)], nvmlErrors={"nvmlInit": {"a": 1}}), "nvmlErrors"),
    "negative-numa": (profile([gpu(0, numaNode=-3)]), "numaNode"),
    "self-link": (
        profile([gpu(0, nvlinkCount=1, nvlinks=[{"remote": "00000000:00:00.0", "links": 1}])]),
        "itself",
    ),
    "mig-on-volta": (profile([gpu(0, architecture="volta", mig={"enabled": True})]), "no MIG"),
    "too-many-gpus": (profile([gpu(i) for i in range(10_000)]), "larger than"),
    "257-gpus": (profile([gpu(i) for i in range(257)]), "at most 256"),
    "deep": ("name: " + "[" * 3000 + "]" * 3000, "nest"),
    "aliases": ("a: &a [1,2]\nb: [*a, *a]\n", "aliases"),
}


@pytest.mark.parametrize("name", sorted(BAD_PROFILES))
def test_bad_profiles_are_refused(tmp_path: Path, name: str) -> None:
    text, message = BAD_PROFILES[name]
    p = tmp_path / "profile.yaml"
    p.write_text(text)
    out = run("inventory", "--profile", str(p), timeout=30)
    assert out.returncode != 0 and message in out.stderr, out.stderr


def test_exponential_clique_graph_is_bounded(tmp_path: Path) -> None:
    """GPUs on NVSwitches arranged so that the link graph is the complement of disjoint triangles
    (3^(n/3) maximal cliques): capped, so it finishes."""
    n = 60
    switches = [f"0000{s:04x}:ff:00.0" for s in range(64)]
    # Each pair of GPUs not in the same triangle shares a switch: with 64 switches, give each switch
    # the GPUs that differ from one triangle; GPU i is on switch t when i // 3 != t (20 triangles).
    gpus = []
    for i in range(n):
        links = [{"remote": switches[t], "links": 1} for t in range(n // 3) if i // 3 != t][:18]
        gpus.append(gpu(i, nvlinkCount=18, nvlinks=links))
    p = tmp_path / "profile.yaml"
    p.write_text(profile(gpus, nvswitches=switches))
    run("inventory", "--profile", str(p), timeout=60)


# Doublings of a string for a selector over its budget: it reads only `device.driver`, so it is
# evaluated once for all devices (they share the outcome), and 26 doublings (1.9 GB) fit the 2 GiB
# memory budget once; 27 (3.8 GB) do not.
DOUBLINGS = 27


def test_costly_selector_is_bounded(tmp_path: Path) -> None:
    """A selector that doubles a string 27 times (gigabytes for one device) is stopped by the memory
    cap or the deadline, with a message; the command does not take minutes or the machine's memory."""
    from bench.webhook_hostile_bench import doubling_selector

    p = tmp_path / "in.yaml"
    p.write_text(
        yaml.safe_dump_all(
            [*node_slices(), GPU_CLASS, claim("hostile", selectors=[doubling_selector(DOUBLINGS)])]
        )
    )
    out = run("validate", "-f", str(p), timeout=30)
    assert out.returncode == 1 and ("memory budget" in out.stdout or "took longer" in out.stdout), out.stdout
    out = run("explain", "-f", str(p), timeout=30)
    assert "memory budget" in out.stdout or "took longer" in out.stdout, out.stdout


def test_a_costly_claim_between_others_costs_only_its_own_answer(tmp_path: Path) -> None:
    """explain runs the claims in one bounded child while they stay within budget: the claims
    before and after a hostile one are explained as if it were not there."""
    import json

    from bench.webhook_hostile_bench import doubling_selector

    claims = [
        claim("before", 2),
        claim("hostile", selectors=[doubling_selector(DOUBLINGS)]),
        claim("after", 2),
    ]
    p = tmp_path / "in.yaml"
    p.write_text(yaml.safe_dump_all([*node_slices(), GPU_CLASS, *claims]))
    out = run("explain", "-f", str(p), "-o", "json", timeout=30)
    answers = {c["name"]: c for c in json.loads(out.stdout)["claims"]}
    assert answers["before"]["allocatable"] and answers["after"]["allocatable"], answers
    assert not answers["hostile"]["allocatable"]
    assert "memory budget" in answers["hostile"]["reason"] or "took longer" in answers["hostile"]["reason"]


def test_a_cluster_claim_too_deep_to_decode_is_left_out_and_said(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`validate` / `explain --kubeconfig` read the cluster's claims under the bounds the plugin
    and the webhook keep: a tenant's claim nested 1,500 levels (which the apiserver stores) is left
    out with a warning naming it, and the cluster's other objects are read."""
    import kubernetes

    from dra_gpu.controller.inputs import Inputs, load_cluster

    deep = '{"n":' + "[" * 1500 + "1" + "]" * 1500 + "}"
    claims = (
        '{"kind":"ResourceClaimList","metadata":{},"items":['
        '{"metadata":{"name":"poisoned","namespace":"t"},"spec":{"devices":{"config":[{"opaque":'
        '{"driver":"d","parameters":' + deep + "}}]}}},"
        '{"metadata":{"name":"fine","namespace":"t"},"spec":{}}]}'
    ).encode()

    class Answer:
        def __init__(self, data: bytes) -> None:
            self.data = data

    class Api:
        def __init__(self, _client: object) -> None:
            pass

        def list_resource_slice(self, **_: object) -> Answer:
            return Answer(b'{"items":[]}')

        def list_device_class(self, **_: object) -> Answer:
            return Answer(b'{"items":[{"metadata":{"name":"c"},"spec":{}}]}')

        def list_resource_claim_for_all_namespaces(self, **_: object) -> Answer:
            return Answer(claims)

    monkeypatch.setattr(kubernetes.config, "new_client_from_config", lambda **_: object())
    monkeypatch.setattr(kubernetes.client, "ResourceV1Api", Api)
    inputs = Inputs()
    load_cluster("kubeconfig", inputs)
    assert [c["metadata"]["name"] for c in inputs.claims] == ["fine"]
    assert [c["metadata"]["name"] for c in inputs.classes] == ["c"]
    err = capsys.readouterr().err
    assert "resourceclaims t/poisoned: nested more than 64 levels deep; left out" in err
