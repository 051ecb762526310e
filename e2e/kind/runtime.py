#!/usr/bin/env python3
"""An OCI runtime for dockerd that runs runc without the capabilities this machine cannot grant.

Docker gives a `--privileged` container every capability it knows; runc then fails with "unable to
apply caps: operation not permitted" where the caller's bounding set lacks one (here:
CAP_SYS_RESOURCE). kind runs every node container privileged, so the private daemon of
e2e/harness/kind_engine.py registers this file as its default runtime. It removes from the OCI
spec (`<bundle>/config.json` at create/run, the `--process` file at exec) every capability that
is not in this process's bounding set, then execs runc with the same arguments. On a machine
whose bounding set is full it changes nothing.

    $DRA_GPU_RUNC: the runc to exec (default: runc on PATH)
"""

import json
import os
import sys

# Linux capability numbers (include/uapi/linux/capability.h), as OCI specs name them.
CAPS = [
    "CHOWN", "DAC_OVERRIDE", "DAC_READ_SEARCH", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID",
    "SETPCAP", "LINUX_IMMUTABLE", "NET_BIND_SERVICE", "NET_BROADCAST", "NET_ADMIN", "NET_RAW",
    "IPC_LOCK", "IPC_OWNER", "SYS_MODULE", "SYS_RAWIO", "SYS_CHROOT", "SYS_PTRACE", "SYS_PACCT",
    "SYS_ADMIN", "SYS_BOOT", "SYS_NICE", "SYS_RESOURCE", "SYS_TIME", "SYS_TTY_CONFIG", "MKNOD",
    "LEASE", "AUDIT_WRITE", "AUDIT_CONTROL", "SETFCAP", "MAC_OVERRIDE", "MAC_ADMIN", "SYSLOG",
    "WAKE_ALARM", "BLOCK_SUSPEND", "AUDIT_READ", "PERFMON", "BPF", "CHECKPOINT_RESTORE",
]  # fmt: skip


def bounding_set() -> set[str]:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("CapBnd:"):
                bits = int(line.split()[1], 16)
                return {"CAP_" + name for i, name in enumerate(CAPS) if bits >> i & 1}
    return {"CAP_" + name for name in CAPS}


def strip_caps(path: str, process_only: bool) -> None:
    """Drop unavailable capabilities from a spec (or a process file) in place, atomically."""
    with open(path) as f:
        spec = json.load(f)
    process = spec if process_only else spec.get("process", {})
    caps = process.get("capabilities")
    if not caps:
        return
    allowed = bounding_set()
    changed = False
    for kind, names in caps.items():
        kept = [n for n in names if n in allowed]
        if len(kept) != len(names):
            caps[kind] = kept
            changed = True
    if not changed:
        return
    tmp = path + ".drop-caps.tmp"
    with open(tmp, "w") as f:
        json.dump(spec, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def option(args: list[str], name: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def main(args: list[str]) -> None:
    # runc's global options come first; the first bare word is the command.
    command = next(
        (
            a
            for i, a in enumerate(args)
            if not a.startswith("-") and (i == 0 or not _takes_value(args[i - 1]))
        ),
        "",
    )
    if command in ("create", "run"):
        bundle = option(args, "--bundle") or option(args, "-b") or "."
        strip_caps(os.path.join(bundle, "config.json"), process_only=False)
    elif command == "exec":
        process = option(args, "--process") or option(args, "-p")
        if process:
            strip_caps(process, process_only=True)
    runc = os.environ.get("DRA_GPU_RUNC", "runc")
    os.execvp(runc, [runc, *args])


def _takes_value(arg: str) -> bool:
    # runc's global options that take a separate value (`--root DIR`, `--log FILE`, ...).
    return arg in ("--root", "--log", "--log-format", "--criu", "--rootless")


if __name__ == "__main__":
    main(sys.argv[1:])
