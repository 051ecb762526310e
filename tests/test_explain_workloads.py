"""`dra-gpu explain` and `validate` on the manifests users apply (the examples as they are: Pods and
ResourceClaimTemplates), with kubectl's conventions: several -f, exit statuses a script can use,
one set of -o formats, flags after the subcommand. Run as a user would: the console script."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml
from simnode.fake import discover_node

from dra_gpu.common.exit_codes import EXIT_INVALID, EXIT_OK, EXIT_UNALLOCATABLE, EXIT_USAGE
from dra_gpu.node.slices import build_slices

DRA_GPU = shutil.which("dra-gpu") or str(Path(sys.executable).with_name("dra-gpu"))
EXAMPLES = Path(__file__).resolve().parents[1] / "deploy" / "examples"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [DRA_GPU, *args], capture_output=True, text=True, timeout=120, env=dict(os.environ), check=False
    )


def slices_file(tmp_path: Path, profile: str = "hgx-2x4") -> str:
    path = tmp_path / f"slices-{profile}.yaml"
    path.write_text(yaml.safe_dump_all(build_slices(discover_node("node-a", profile))))
    return str(path)


def write(tmp_path: Path, name: str, *docs: dict[str, Any]) -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump_all(docs))
    return str(path)


def pod(name: str, **claim: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "team"},
        "spec": {
            "containers": [{"name": "c", "image": "busybox", "resources": {"claims": [{"name": "gpu"}]}}],
            "resourceClaims": [{"name": "gpu", **claim}],
        },
    }


def test_the_four_nvlink_example_as_it_is_lands_on_one_nvlink_domain(tmp_path: Path) -> None:
    out = run(
        "explain", "-f", slices_file(tmp_path), "-f", str(EXAMPLES / "four-nvlink-gpus.yaml"), "-o", "json"
    )
    assert out.returncode == EXIT_OK, out.stderr
    [entry] = json.loads(out.stdout)["claims"]
    assert entry["source"] == "Pod/four-nvlink-gpus, claim gpus: ResourceClaimTemplate/four-nvlink-gpus"
    assert entry["allocatable"] and len(entry["devices"]) == 4
    assert entry["linkCost"] == entry["bestLinkCost"]  # the cheapest: one NVLink domain of hgx-2x4


def test_a_directory_of_examples_explains_each_pods_claims_once(tmp_path: Path) -> None:
    out = run("explain", "-f", slices_file(tmp_path), "-f", str(EXAMPLES), "-o", "yaml")
    doc = yaml.safe_load(out.stdout)
    by_source = {c["source"].split(",")[0]: c for c in doc["claims"]}
    # Two pods sharing one ResourceClaim: one answer that names both.
    assert by_source["Pod/shared-gpu-a"]["usedBy"] == ["Pod/shared-gpu-a", "Pod/shared-gpu-b"]
    assert "Pod/shared-gpu-b" not in by_source
    # A template a pod uses is explained as that pod's claim, not a second time on its own.
    assert not any(c["source"].startswith("ResourceClaimTemplate/") for c in doc["claims"])
    # hgx-2x4 has no MIG device: that example cannot be allocated there, and the status says so.
    assert not by_source["Pod/mig-3g40gb"]["allocatable"]
    assert out.returncode == EXIT_UNALLOCATABLE, out.stderr


def test_a_template_on_its_own_and_a_missing_one(tmp_path: Path) -> None:
    template = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": "one", "namespace": "team"},
        "spec": {
            "spec": {
                "devices": {"requests": [{"name": "g", "exactly": {"deviceClassName": "gpu.dra-gpu.io"}}]}
            }
        },
    }
    slices = slices_file(tmp_path)
    out = run("explain", "-f", slices, "-f", write(tmp_path, "t.yaml", template))
    assert out.returncode == EXIT_OK, out.stderr
    assert out.stdout.startswith("team/one (ResourceClaimTemplate/one): node node-a, devices ")

    missing = write(tmp_path, "p.yaml", pod("trainer", resourceClaimTemplateName="absent"))
    out = run("explain", "-f", slices, "-f", missing)
    assert out.returncode == EXIT_INVALID
    assert "ResourceClaimTemplate team/absent is not in the input" in out.stdout
    assert "--kubeconfig/--context" in out.stdout

    # validate: the reference is only a warning while the cluster was not read (the input may be
    # part of what is applied); -o json says the same for scripts.
    out = run("validate", "-f", missing, "-o", "json")
    assert out.returncode == EXIT_OK, out.stderr
    [obj] = json.loads(out.stdout)["objects"]
    assert obj["kind"] == "Pod" and obj["valid"]
    assert obj["warnings"][0]["path"] == "spec.resourceClaims[0].resourceClaimTemplateName"


def test_nothing_to_explain_and_a_cluster_that_cannot_be_read(tmp_path: Path) -> None:
    out = run("explain", "-f", slices_file(tmp_path))
    assert out.returncode == EXIT_USAGE and "nothing to explain" in out.stderr
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1"}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "dev", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "dev",
            }
        )
    )
    template = str(EXAMPLES / "one-gpu.yaml")
    # --context picks a context of the kubeconfig: one it lacks is an error that names it.
    out = run("explain", "-f", template, "--kubeconfig", str(kubeconfig), "--context", "prod")
    assert out.returncode == EXIT_USAGE
    assert f"cannot read the cluster with {kubeconfig}, context prod" in out.stderr
    out = run("explain", "-f", template, "--kubeconfig", str(kubeconfig), "--context", "dev")
    assert out.returncode == EXIT_USAGE and "context dev" in out.stderr  # nothing listens on port 1


def test_flags_after_the_subcommand_and_one_set_of_output_formats(tmp_path: Path) -> None:
    slices = slices_file(tmp_path)
    example = str(EXAMPLES / "one-gpu.yaml")
    out = run("explain", "-f", slices, "-f", example, "-v", "-o", "wide")
    assert out.returncode == EXIT_OK, out.stderr
    assert "  request gpu: gpu.dra-gpu.io pool node-a device " in out.stdout
    for command in ("validate", "explain"):
        out = run(command, "-f", example, "-f", slices, "-o", "table")  # the old name of text
        assert out.returncode == EXIT_OK, out.stderr
        out = run(command, "-f", example, "-o", "xml")
        assert out.returncode == EXIT_USAGE and "'text', 'json', 'yaml'" in out.stderr
