"""What the node's CDI hook program (`--cdi-hook-path`: NVIDIA's `nvidia-cdi-hook`, or `nvidia-ctk`
and its `hook` command) can do, asked of the program itself once, at start.

A spec that names a subcommand the program lacks fails every container of every claim with
toolkits before 1.18.0 (the runtime runs each hook and stops at its error); from 1.18.0 the
program skips an unknown hook with a warning, so the hook's work silently does not happen. Either
way the version a node has decides which hooks the spec may name: `disable-device-node-modification`
is in 1.18.0 and later, `apply-cuda-memory-limits` in 1.20.1 and later. The program's own `--help`
is the list, so a build that backports or drops a hook is read as it is, not from its version.

The program runs as the runtime would run it (the host path, directly, no shell), with a small
fixed environment and a time limit; the path is the host's, so the plugin must see the program at
that same path. The program is the administrator's choice, the same file the runtime runs as root
for every container; it is never a file of a container.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from dataclasses import dataclass

PROBE_TIMEOUT = 10.0  # seconds for each of --version and --help
# Nothing of the plugin's own environment (NVIDIA_CTK_DEBUG and the like change the output).
PROBE_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"}
MAX_OUTPUT = 64 * 1024  # what is parsed of each answer

CREATE_SYMLINKS = "create-symlinks"
ENABLE_CUDA_COMPAT = "enable-cuda-compat"
UPDATE_LDCACHE = "update-ldcache"
DISABLE_DEVICE_NODE_MODIFICATION = "disable-device-node-modification"
APPLY_CUDA_MEMORY_LIMITS = "apply-cuda-memory-limits"

# The driver files' hooks without which a claim's container does not get the driver's libraries
# the way the spec promises (the reason for setting a hook path at all).
REQUIRED = (CREATE_SYMLINKS, UPDATE_LDCACHE)
# The driver files' hooks a spec can go without, and what a claim's container loses.
OPTIONAL = {
    ENABLE_CUDA_COMPAT: "an image's CUDA forward-compat libraries are not put ahead of the driver's "
    "(toolkit 1.17.5 or newer has it)",
    DISABLE_DEVICE_NODE_MODIFICATION: "NVIDIA's libraries in a container may try to create "
    "/dev/nvidia* nodes; the device cgroup still holds it to its claim's GPUs (toolkit 1.18.0 or "
    "newer has it)",
}

_VERSION = re.compile(r"\bversion\s+v?(\d[\w.+~-]*)")
_NAME = re.compile(r"[a-z0-9][a-z0-9-]*")


class CdiHookError(ValueError):
    """The hook program cannot be used (cannot run, hangs, says nothing readable, lacks a hook);
    a ValueError: a setting of the node to fix, as the plugin's start reports it."""


def argv_prefix(path: str) -> list[str]:
    """A spec's argv up to the hook's name: nvidia-ctk runs hooks as `nvidia-ctk hook NAME`,
    nvidia-cdi-hook as `nvidia-cdi-hook NAME`."""
    base = os.path.basename(path)
    return [base, "hook"] if base == "nvidia-ctk" else [base]


@dataclass(frozen=True)
class CdiHook:
    """The hook program and what it answered at start."""

    path: str  # the host path, as the spec names it
    version: str  # as the program reports it, e.g. "1.17.8"
    subcommands: frozenset[str]  # the hooks it knows (with their aliases), "help" left out

    def supports(self, subcommand: str) -> bool:
        return subcommand in self.subcommands

    def missing_required(self) -> list[str]:
        """The hooks the driver files cannot do without (REQUIRED) that this program lacks."""
        return [name for name in REQUIRED if not self.supports(name)]

    def missing_optional(self) -> list[str]:
        """The driver files' optional hooks this program lacks (left out of every spec)."""
        return [name for name in OPTIONAL if not self.supports(name)]


def _run(argv: list[str], timeout: float) -> str:
    """stdout of `argv` (no shell, PROBE_ENV); a hang is killed with its whole process group."""
    where = " ".join(argv)
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=PROBE_ENV,
            start_new_session=True,  # its own group: a hang is ended with every child it started
        )
    except OSError as exc:
        raise CdiHookError(f"CDI hook {argv[0]}: cannot run `{where}`: {exc.strerror or exc}") from exc
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise CdiHookError(f"CDI hook {argv[0]}: `{where}` did not finish within {timeout:g} s") from None
    if proc.returncode != 0:
        tail = err.decode(errors="replace").strip()[-300:]
        raise CdiHookError(f"CDI hook {argv[0]}: `{where}` exited {proc.returncode}: {tail or '(no output)'}")
    return out[:MAX_OUTPUT].decode(errors="replace")


def parse_version(text: str) -> str | None:
    """The version of `--version` ("NVIDIA CDI Hook version 1.20.2", a "commit: ..." line after)."""
    match = _VERSION.search(text)
    return match.group(1) if match else None


def parse_subcommands(text: str) -> frozenset[str]:
    """The commands of a `--help` (urfave/cli's COMMANDS: section, as v2 and v3 print it): each is a
    line at the section's least indentation, `name, alias  usage`; a longer usage continues on
    lines indented deeper, and a category (`Name:` alone on its line) is skipped."""
    lines: list[str] = []
    section = False
    for line in text.splitlines():
        if line.rstrip() == "COMMANDS:":
            section = True
        elif section and line and not line[0].isspace():
            break  # the next section (GLOBAL OPTIONS:)
        elif section and line.strip():
            lines.append(line)
    if not lines:
        return frozenset()
    indent = min(len(line) - len(line.lstrip()) for line in lines)
    names: set[str] = set()
    for line in lines:
        if len(line) - len(line.lstrip()) != indent:
            continue
        columns = re.split(r"\s{2,}|\t", line.strip(), maxsplit=1)
        if len(columns) == 1 and columns[0].endswith(":"):
            continue  # a category's name; a usage may end with a colon too
        names.update(n for n in columns[0].split(", ") if _NAME.fullmatch(n))
    return frozenset(names - {"help", "h"})


def probe(path: str, timeout: float = PROBE_TIMEOUT) -> CdiHook:
    """Ask the program at `path` for its version and hooks; CdiHookError says why it cannot be used."""
    if not os.path.isabs(path):
        raise CdiHookError(f"CDI hook {path!r}: not an absolute path (the runtime runs it by its host path)")
    if not os.path.isfile(path):
        raise CdiHookError(
            f"CDI hook {path}: no such file where the plugin runs (it must see the host's program at "
            "the same path)"
        )
    hook_help = [path, *argv_prefix(path)[1:], "--help"]
    version = parse_version(_run([path, "--version"], timeout))
    if version is None:
        raise CdiHookError(f"CDI hook {path}: `{path} --version` printed no version")
    subcommands = parse_subcommands(_run(hook_help, timeout))
    if not subcommands:
        raise CdiHookError(f"CDI hook {path}: `{' '.join(hook_help)}` listed no hook (COMMANDS:)")
    return CdiHook(path, version, subcommands)


def probe_for_driver_files(path: str, timeout: float = PROBE_TIMEOUT) -> CdiHook:
    """`probe`, and a CdiHookError when the program lacks a hook the driver files cannot do
    without (REQUIRED)."""
    hook = probe(path, timeout)
    missing = hook.missing_required()
    if missing:
        raise CdiHookError(
            f"CDI hook {path} (version {hook.version}) has no {', '.join(missing)} hook; it has "
            f"{', '.join(sorted(hook.subcommands))}: install NVIDIA's container toolkit 1.18.0 or newer"
        )
    return hook
