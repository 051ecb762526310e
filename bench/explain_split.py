"""Where `dra-gpu explain`'s CPU goes, stage by stage, on controller_bench.py's explain input.

    .venv/bin/python bench/explain_split.py [--nodes 100] [--runs 3] [--tree OTHER_CHECKOUT]

Each run is a fresh interpreter doing what the command does (`dra_gpu.cli.main` for explain), with
the CPU time (process_time) of each stage: importing the command line, importing the controller
(CEL engine), loading the file (read, YAML, bounds and shapes), and explaining in this process
(the rules' view, the devices) and in the bounded child (the claims; its CPU from RUSAGE_CHILDREN).
`--tree` runs the stages in another checkout (its .venv), alternating with this one: before/after
pairs in the same minutes.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.controller_bench import cluster, explain_claims  # noqa: E402

STAGES = """
import resource, sys, time
t0 = time.process_time(); w0 = time.perf_counter()
import dra_gpu.cli
t1 = time.process_time()
import dra_gpu.controller.explain, dra_gpu.controller.rules
from dra_gpu.controller.commands import explain_inputs
from dra_gpu.controller.inputs import load_files
t2 = time.process_time()
inputs = load_files([sys.argv[1]])
t3 = time.process_time()
explain_inputs(inputs, bounded=True)
t4 = time.process_time()
child = resource.getrusage(resource.RUSAGE_CHILDREN)
print(f"import cli {1000 * (t1 - t0):.0f} ms, import controller {1000 * (t2 - t1):.0f} ms, "
      f"load {1000 * (t3 - t2):.0f} ms, explain here {1000 * (t4 - t3):.0f} ms, "
      f"in the child {1000 * (child.ru_utime + child.ru_stime):.0f} ms; "
      f"wall {time.perf_counter() - w0:.2f} s")
"""


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--nodes", type=int, default=100)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--tree", type=Path, help="another checkout to alternate with (e.g. main)")
    args = p.parse_args()
    trees = [ROOT, *([args.tree.resolve()] if args.tree else [])]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "all.yaml"
        path.write_text(yaml.safe_dump_all([*cluster(args.nodes, args.nodes // 2), *explain_claims()]))
        print(f"explain input: {args.nodes} nodes x 8 GPUs, 20 claims, {path.stat().st_size} bytes of YAML")
        for _ in range(args.runs):
            for tree in trees:
                python = sys.executable if tree == ROOT else str(tree / ".venv" / "bin" / "python")
                cmd = [python, "-c", STAGES, str(path)]
                out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=tree)
                print(f"{tree.name}: {out.stdout.strip()}" if len(trees) > 1 else out.stdout.strip())


if __name__ == "__main__":
    main()
