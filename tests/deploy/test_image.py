"""deploy/Dockerfile and its build context, read as files (the image itself is built and run by
e2e/node/image_build.sh and e2e/tests/test_deploy_daemonset.py)."""

from __future__ import annotations

import re
import tomllib

import yaml

from .conftest import CHART, ROOT

DOCKERFILE = (ROOT / "deploy" / "Dockerfile").read_text()


def test_the_chart_runs_the_image_the_build_names() -> None:
    """`docker build -t localhost/dra-gpu:<version>` and e2e/node/image_build.sh name the image what the
    chart runs by default: repository localhost/dra-gpu, tag = appVersion = the package's version."""
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert chart["appVersion"] == version
    assert values["image"]["repository"] == "localhost/dra-gpu" and values["image"]["tag"] == ""
    assert f"localhost/dra-gpu:{version}" in DOCKERFILE


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
