"""Start an MPS control daemon in a mount namespace of its own whose `/dev/shm` is its claim's.

    python -m dra_gpu.plugin.mps_namespace SHM_DIR PRELOAD BINARY [ARG...]

MPS clients and their server talk through POSIX shared memory, so the daemon (and the servers it
spawns, which inherit the namespace) and the claim's containers must see one `/dev/shm`: the
daemon's `shm/` directory, which the claim's CDI spec mounts at `/dev/shm` in its containers.
The namespace is a slave of the plugin's (mounts made later on the node still reach the daemon;
nothing mounted here leaks back). `PRELOAD` (may be empty) becomes `LD_PRELOAD` only at the
`execve`, so this short-lived Python process never loads the driver's library.

A separate program because `unshare(CLONE_NEWNS)` needs a single-threaded caller, which the
plugin is not.
"""

from __future__ import annotations

import ctypes
import os
import sys

CLONE_NEWNS = 0x00020000
MS_BIND = 0x1000
MS_REC = 0x4000
MS_SLAVE = 1 << 19
SHM = b"/dev/shm"


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise SystemExit(f"mps_namespace: {what}: {os.strerror(err)}")


def main(argv: list[str]) -> None:
    if len(argv) < 3:
        raise SystemExit("usage: python -m dra_gpu.plugin.mps_namespace SHM_DIR PRELOAD BINARY [ARG...]")
    shm, preload, binary, *args = argv
    libc = ctypes.CDLL(None, use_errno=True)
    _check(libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    _check(libc.mount(b"none", b"/", None, MS_REC | MS_SLAVE, None), "make / a slave")
    _check(libc.mount(os.fsencode(shm), SHM, None, MS_BIND, None), f"bind {shm} on /dev/shm")
    env = dict(os.environ)
    if preload:
        env["LD_PRELOAD"] = preload
    os.execve(binary, [binary, *args], env)


if __name__ == "__main__":
    main(sys.argv[1:])
