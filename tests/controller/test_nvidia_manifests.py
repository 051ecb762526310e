"""`dra-gpu validate --nvidia-compatible -f tests/data/nvidia-manifests`: manifests written for
NVIDIA's DRA driver, each object with its verdict, as a user runs it."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import yaml
from simnode.fake import discover_node

from dra_gpu.common.exit_codes import EXIT_INVALID
from dra_gpu.model import nvidia_compat
from dra_gpu.node.slices import build_slices

from .test_cli_controller import run

MANIFESTS = Path(__file__).resolve().parents[1] / "data" / "nvidia-manifests"
RUNS = "runs on dra-gpu"
CD_CLASS = "compute-domain-default-channel.nvidia.com"
CD_DRIVER = "compute-domain.nvidia.com"
# (file under MANIFESTS, Kind/name) -> its lines' text after the object, in the order printed.
EXPECTED: dict[tuple[str, str], list[str]] = {
    ("compute-domain.yaml", "ResourceClaimTemplate/nvl-channel"): [
        "spec.spec.devices.requests[0].exactly.deviceClassName: "
        + str(nvidia_compat.unsupported_reason(CD_CLASS)),
        f"spec.spec.devices.config[0].opaque.driver: driver {CD_DRIVER} is NVIDIA's driver for "
        f"{nvidia_compat.UNSUPPORTED_DRIVERS[CD_DRIVER]}, which dra-gpu does not do",
    ],
    ("gpu-from-template.yaml", "ResourceClaimTemplate/one-gpu"): [RUNS],
    ("gpu-from-template.yaml", "Pod/trainer"): [RUNS],  # its resourceClaims name a template there is
    ("mig-profiles.yaml", "ResourceClaim/two-migs-one-gpu"): [RUNS],
    ("mig-profiles.yaml", "ResourceClaimTemplate/mig-or-gpu"): [RUNS],
    ("sharing.yaml", "ResourceClaimTemplate/time-sliced-gpu"): [RUNS],
    ("sharing.yaml", "ResourceClaim/mps-gpu"): [RUNS],
    ("vfio.yaml", "ResourceClaimTemplate/passthrough-gpu"): [
        "spec.spec.devices.requests[0].exactly.deviceClassName: "
        + str(nvidia_compat.unsupported_reason("vfio.gpu.nvidia.com"))
    ],
    ("workloads/extended-resource-pod.yaml", "Pod/classic-gpu-pod"): [RUNS],
    ("workloads/mig-extended-resources.yaml", "DeviceClass/mig-1g-10gb.nvidia.com"): [
        "selects devices of dra-gpu (gpu.nvidia.com)"
    ],
    ("workloads/mig-extended-resources.yaml", "Job/small-inference"): [RUNS],
    ("workloads/mig-extended-resources.yaml", "Deployment/medium-inference"): [
        "spec.template.spec.containers[0].resources.limits[nvidia.com/mig-2g.20gb]: no DeviceClass has "
        "extendedResourceName nvidia.com/mig-2g.20gb, so the scheduler has no class to serve it from: "
        "create one that selects gpu.nvidia.com's devices with extendedResourceName: "
        "nvidia.com/mig-2g.20gb, e.g. type == 'mig' and that profile"
    ],
}
SKIPPED = {
    ("compute-domain.yaml", "ComputeDomain/nvl-domain"),
    ("gpu-from-template.yaml", "Namespace/gpu-demo"),
}
LINE = re.compile(r"^(?P<file>[^:]+): (?P<who>[A-Za-z]+/[^:]+): (?P<text>.*)$")


def verdicts(stdout: str) -> dict[tuple[str, str], list[str]]:
    """Each object's lines, keyed by its file (relative to MANIFESTS) and Kind/name."""
    found: dict[tuple[str, str], list[str]] = defaultdict(list)
    for line in stdout.splitlines():
        m = LINE.match(line)
        assert m, f"not a verdict line: {line!r}"
        found[(str(Path(m["file"]).relative_to(MANIFESTS)), m["who"])].append(m["text"])
    return dict(found)


def skipped(stderr: str) -> set[tuple[str, str]]:
    out = set()
    for line in stderr.splitlines():
        m = LINE.match(line)
        if m and m["text"] == "skipped: not a DRA object":
            out.add((str(Path(m["file"]).relative_to(MANIFESTS)), m["who"]))
    return out


def test_each_object_has_its_verdict_and_the_refused_ones_fail_the_run() -> None:
    out = run("validate", "--nvidia-compatible", "-f", str(MANIFESTS))
    assert out.returncode == EXIT_INVALID, out.stderr
    assert verdicts(out.stdout) == EXPECTED
    assert skipped(out.stderr) == SKIPPED
    # In the input's order: the files sorted, the documents as written.
    files = [LINE.match(line)["file"] for line in out.stdout.splitlines()]  # type: ignore[index]
    assert files == sorted(files)


def test_against_a_nodes_slices_the_same_claims_are_feasible(tmp_path: Path) -> None:
    """With an A100-80GB MIG node's slices (gpu.nvidia.com) the claims are placed too: through the
    chart's classes, which the directory does not hold. A profile the node lacks cannot be."""
    slices = build_slices(discover_node("node-a", "dgx-a100-mig"), nvidia_compat.DRIVER_NAME)
    (tmp_path / "slices.yaml").write_text(yaml.safe_dump_all(slices))
    out = run("validate", "--nvidia-compatible", "-f", str(MANIFESTS), "-f", str(tmp_path / "slices.yaml"))
    assert out.returncode == EXIT_INVALID
    assert verdicts(out.stdout) == EXPECTED
    assert "feasibility not checked" not in out.stderr

    forty_gb = next(yaml.safe_load_all((MANIFESTS / "mig-profiles.yaml").read_text()))
    forty_gb["spec"]["devices"]["requests"][0]["exactly"]["selectors"][0]["cel"]["expression"] = (
        "device.attributes['gpu.nvidia.com'].profile == '1g.5gb'"  # an A100-40GB profile
    )
    (tmp_path / "a100-40gb.yaml").write_text(yaml.safe_dump(forty_gb))
    out = run(
        "validate",
        "--nvidia-compatible",
        "-f",
        str(tmp_path / "a100-40gb.yaml"),
        "-f",
        str(tmp_path / "slices.yaml"),
    )
    assert out.returncode == EXIT_INVALID
    assert out.stdout.startswith(
        "ResourceClaim/two-migs-one-gpu: spec.devices: can never be satisfied by the published devices"
    ), out.stdout


def test_in_the_default_mode_nvidias_names_are_not_dra_gpus() -> None:
    """Without --nvidia-compatible the driver is gpu.dra-gpu.io: NVIDIA's classes and configs are
    some other driver's, left alone, and nothing is refused for being NVIDIA's."""
    out = run("validate", "-f", str(MANIFESTS))
    found = verdicts(out.stdout)
    assert not any("does not do" in text for lines in found.values() for text in lines)
    assert found[("vfio.yaml", "ResourceClaimTemplate/passthrough-gpu")] == [
        "asks for no device of gpu.dra-gpu.io: not dra-gpu's, left as it is"
    ]
    # The chart's gpu.dra-gpu.io class has nvidia.com/gpu in this mode too.
    assert found[("workloads/extended-resource-pod.yaml", "Pod/classic-gpu-pod")] == [RUNS]
