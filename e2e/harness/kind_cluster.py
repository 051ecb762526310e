"""A kind cluster on the private daemon, from e2e/kind/kind-config.yaml and the local node image.

The config is the user's file plus e2e/kind/here.yaml (what this machine needs), merged: lists
appended, `nodes` replaced, mappings merged. `extra_mounts` adds host paths to every node (the
simulated NVIDIA driver root of a simulated node).

    python3 -m harness.kind_cluster create|delete|kubeconfig [NAME]     (from e2e/, daemon up)
"""

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import yaml

from . import kind_engine, kind_node
from .config import CACHE, E2E_DIR, V

KIND = os.path.join(CACHE, "bin", "kind-" + V["KIND_VERSION"], "kind")
USER_CONFIG = os.path.join(E2E_DIR, "kind", "kind-config.yaml")
HERE_CONFIG = os.path.join(E2E_DIR, "kind", "here.yaml")
NAME = os.environ.get("DRA_GPU_KIND_CLUSTER", "dra-gpu-kind")
WAIT = os.environ.get("DRA_GPU_KIND_WAIT", "240s")


def say(msg: str) -> None:
    print("[kind-cluster] " + msg, file=sys.stderr, flush=True)


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if key == "nodes":
            out[key] = value
        elif isinstance(value, list):
            out[key] = list(out.get(key) or []) + value
        elif isinstance(value, dict):
            out[key] = _merge(dict(out.get(key) or {}), value)
        else:
            out[key] = value
    return out


def config(extra_mounts: Sequence[str] = (), containerd_patches: Sequence[str] = ()) -> dict[str, Any]:
    with open(USER_CONFIG) as f:
        cfg: dict[str, Any] = yaml.safe_load(f)
    with open(HERE_CONFIG) as f:
        here: dict[str, Any] = yaml.safe_load(f)
    if kind_node.ETCD_TAG not in "".join(here.get("kubeadmConfigPatches", [])):
        raise RuntimeError(
            f"{HERE_CONFIG}: the etcd imageTag must be {kind_node.ETCD_TAG} (e2e/node/versions.sh)"
        )
    cfg = _merge(cfg, here)
    cfg["containerdConfigPatches"] = list(cfg.get("containerdConfigPatches") or []) + list(containerd_patches)
    if extra_mounts:
        mounts = [{"hostPath": p, "containerPath": p, "readOnly": True} for p in extra_mounts]
        cfg["nodes"] = [dict(n, extraMounts=list(n.get("extraMounts", [])) + mounts) for n in cfg["nodes"]]
    return cfg


def kind(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [KIND, *args], env=kind_engine.env(), capture_output=True, text=True, timeout=timeout, check=False
    )


def create(
    image: str, name: str = NAME, extra_mounts: Sequence[str] = (), containerd_patches: Sequence[str] = ()
) -> str:
    """Create the cluster; returns the path of its kubeconfig (in a new temporary directory)."""
    tmp = tempfile.mkdtemp(prefix="dra-gpu-kind-")
    path = os.path.join(tmp, "kind-config.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(config(extra_mounts, containerd_patches), f)
    kubeconfig = os.path.join(tmp, "kubeconfig")
    t0 = time.monotonic()
    r = kind(
        "create", "cluster", "--name", name, "--config", path, "--image", image, "--wait", WAIT,
        "--kubeconfig", kubeconfig, "--retain",
    )  # fmt: skip
    if r.returncode != 0:
        raise RuntimeError(f"kind create cluster failed ({r.returncode}):\n{r.stderr[-6000:]}")
    say(f"cluster {name} created in {time.monotonic() - t0:.0f} s")
    return kubeconfig


def delete(name: str = NAME) -> None:
    r = kind("delete", "cluster", "--name", name, timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"kind delete cluster failed ({r.returncode}):\n{r.stderr[-3000:]}")


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("create", "delete", "config"):
        print(__doc__, file=sys.stderr)
        return 2
    name = argv[1] if len(argv) > 1 else NAME
    if argv[0] == "create":
        print(create(kind_node.ensure_image(), name))
    elif argv[0] == "delete":
        delete(name)
    else:
        yaml.safe_dump(config(), sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
