"""`dra-gpu validate` and `dra-gpu explain` as a user runs them: exit codes, output, no tracebacks."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from .objects import GPU_CLASS, NVLINK, allocated, claim, device_names, node_slices

DRA_GPU = shutil.which("dra-gpu") or str(Path(sys.executable).with_name("dra-gpu"))


def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(
        [DRA_GPU, *args], capture_output=True, text=True, timeout=60, input=stdin, check=False
    )
    assert "Traceback" not in out.stderr + out.stdout
    return out


def write(tmp_path: Path, name: str, docs: list[Any]) -> str:
    p = tmp_path / name
    p.write_text(yaml.safe_dump_all(docs))
    return str(p)


@pytest.fixture
def cluster_file(tmp_path: Path) -> str:
    slices = node_slices()
    busy = allocated("busy", "node-a", device_names(slices)[:2])
    return write(tmp_path, "cluster.yaml", [*slices, GPU_CLASS, busy])


def test_explain_json_classic(tmp_path: Path, cluster_file: str) -> None:
    claims = write(tmp_path, "claims.yaml", [claim("linked", 4, constraints=NVLINK), claim("plain", 4)])
    out = run("explain", "-f", cluster_file, "-f", claims, "-o", "json")
    assert out.returncode == 0, out.stderr
    linked, plain = json.loads(out.stdout)["claims"]
    assert (linked["name"], linked["linkCost"], plain["linkCost"], plain["bestLinkCost"]) == (
        "linked",
        6,
        18,
        6,
    )
    text = run("explain", "-f", cluster_file, "-f", claims)
    assert "default/plain: node node-a" in text.stdout and "(link cost 6)" in text.stdout


def test_validate_lines_and_exit_codes(tmp_path: Path, cluster_file: str) -> None:
    good = write(tmp_path, "good.yaml", [claim("ok", 2, constraints=NVLINK)])
    assert run("validate", "-f", cluster_file, "-f", good).returncode == 0
    bad = write(tmp_path, "bad.yaml", [claim("nope", 16, constraints=NVLINK), claim("ok", 1)])
    out = run("validate", "-f", cluster_file, "-f", bad)
    assert out.returncode == 1
    assert out.stdout.splitlines() == [
        "ResourceClaim/nope: spec.devices: can never be satisfied by the published devices: largest NVLink "
        "domain: 4 GPUs (node-a); the claim needs 16 NVLink-connected GPUs; request 'gpus' needs 16 GPUs; "
        "at most 8 match on one node (node-a)"
    ]


def test_validate_stdin(cluster_file: str) -> None:
    out = run("validate", "-f", cluster_file, "-f", "-", stdin=yaml.safe_dump(claim("x", selectors=["1 +"])))
    assert (
        out.returncode == 1 and "ResourceClaim/x: spec.devices.requests[0].exactly.selectors[0]" in out.stdout
    )


@pytest.mark.parametrize(
    ("content", "code", "message"),
    [
        ("a: [unclosed\n", 1, "not valid YAML"),
        ("{{{{ garbage ::: \x00", 1, "not valid YAML"),
        ("just a string\n", 1, "not a Kubernetes object"),
        ("[" * 5000 + "]" * 5000, 1, "not valid YAML"),
        (
            yaml.safe_dump({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}}),
            2,
            "no DeviceClass, ResourceClaim or ResourceClaimTemplate in the input",
        ),
        (
            yaml.safe_dump(
                {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceTaintRule", "metadata": {"name": "t"}}
            ),
            1,
            "DeviceTaintRule/t: kind: unsupported kind 'DeviceTaintRule'",
        ),
        (
            yaml.safe_dump(
                {
                    "apiVersion": "resource.k8s.io/v1beta1",
                    "kind": "ResourceClaim",
                    "metadata": {"name": "old"},
                    "spec": {},
                }
            ),
            1,
            "apiVersion: must be 'resource.k8s.io/v1'",
        ),
        (
            yaml.safe_dump(
                {
                    "apiVersion": "resource.k8s.io/v1",
                    "kind": "ResourceClaim",
                    "metadata": {"name": "s"},
                    "spec": "nonsense",
                }
            ),
            1,
            "ResourceClaim/s: spec: must be an object with 'devices'",
        ),
    ],
    ids=[
        "unclosed",
        "garbage",
        "scalar",
        "deeply-nested-yaml",
        "only-a-pod",
        "wrong-dra-kind",
        "old-api",
        "bad-spec",
    ],
)
def test_bad_input(tmp_path: Path, content: str, code: int, message: str) -> None:
    p = tmp_path / "in.yaml"
    p.write_text(content)
    out = run("validate", "-f", str(p))
    assert out.returncode == code, (out.stdout, out.stderr)
    assert message in out.stdout + out.stderr


def test_huge_object(tmp_path: Path) -> None:
    c = claim("huge")
    c["metadata"]["annotations"] = {"x": "y" * (4 * 1024 * 1024)}
    out = run("validate", "-f", write(tmp_path, "huge.yaml", [c]))
    assert out.returncode == 1 and "the apiserver accepts at most 3145728" in out.stdout


def test_deeply_nested_cel(tmp_path: Path, cluster_file: str) -> None:
    deep = claim("deep", selectors=["(" * 3000 + "true" + ")" * 3000])
    out = run("validate", "-f", cluster_file, "-f", write(tmp_path, "deep.yaml", [deep]))
    assert out.returncode == 1 and "recursion limit" in out.stdout


def test_usage_and_io_errors(tmp_path: Path) -> None:
    assert run("validate").returncode == 2
    missing = run("validate", "-f", str(tmp_path / "missing.yaml"))
    assert missing.returncode == 2 and "cannot read" in missing.stderr
    only_slices = write(tmp_path, "s.yaml", node_slices())
    assert run("explain", "-f", only_slices).returncode == 2
    assert run("validate", "--kubeconfig", str(tmp_path / "nope"), "-f", only_slices).returncode == 2


def test_workload_objects_beside_claims_are_skipped(tmp_path: Path) -> None:
    """Example files hold Pods next to their claims: the Pods are skipped, the claims checked."""
    p = tmp_path / "example.yaml"
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}}
    p.write_text(yaml.safe_dump_all([claim("ok"), pod]))
    out = run("validate", "-f", str(p))
    assert out.returncode == 0, (out.stdout, out.stderr)
    assert "Pod/p: skipped: not a DRA object" in out.stderr
