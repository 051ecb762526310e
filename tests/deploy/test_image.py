"""deploy/Dockerfile and its build context, read as files (the image itself is built and run by
e2e/node/image_build.sh and e2e/tests/test_deploy_daemonset.py)."""

from __future__ import annotations

import re
import subprocess
import tomllib

import pytest
import yaml

from .conftest import CHART, ROOT, Render

DOCKERFILE = (ROOT / "deploy" / "Dockerfile").read_text()


def test_the_chart_runs_the_image_the_build_names() -> None:
    """`docker build -t localhost/dra-gpu:<version>` and e2e/node/image_build.sh name the image
    <name>:<version>, the name and tag (= appVersion = the package's version) the chart runs; the
    chart names no registry of its own (scripts/release sets the one it pushed to)."""
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert chart["appVersion"] == version
    image = values["image"]
    assert image["registry"] == image["repository"] == image["tag"] == image["digest"] == ""
    assert f"localhost/{image['name']}:{version}" in DOCKERFILE


def test_the_chart_refuses_to_guess_a_registry(helm: str) -> None:
    """Without image.registry (or image.repository) no image is rendered: a clear error instead."""
    r = subprocess.run([helm, "template", "x", str(CHART)], capture_output=True, text=True)
    assert r.returncode != 0 and "image.registry is not set" in r.stderr, r.stderr


@pytest.mark.parametrize(
    ("sets", "image"),
    [
        (["image.registry=reg.example.com:5000/gpu"], "reg.example.com:5000/gpu/dra-gpu:{v}"),
        (
            ["image.registry=reg.example.com/gpu", "image.digest=sha256:" + "a" * 64],
            "reg.example.com/gpu/dra-gpu:{v}@sha256:" + "a" * 64,
        ),
        (
            [
                "image.registry=reg.example.com",
                "simulatedProfile=hgx-2x4",
                "image.simulatorDigest=sha256:" + "b" * 64,
            ],
            "reg.example.com/dra-gpu-simnode:{v}@sha256:" + "b" * 64,
        ),
        (["image.repository=localhost/dra-gpu", "image.digest=sha256:" + "a" * 64], "localhost/dra-gpu:{v}"),
    ],
)
def test_the_image_from_registry_name_and_digest(render: Render, sets: list[str], image: str) -> None:
    version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    objs = render(*sets)
    seen = {
        c["image"]
        for o in objs
        if o["kind"] in ("DaemonSet", "Deployment")
        for c in o["spec"]["template"]["spec"].get("initContainers", [])
        + o["spec"]["template"]["spec"]["containers"]
    }
    assert seen == {image.format(v=version)}


@pytest.mark.parametrize(
    "value", ["https://reg.example.com", "reg.example.com/gpu/", "reg.example.com:5000/GPU", "a b"]
)
def test_the_schema_refuses_a_registry_that_is_not_one(helm: str, value: str) -> None:
    r = subprocess.run(
        [helm, "template", "x", str(CHART), "--set", f"image.registry={value}"],
        capture_output=True,
        text=True,
    )
    assert r.returncode != 0 and "/image/registry" in r.stderr, r.stderr


def test_dockerignore_sends_exactly_what_the_build_stage_copies() -> None:
    copied = {
        src.rstrip("/")
        for line in DOCKERFILE.splitlines()
        if line.startswith("COPY ") and "--from=" not in line
        for src in line.split()[1:-1]
    }
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    kept = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    assert "*" in ignore and kept == copied


def test_final_stage_is_the_base_plus_the_virtualenv() -> None:
    """No wheels, pip or build tools reach the final stage: it copies only /opt/dra-gpu."""
    final = DOCKERFILE.split("\nFROM ")[-1]
    assert re.findall(r"^COPY .*$", final, re.M) == ["COPY --from=build /opt/dra-gpu /opt/dra-gpu"]
    assert "pip " not in final and "apt-get" not in final
    assert re.search(r"^USER 65532:65532$", final, re.M) and 'ENTRYPOINT ["dra-gpu"]' in final


def test_every_python_package_and_the_public_base_are_pinned() -> None:
    """pip installs only the locks' files (sha256, scripts/lock), builds without an isolated
    environment (which would fetch its tools unpinned), and the default base is pinned by digest."""
    installs = re.findall(r"/bin/pip (?:install|wheel) ([^\\]*)", DOCKERFILE)
    assert installs == [
        "--require-hashes --only-binary=:all: -r requirements-build.lock ",
        "--no-deps --no-build-isolation --wheel-dir /wheels . ",
        "--no-compile --require-hashes --only-binary=:all: -r requirements.lock ",
        "--no-compile --no-deps --no-index /wheels/dra_gpu-*.whl ",
    ]
    (base,) = re.findall(r"^ARG PYTHON_IMAGE=(\S+)$", DOCKERFILE, re.M)
    assert re.fullmatch(r"python:[\w.-]+@sha256:[0-9a-f]{64}", base), base
