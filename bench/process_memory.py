"""A process's resident memory from /proc: VmRSS, its anonymous and file-backed parts, by mapping.

Anonymous is what the process itself allocated (heap, malloc and pymalloc arenas, thread stacks,
copy-on-write data of the shared objects). File-backed is mapped code and data of CPython and the
extension modules: page cache, shared and reclaimable, and how much of it a process maps depends on
the page cache's state (a freshly installed .venv maps more of the same .so files than an older
one), so compare it only between runs on the same .venv.
"""

from __future__ import annotations

import collections
import re
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Memory:
    rss_mb: float
    anonymous_mb: float
    file_mb: float
    threads: int
    by_mapping: list[tuple[str, float]]  # the largest first

    def __str__(self) -> str:
        return (
            f"{self.rss_mb:.1f} MB (anonymous {self.anonymous_mb:.1f} MB, file-backed {self.file_mb:.1f} MB)"
        )


def memory(pid: int, top: int = 8) -> Memory:
    by_mapping: collections.Counter[str] = collections.Counter()
    anonymous = 0
    mapping = ""
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            fields = line.split()
            mapping = Path(fields[5]).name if len(fields) > 5 else "[anon]"
        elif line.startswith("Rss:"):
            by_mapping[mapping] += int(line.split()[1])
        elif line.startswith("Anonymous:"):
            anonymous += int(line.split()[1])
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    rss = int(status["VmRSS"].split()[0])
    return Memory(
        rss_mb=rss / 1024,
        anonymous_mb=anonymous / 1024,
        file_mb=(rss - anonymous) / 1024,
        threads=int(status["Threads"]),
        by_mapping=[(name, kb / 1024) for name, kb in by_mapping.most_common(top)],
    )
