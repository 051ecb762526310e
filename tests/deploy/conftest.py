"""Fixtures for the chart and example tests: the real Helm (built once from its Go module by
deploy/build-helm.sh and cached), and a renderer of the chart."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "dra-gpu"
EXAMPLES = ROOT / "deploy" / "examples"
KUBE_VERSION = "1.37.2"

Render = Callable[..., list[dict[str, Any]]]


def find_helm() -> str:
    """$DRA_GPU_HELM, else the pinned Helm from the cache (built on first use; a few minutes)."""
    if os.environ.get("DRA_GPU_HELM"):
        return os.environ["DRA_GPU_HELM"]
    if shutil.which("go") is None:
        cache = Path(os.environ.get("DRA_GPU_CACHE", Path.home() / ".cache" / "dra-gpu"))
        built = sorted(cache.glob("bin/helm-*/helm"))
        if not built:
            pytest.skip("no Helm: set DRA_GPU_HELM or install Go so deploy/build-helm.sh can build it")
        return str(built[-1])
    r = subprocess.run(["bash", str(ROOT / "deploy" / "build-helm.sh")], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.fail("deploy/build-helm.sh failed:\n" + r.stderr[-3000:])
    return r.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="session")
def helm() -> str:
    return find_helm()


TEST_REGISTRY = "registry.example.com/gpu"


def render_chart(
    helm: str,
    *sets: str,
    namespace: str = "dra-gpu",
    release: str = "dra-gpu",
    kube_version: str = KUBE_VERSION,
) -> list[dict[str, Any]]:
    cmd = [helm, "template", release, str(CHART), "--namespace", namespace, "--kube-version", kube_version]
    # The registry a user sets once (the chart has none): first, so that a test's own sets win.
    for s in (f"image.registry={TEST_REGISTRY}", *sets):
        cmd += ["--set", s]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, f"helm template {' '.join(sets)} failed:\n{r.stderr}"
    return [d for d in yaml.safe_load_all(r.stdout) if d]


@pytest.fixture(scope="session")
def render(helm: str) -> Render:
    def _render(*sets: str, **kw: Any) -> list[dict[str, Any]]:
        return render_chart(helm, *sets, **kw)

    return _render


def by_kind(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


def one(objs: list[dict[str, Any]], kind: str, name_part: str = "") -> dict[str, Any]:
    found = [o for o in by_kind(objs, kind) if name_part in o["metadata"]["name"]]
    names = [o["metadata"]["name"] for o in found]
    assert len(found) == 1, f"expected one {kind} named *{name_part}*, got {names}"
    return found[0]
