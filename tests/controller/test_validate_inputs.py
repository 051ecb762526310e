"""What `dra-gpu validate` and `dra-gpu explain` read and know beyond the objects given: a
directory (recursive, bounded), the chart's DeviceClasses, workloads asking for nvidia.com/gpu,
and the driver name from --driver-name / --nvidia-compatible."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from dra_gpu.common.exit_codes import EXIT_INVALID, EXIT_OK, EXIT_USAGE
from dra_gpu.controller import inputs as inputs_module
from dra_gpu.controller.extended_resources import gpu_requests, workload_verdict
from dra_gpu.controller.inputs import InputError, directory_files, load_files
from dra_gpu.controller.rules import Validator
from dra_gpu.model.device_classes import chart_device_classes

from .objects import DRIVER, GPU_CLASS, claim, node_slices
from .test_cli_controller import run, write


def pod(name: str, resources: dict[str, Any], kind: str = "Pod") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": kind,
        "metadata": {"name": name},
        "spec": {"containers": [{"name": "c", "image": "i", "resources": resources}]},
    }


# ---------------------------------------------------------------- directories


def test_a_directory_is_read_recursively_in_sorted_order(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "a").mkdir()
    for rel in ("b/z.yaml", "a/y.yml", "a/x.json", "top.yaml", "notes.txt", "a/README.md"):
        (tmp_path / rel).write_text("{}\n")
    elsewhere = tmp_path.parent / f"{tmp_path.name}-outside"
    elsewhere.mkdir()
    (elsewhere / "outside.yaml").write_text("{}\n")
    (tmp_path / "link").symlink_to(elsewhere, target_is_directory=True)  # not followed
    found = [str(Path(p).relative_to(tmp_path)) for p in directory_files(str(tmp_path))]
    assert found == ["a/x.json", "a/y.yml", "b/z.yaml", "top.yaml"]


@pytest.mark.parametrize(
    ("bound", "value", "message"),
    [
        ("MAX_DIRECTORY_FILES", 2, "more than 2 YAML/JSON files under it"),
        ("MAX_DIRECTORY_BYTES", 10, "hold more than 10 bytes together"),
        ("MAX_DIRECTORY_ENTRIES", 3, "more than 3 entries under it"),
    ],
)
def test_a_directory_past_a_bound_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bound: str, value: int, message: str
) -> None:
    for i in range(3):
        (tmp_path / f"{i}.yaml").write_text("kind: x\n")
    (tmp_path / "other.txt").write_text("")
    monkeypatch.setattr(inputs_module, bound, value)
    with pytest.raises(InputError, match=message):
        load_files([str(tmp_path)])
    monkeypatch.undo()
    assert len(load_files([str(tmp_path)]).others) == 3


def test_validate_refuses_a_directory_of_too_many_files(tmp_path: Path) -> None:
    for i in range(inputs_module.MAX_DIRECTORY_FILES + 1):
        (tmp_path / f"{i:04}.yaml").write_text("")
    out = run("validate", "-f", str(tmp_path))
    assert out.returncode == EXIT_USAGE
    assert f"more than {inputs_module.MAX_DIRECTORY_FILES} YAML/JSON files under it" in out.stderr


def test_files_keep_the_output_they_had_and_a_directory_names_each_objects_file(tmp_path: Path) -> None:
    slices = write(tmp_path, "slices.yaml", node_slices())
    d = tmp_path / "manifests"
    (d / "team").mkdir(parents=True)
    (d / "team" / "claims.yaml").write_text(yaml.safe_dump_all([claim("ok", 2), claim("nope", 16)]))
    (d / "class.json").write_text(json.dumps(GPU_CLASS))
    single = run("validate", "-f", slices, "-f", str(d / "team" / "claims.yaml"))
    assert single.returncode == EXIT_INVALID
    assert [line.split(":")[0] for line in single.stdout.splitlines()] == ["ResourceClaim/nope"]
    report = run("validate", "-f", slices, "-f", str(d))
    assert report.returncode == EXIT_INVALID
    lines = report.stdout.splitlines()
    assert lines[:2] == [
        f"{d}/class.json: DeviceClass/gpu.dra-gpu.io: selects devices of dra-gpu ({DRIVER})",
        f"{d}/team/claims.yaml: ResourceClaim/ok: runs on dra-gpu",
    ]
    assert lines[2].startswith(
        f"{d}/team/claims.yaml: ResourceClaim/nope: spec.devices: can never be satisfied"
    )
    assert len(lines) == 3


# ---------------------------------------------------------------- the chart's classes


def test_validate_knows_the_charts_classes(tmp_path: Path) -> None:
    """A claim naming the chart's class is checked against the devices although no file holds the
    class: 16 GPUs on an 8-GPU node can never be had (without the class: only 'does not exist')."""
    slices = write(tmp_path, "slices.yaml", node_slices())
    claims = write(tmp_path, "claims.yaml", [claim("two", 2), claim("sixteen", 16)])
    out = run("validate", "-f", slices, "-f", claims)
    assert out.returncode == EXIT_INVALID
    assert out.stdout.startswith("ResourceClaim/sixteen: spec.devices: can never be satisfied"), out.stdout
    assert "does not exist" not in out.stdout + out.stderr


def test_a_class_of_the_input_stands_for_the_charts(tmp_path: Path) -> None:
    """The input's gpu.dra-gpu.io without extendedResourceName is the class the cluster has: a pod
    asking nvidia.com/gpu has nothing to be served from."""
    mine = {**GPU_CLASS, "spec": {**GPU_CLASS["spec"]}}
    files = write(tmp_path, "all.yaml", [mine, pod("classic", {"limits": {"nvidia.com/gpu": 1}})])
    out = run("validate", "-f", files)
    assert out.returncode == EXIT_INVALID
    assert out.stdout.startswith(
        "Pod/classic: spec.containers[0].resources.limits[nvidia.com/gpu]: no DeviceClass has "
        "extendedResourceName nvidia.com/gpu"
    ), out.stdout
    alone = run(
        "validate", "-f", write(tmp_path, "pod.yaml", [pod("classic", {"limits": {"nvidia.com/gpu": 1}})])
    )
    assert alone.returncode == EXIT_OK, alone.stdout


def test_explain_knows_the_charts_classes(tmp_path: Path) -> None:
    slices = write(tmp_path, "slices.yaml", node_slices())
    claims = write(tmp_path, "claims.yaml", [claim("two", 2)])
    out = run("explain", "-f", slices, "-f", claims, "-o", "json")
    assert out.returncode == EXIT_OK, out.stderr
    (entry,) = json.loads(out.stdout)["claims"]
    assert entry["allocatable"] and len(entry["devices"]) == 2


def test_explain_in_nvidia_compatible_mode_places_nvidias_mig_claim(tmp_path: Path) -> None:
    from simnode.fake import discover_node

    from dra_gpu.node.slices import build_slices

    slices = build_slices(discover_node("node-a", "dgx-a100-mig"), "gpu.nvidia.com")
    manifests = Path(__file__).resolve().parents[1] / "data" / "nvidia-manifests" / "mig-profiles.yaml"
    args = ["explain", "-f", write(tmp_path, "s.yaml", slices), "-f", str(manifests), "-o", "json"]
    out = run(*args, "--nvidia-compatible")
    assert out.returncode == EXIT_OK, out.stderr
    entry, template = json.loads(out.stdout)["claims"]
    # The file's template is explained as the claim made from it.
    assert template["source"] == "ResourceClaimTemplate/mig-or-gpu" and template["allocatable"]
    small, medium = entry["results"]
    assert (
        small["driver"],
        small["device"].split("-mig-")[1][:6],
        medium["device"].split("-mig-")[1][:6],
    ) == (
        "gpu.nvidia.com",
        "1g10gb",
        "2g20gb",
    )
    # The same parent GPU (matchAttribute gpu.nvidia.com/parentUUID).
    assert small["device"].split("-mig-")[0] == medium["device"].split("-mig-")[0]
    # Without the mode the driver is gpu.dra-gpu.io, whose devices these slices are not.
    default = json.loads(run(*args).stdout)["claims"][0]
    assert default["allocatable"] is False


@pytest.mark.parametrize("command", ["validate", "explain"])
def test_contradicting_driver_flags_are_a_usage_error(tmp_path: Path, command: str) -> None:
    f = write(tmp_path, "c.yaml", [claim("c")])
    out = run(command, "--nvidia-compatible", "--driver-name", "gpu.dra-gpu.io", "-f", f)
    assert out.returncode == EXIT_USAGE
    assert "--driver-name gpu.dra-gpu.io contradicts --nvidia-compatible" in out.stderr


# ---------------------------------------------------------------- workloads


@pytest.mark.parametrize(
    ("obj", "expected"),
    [
        (
            pod("p", {"limits": {"nvidia.com/gpu": 2, "cpu": 1}}),
            [("spec.containers[0].resources.limits[nvidia.com/gpu]", "nvidia.com/gpu")],
        ),
        (
            pod("p", {"requests": {"nvidia.com/mig-1g.10gb": 1}}),
            [("spec.containers[0].resources.requests[nvidia.com/mig-1g.10gb]", "nvidia.com/mig-1g.10gb")],
        ),
        (pod("p", {"limits": {"example.com/fpga": 1, "nvidia.com/gpu.shared": 1}}), []),
        (pod("p", {"limits": {"nvidia.com/gpu": 1}}, kind="Service"), []),
        (
            {
                "apiVersion": "batch/v1",
                "kind": "CronJob",
                "metadata": {"name": "c"},
                "spec": {
                    "jobTemplate": {
                        "spec": {
                            "template": {
                                "spec": {
                                    "initContainers": [
                                        {"name": "i", "resources": {"limits": {"nvidia.com/gpu": 1}}}
                                    ],
                                    "containers": [
                                        {
                                            "name": "c",
                                            "resources": {
                                                "limits": {"nvidia.com/gpu": 1},
                                                "requests": {"nvidia.com/gpu": 1},
                                            },
                                        }
                                    ],
                                }
                            }
                        }
                    }
                },
            },
            [
                (
                    "spec.jobTemplate.spec.template.spec.initContainers[0].resources.limits[nvidia.com/gpu]",
                    "nvidia.com/gpu",
                ),
                (
                    "spec.jobTemplate.spec.template.spec.containers[0].resources.limits[nvidia.com/gpu]",
                    "nvidia.com/gpu",
                ),
            ],
        ),
    ],
    ids=["pod-limits", "pod-requests-mig", "other-resources", "not-a-workload", "cronjob"],
)
def test_gpu_requests_of_workloads(obj: dict[str, Any], expected: list[tuple[str, str]]) -> None:
    assert gpu_requests(obj) == expected


def test_a_class_of_another_driver_does_not_serve_a_workload() -> None:
    other = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": "gpu.example.com"},
        "spec": {
            "selectors": [{"cel": {"expression": "device.driver == 'gpu.example.com'"}}],
            "extendedResourceName": "nvidia.com/mig-1g.10gb",
        },
    }
    v = Validator(DRIVER, node_slices(), [*chart_device_classes(DRIVER), other])
    verdict = workload_verdict(v, pod("p", {"limits": {"nvidia.com/mig-1g.10gb": 1}}))
    assert [p.message for p in verdict.errors] == [
        f"DeviceClass gpu.example.com serves nvidia.com/mig-1g.10gb but selects no device of {DRIVER}"
    ]
    assert workload_verdict(v, pod("p", {"limits": {"nvidia.com/gpu": 1}})).errors == []
