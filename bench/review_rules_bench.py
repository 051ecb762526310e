"""The rules' CPU for one warm review, in one process (what a review worker spends on the rules):
`Validator.validate` on the controller bench's claim (3 selectors + NVLink) over its cluster (half
the nodes fully in use), after a first, cold review.

    .venv/bin/python bench/review_rules_bench.py [--nodes 125] [--reviews 2000] [--tree PATH]

`--tree` runs it against another checkout's dra_gpu (a before/after pair from one script).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path


def _commit(tree: Path) -> str:
    """The checkout's commit (and + when it has changes), naming which code was measured."""
    git = ["git", "-C", str(tree)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout
    status = [*git, "status", "--porcelain", "--untracked-files=no"]
    dirty = subprocess.run(status, capture_output=True).stdout
    return head.strip() + ("+" if dirty else "") or "?"


def run(nodes: int, reviews: int) -> None:
    import dra_gpu
    from bench.controller_bench import SELECTORS, cluster
    from dra_gpu.controller.cluster_state import ClusterState
    from tests.controller.objects import NVLINK, claim

    docs = cluster(nodes, nodes // 2)
    state = ClusterState("gpu.dra-gpu.io")
    for store, kind in (("slices", "ResourceSlice"), ("classes", "DeviceClass"), ("claims", "ResourceClaim")):
        state.replace(store, [d for d in docs if d["kind"] == kind])
    obj = {
        **claim("bench", 2, selectors=SELECTORS, constraints=NVLINK),
        "kind": "ResourceClaim",
        "apiVersion": "resource.k8s.io/v1",
    }
    start = time.process_time()
    cold = state.validator().validate(obj)
    cold_ms = (time.process_time() - start) * 1000
    assert not cold.errors, cold.errors
    start = time.process_time()
    for _ in range(reviews):
        state.validator().validate(obj)
    warm_ms = (time.process_time() - start) * 1000 / reviews
    devices = sum(len(d["spec"]["devices"]) for d in docs if d["kind"] == "ResourceSlice")
    print(
        f"rules ({_commit(Path(dra_gpu.__file__).parent.parent)}): {devices} devices on {nodes} nodes: "
        f"cold review {cold_ms:.1f} ms CPU, warm {warm_ms:.3f} ms CPU per review ({reviews} reviews)"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=125)
    ap.add_argument("--reviews", type=int, default=2000)
    ap.add_argument("--tree", type=Path, default=Path(__file__).resolve().parent.parent)
    args = ap.parse_args()
    sys.path.insert(0, str(args.tree.resolve()))
    sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # bench/ and tests/ of this checkout
    run(args.nodes, args.reviews)


if __name__ == "__main__":
    main()
