#!/usr/bin/env python3
"""NVIDIA's own DRA kubelet plugin (gpu-kubelet-plugin of sigs.k8s.io/dra-driver-nvidia-gpu) as a
host process on a simulated GPU node.

    e2e/node/nvidia_plugin.py --profile dgx-h100 --root DIR --kubeconfig FILE --node-name NAME
                              [--feature-gates DynamicMIG=true,...] [--print] [-- EXTRA FLAGS]

runs it in the foreground (Ctrl-C stops it); `--print` only prints the environment and command.

Importable (stdlib and simnode only):

    plugin = NvidiaPlugin.on_profile("dgx-a100-mig", root, kubeconfig, "node-a", plugins_dir,
                                     registry_dir, cdi_dir, feature_gates=["DynamicMIG=true"])
    plugin.start()            # stdout and stderr to plugin.log_path (default <root>/nvidia-plugin.log)
    ...                       # its ResourceSlices: spec.driver=gpu.nvidia.com, spec.nodeName=node-a
    plugin.stop()             # SIGTERM, then SIGKILL: bounded waits; returns the exit status

The command is the one measured in docs/reference/nvidia-dra-driver-v0.5.0.md ("Measured"):

- the binary `${DRA_GPU_CACHE:-~/.cache/dra-gpu}/bin/dra-driver-nvidia-gpu-<NVIDIA_DRA_VERSION>/
  gpu-kubelet-plugin` (`e2e/node/build.sh nvidia-dra`) and the container toolkit's nvidia-cdi-hook
  of `.../nvidia-container-toolkit-<NVIDIA_CTK_VERSION>/` (`build.sh toolkit`), the pins of
  e2e/node/versions.sh;
- its driver root (host and container side) the node's driver root view (`<root>/driver-root`:
  the simulated driver and the node's `dev/`, where NVIDIA's CDI generator finds device nodes);
  its host root the node's root (`dev/`, `proc/`, `sys/`);
- the environment: `DRA_GPU_SIM_DEV_DIR` and `DRA_GPU_SIM_PROC_DIR` (the simulated library's
  node), `NVIDIA_DRA_SYSFS_ROOT` (PCIe roots and NUMA nodes from the node's sysfs) and
  `ALT_PROC_DEVICES_PATH` (the node's `/proc/devices`; NVIDIA's code takes it as "mock NVML" and
  skips Fabric Manager);
- `--image-name` (required by the plugin; used only for MPS control daemon Deployments).

NVIDIA's ResourceSlice controller makes the Node object the owner of its slices: it publishes
nothing until a Node of `node_name` exists ('retrieve node "NAME": nodes "NAME" not found').
`fake_node(name)` is such a Node for a node name no kubelet runs.

Nothing of NVIDIA's code is changed or copied; what it asks of NVML that the simulated library
does not answer as a real driver would is the simulation's defect (sim/simnode).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from simnode.node import DEV_DIR_ENV, PROC_DIR_ENV, SimulatedNode, prepare_simulated_node

HERE = Path(__file__).resolve().parent
VERSIONS = HERE / "versions.sh"
DRIVER_NAME = "gpu.nvidia.com"
DEFAULT_IMAGE = "localhost/none:0"  # never pulled: MPS is the only user of the image
TERM_WAIT = 15.0  # seconds for a graceful stop (the plugin deletes nothing on SIGTERM)
KILL_WAIT = 5.0


class NvidiaPluginError(RuntimeError):
    """NVIDIA's plugin cannot be run; the message names what is missing and how to get it."""


def pins() -> dict[str, str]:
    """The `NAME=value` pins of e2e/node/versions.sh (build.sh sources the same file)."""
    out = {}
    for line in VERSIONS.read_text().splitlines():
        m = re.fullmatch(r"([A-Z][A-Z0-9_]*)=([^\s(#]+)", line.strip())
        if m:
            out[m.group(1)] = m.group(2)
    return out


def cache_dir() -> Path:
    """build.sh's cache: $DRA_GPU_CACHE, else ~/.cache/dra-gpu."""
    return Path(os.environ.get("DRA_GPU_CACHE") or Path.home() / ".cache" / "dra-gpu")


def _built(component: str, program: str, how: str, cache: Path | None) -> Path:
    folder = (cache or cache_dir()) / "bin" / component
    path = folder / program
    if not (folder / ".complete").is_file() or not os.access(path, os.X_OK):
        raise NvidiaPluginError(f"{path}: not built (e2e/node/build.sh {how})")
    return path


def plugin_binary(cache: Path | None = None) -> Path:
    """NVIDIA's gpu-kubelet-plugin of the pinned release (NVIDIA_DRA_VERSION)."""
    version = pins()["NVIDIA_DRA_VERSION"]
    return _built(f"dra-driver-nvidia-gpu-{version}", "gpu-kubelet-plugin", "nvidia-dra", cache)


def cdi_hook(cache: Path | None = None) -> Path:
    """The container toolkit's nvidia-cdi-hook of the pinned release (NVIDIA_CTK_VERSION): without
    --nvidia-cdi-hook-path the plugin copies /usr/bin/nvidia-cdi-hook and fails if it is missing."""
    version = pins()["NVIDIA_CTK_VERSION"]
    return _built(f"nvidia-container-toolkit-{version}", "nvidia-cdi-hook", "toolkit", cache)


def fake_node(name: str) -> dict[str, Any]:
    """A Node object for `name` that no kubelet runs, as the e2e's other fake nodes are labelled;
    unschedulable and tainted, so that nothing is placed there."""
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"dra-gpu.io/e2e-fake": "true"}},
        "spec": {
            "unschedulable": True,
            "taints": [{"key": "dra-gpu.io/e2e-fake", "value": "true", "effect": "NoSchedule"}],
        },
    }


def gates_flag(feature_gates: Sequence[str] | Mapping[str, bool]) -> str:
    """`Key=bool,...` (NVIDIA's --feature-gates) from ["DynamicMIG=true"] or {"DynamicMIG": True}."""
    if isinstance(feature_gates, Mapping):
        return ",".join(f"{k}={'true' if v else 'false'}" for k, v in feature_gates.items())
    for gate in feature_gates:
        if not re.fullmatch(r"[A-Za-z0-9]+=(true|false)", gate):
            raise NvidiaPluginError(f"feature gate {gate!r}: not Name=true or Name=false")
    return ",".join(feature_gates)


def prepare_node(profile: str | Path, root: Path) -> SimulatedNode:
    """The simulated node under `root` (device nodes: root), leaving this process's environment as
    it was (prepare_simulated_node points the caller's NVML at the node; here nothing loads NVML,
    and other programs the caller starts must not inherit that)."""
    saved = {k: os.environ.get(k) for k in (DEV_DIR_ENV, PROC_DIR_ENV)}
    try:
        return prepare_simulated_node(profile, root)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class NvidiaPlugin:
    """One gpu-kubelet-plugin process on a simulated node."""

    def __init__(
        self,
        node: SimulatedNode,
        kubeconfig: str | Path,
        node_name: str,
        plugins_dir: Path,
        registry_dir: Path,
        cdi_dir: Path,
        feature_gates: Sequence[str] | Mapping[str, bool] = (),
        extra_args: Sequence[str] = (),
        log_path: Path | None = None,
        image_name: str = DEFAULT_IMAGE,
        verbosity: int = 4,
        binary: Path | None = None,
        hook: Path | None = None,
    ) -> None:
        self.node = node
        self.kubeconfig = Path(kubeconfig)
        self.node_name = node_name
        self.plugins_dir = Path(plugins_dir)  # its own dir is <this>/gpu.nvidia.com (checkpoint, locks)
        self.registry_dir = Path(registry_dir)
        self.cdi_dir = Path(cdi_dir)
        self.gates = gates_flag(feature_gates)
        self.extra_args = list(extra_args)
        self.log_path = Path(log_path) if log_path else node.dev_root / "nvidia-plugin.log"
        self.image_name = image_name
        self.verbosity = verbosity
        self.binary = binary or plugin_binary()
        self.hook = hook or cdi_hook()
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @classmethod
    def on_profile(
        cls,
        profile: str | Path,
        root: Path,
        kubeconfig: str | Path,
        node_name: str,
        plugins_dir: Path,
        registry_dir: Path,
        cdi_dir: Path,
        **kwargs: Any,
    ) -> NvidiaPlugin:
        """The plugin on a node of `profile` prepared under `root` (a built-in name or a file)."""
        node = prepare_node(profile, Path(root))
        return cls(node, kubeconfig, node_name, plugins_dir, registry_dir, cdi_dir, **kwargs)

    @property
    def driver_dir(self) -> Path:
        """The plugin's own directory: checkpoint.json, its locks, its DRA socket."""
        return self.plugins_dir / DRIVER_NAME

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        node = self.node
        env = dict(os.environ if base is None else base)
        env.update(node.env())  # DRA_GPU_SIM_DEV_DIR, DRA_GPU_SIM_PROC_DIR
        env["NVIDIA_DRA_SYSFS_ROOT"] = str(node.sys_dir)
        env["ALT_PROC_DEVICES_PATH"] = str(node.proc_dir / "devices")
        return env

    def argv(self) -> list[str]:
        root = str(self.node.driver_root_view)
        argv = [
            str(self.binary),
            "--image-name", self.image_name,
            "--node-name", self.node_name,
            "--nvidia-driver-root", root,
            "--container-driver-root", root,
            "--host-root", str(self.node.dev_root),
            "--cdi-root", str(self.cdi_dir),
            "--kubelet-plugins-directory-path", str(self.plugins_dir),
            "--kubelet-registrar-directory-path", str(self.registry_dir),
            "--nvidia-cdi-hook-path", str(self.hook),
            "--kubeconfig", str(self.kubeconfig),
            "-v", str(self.verbosity),
        ]  # fmt: skip
        if self.gates:
            argv += ["--feature-gates", self.gates]
        return argv + self.extra_args

    def start(self) -> None:
        if self.running:
            raise NvidiaPluginError(f"NVIDIA's plugin for node {self.node_name}: already running")
        for d in (self.plugins_dir, self.registry_dir, self.cdi_dir, self.log_path.parent):
            d.mkdir(parents=True, exist_ok=True)  # the registrar socket's directory must exist
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed by stop()
        try:
            # Its own session: stop() can end what it started (nvidia-smi, MPS daemons) with it.
            self.proc = subprocess.Popen(
                self.argv(),
                env=self.env(),
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError:
            self._log.close()
            self._log = None
            raise

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def stop(self, term_wait: float = TERM_WAIT, kill_wait: float = KILL_WAIT) -> int | None:
        """SIGTERM, then SIGKILL to its process group after `term_wait` s; its exit status (None if
        it outlived the SIGKILL wait too, or never started)."""
        proc = self.proc
        try:
            if proc is None:
                return None
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(term_wait)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):  # gone meanwhile
                        os.killpg(proc.pid, signal.SIGKILL)
                    try:
                        proc.wait(kill_wait)
                    except subprocess.TimeoutExpired:
                        return None
            return proc.returncode
        finally:
            if self._log is not None:
                self._log.close()
                self._log = None

    def __enter__(self) -> NvidiaPlugin:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def shell_line(env: Mapping[str, str], argv: Sequence[str]) -> str:
    """The command as a shell line, with the environment it needs beyond the caller's."""
    keys = ("NVIDIA_DRA_SYSFS_ROOT", "ALT_PROC_DEVICES_PATH", DEV_DIR_ENV, PROC_DIR_ENV)
    return " ".join([*(f"{k}={shlex.quote(env[k])}" for k in keys), *map(shlex.quote, argv)])


def main(args: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True, help="a built-in simulated node profile or a file")
    ap.add_argument("--root", type=Path, required=True, help="the node's root (made if missing)")
    ap.add_argument("--kubeconfig", required=True)
    ap.add_argument("--node-name", required=True)
    ap.add_argument("--feature-gates", default="", help="Name=true,...")
    ap.add_argument("--print", action="store_true", help="print the environment and command only")
    ap.add_argument("extra", nargs="*", help="more flags for the plugin (after --)")
    ns = ap.parse_args(args)
    root = ns.root.resolve()
    try:
        plugin = NvidiaPlugin.on_profile(
            ns.profile,
            root / "node",
            ns.kubeconfig,
            ns.node_name,
            root / "plugins",
            root / "plugins_registry",
            root / "cdi",
            feature_gates=[g for g in ns.feature_gates.split(",") if g],
            extra_args=ns.extra,
            log_path=root / "nvidia-plugin.log",
        )
    except NvidiaPluginError as exc:
        print(f"nvidia_plugin: {exc}", file=sys.stderr)
        return 2
    if ns.print:
        print(shell_line(plugin.env(), plugin.argv()))
        return 0
    plugin.start()
    assert plugin.proc is not None
    print(f"NVIDIA's plugin: pid {plugin.proc.pid}, log {plugin.log_path}", file=sys.stderr)
    try:
        return plugin.proc.wait()
    except KeyboardInterrupt:
        return plugin.stop() or 0
    finally:
        plugin.stop()


if __name__ == "__main__":
    sys.exit(main())
