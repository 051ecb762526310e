"""What durability alone costs a write on this machine's disk: the atomic, fsynced write the
plugin makes of the files that must outlive a power loss (`dra_gpu.common.durable.replace_durably`: a
temp file, fsync, rename, fsync of the directory; the health taint book), the atomic write without
fsync it makes of the boot-scoped ones (`replace_atomically`: a claim's CDI spec and the
checkpoint), and the same bytes written as the peer driver writes its spec (one `write`, no temp
file, no fsync); then removed those ways.

Run it beside the cluster to see the cost in the minutes of a prepare bench (etcd fsyncs its WAL
on the same disk). The directories default to the e2e node's CDI and plugin directories.

Run: .venv/bin/python bench/durable_write_floor.py [--writes 300] [--size 9900] [DIR ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from dra_gpu.common.durable import fsync_dir, remove_file, replace_atomically, replace_durably

DEFAULT_DIRS = ("/var/run/cdi", "/var/lib/kubelet/plugins")


def plain_write(path: Path, data: bytes) -> None:
    path.write_bytes(data)


def plain_remove(path: Path) -> None:
    path.unlink()


def remove_durably(path: Path) -> None:
    remove_file(path)
    fsync_dir(path.parent)


def timed(n: int, step: Callable[[int], object]) -> list[float]:
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        step(i)
        out.append((time.perf_counter() - t0) * 1000)
    return out


def pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]


def measure(directory: Path, writes: int, size: int) -> None:
    data = os.urandom(size)
    with tempfile.TemporaryDirectory(prefix=".durable-floor-", dir=directory) as tmp:
        where = Path(tmp)
        rows = {
            "atomic write, fsynced": timed(writes, lambda i: replace_durably(where / f"d{i}.json", data)),
            "remove, directory fsynced": timed(writes, lambda i: remove_durably(where / f"d{i}.json")),
            "atomic write, no fsync": timed(writes, lambda i: replace_atomically(where / f"a{i}.json", data)),
            "remove, no fsync": timed(writes, lambda i: remove_file(where / f"a{i}.json")),
            "plain write (the peer's)": timed(writes, lambda i: plain_write(where / f"p{i}.json", data)),
            "plain remove": timed(writes, lambda i: plain_remove(where / f"p{i}.json")),
        }
    print(f"{directory} ({writes} files of {size} bytes)")
    for name, xs in rows.items():
        print(f"  {name:28s} p50 {statistics.median(xs):6.2f} ms  p99 {pct(xs, 0.99):6.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dirs", nargs="*", default=list(DEFAULT_DIRS))
    parser.add_argument("--writes", type=int, default=300)
    parser.add_argument("--size", type=int, default=9900, help="bytes: a spec with the driver's files")
    args = parser.parse_args()
    for d in args.dirs:
        directory = Path(d)
        directory.mkdir(parents=True, exist_ok=True)
        measure(directory, args.writes, args.size)


if __name__ == "__main__":
    main()
