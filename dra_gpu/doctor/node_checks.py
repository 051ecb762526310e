"""The node's answers to the classic questions: is the driver loaded and complete, are the device
nodes there, will containerd find the CDI specs, is the plugin up and registered, do the prepared
claims still have their devices.

Each check takes the node's settings (and what discovery found) and returns its results; a check
that needs something missing (no NVML, no checkpoint) is skipped with the reason.
"""

from __future__ import annotations

import functools
import json
import os
import re
import stat
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from dra_gpu.discovery import NvmlUnavailableError
from dra_gpu.discovery.driver_install import discover_installation
from dra_gpu.discovery.driver_versions import (
    KERNEL_VERSION_FILE,
    DriverVersionMismatchError,
    kernel_module_version,
)
from dra_gpu.discovery.kernel_devices import CAPS, UVM, UVM_HOST_FIX, char_majors, uvm_missing
from dra_gpu.doctor import mps_daemons
from dra_gpu.doctor.cdi_hook_check import check_cdi_hook
from dra_gpu.doctor.containerd_config import ContainerdConfigError, read_containerd_cdi, same_directory
from dra_gpu.doctor.driver_upgrade import driver_upgrade_results
from dra_gpu.doctor.plugin_probe import ProbeError, get_info, prepare_nothing
from dra_gpu.doctor.report import Result, fail, guarded, ok, skip, warn
from dra_gpu.doctor.settings import NodeCheckSettings
from dra_gpu.model.inventory import Inventory
from dra_gpu.node.backend import open_backend
from dra_gpu.node.profiles import NodePreparationError

NVIDIA_MAJOR = 195  # /dev/nvidia<minor> and /dev/nvidiactl; uvm and caps majors are dynamic
CONTROL_NODES = ("dev/nvidiactl", "dev/nvidia-uvm", "dev/nvidia-uvm-tools")
_CAP_MINOR = re.compile(r"DeviceFileMinor:\s*(\d+)")


def node_inventory(settings: NodeCheckSettings) -> tuple[Inventory, Path]:
    """The node's GPUs through its backend (the driver root's NVML) and that driver root.

    A simulated node's NVML is opened over device nodes of this run only (the profile's boot
    state): doctor looks at the nodes and files the plugin made under --dev-root, never makes them."""
    with tempfile.TemporaryDirectory(prefix="dra-gpu-doctor-") as scratch:
        dev_root = Path(scratch) if settings.profile else settings.dev_root
        backend = open_backend(settings.profile, settings.driver_root, dev_root, settings.cache_dir)
        return backend.discover(settings.node_name), backend.driver_root


class NodeFacts:
    """What discovery found once, shared by the checks (None and the reason when it failed)."""

    def __init__(self, settings: NodeCheckSettings) -> None:
        self.settings = settings
        self.inventory: Inventory | None = None
        self.driver_root = settings.driver_root or Path("/")
        self.problem = ""  # why there is no inventory
        self.no_nvml = False  # NVML could not be loaded at all: not a GPU node (or no driver)
        self.mismatch: DriverVersionMismatchError | None = None  # NVML refused the kernel module
        try:
            self.inventory, self.driver_root = node_inventory(settings)
        except DriverVersionMismatchError as exc:
            self.problem, self.mismatch = exc.problem, exc
        except NvmlUnavailableError as exc:
            self.problem, self.no_nvml = str(exc), True
        except NodePreparationError as exc:
            self.problem = str(exc)

    @property
    def simulated(self) -> bool:
        return self.settings.profile is not None

    def kernel_version(self) -> str | None:
        """The loaded kernel module's version from /proc (None when the file is absent)."""
        return kernel_module_version(self.settings.dev_root)

    def driver_present(self) -> bool:
        """Traces of an NVIDIA driver although NVML failed: a broken driver, not a non-GPU node."""
        root = self.settings.dev_root
        return (root / KERNEL_VERSION_FILE).exists() or (root / "dev/nvidiactl").exists()


# ---------------------------------------------------------------- NVML and the driver


def check_nvml(facts: NodeFacts) -> Iterable[Result]:
    name = "node/nvml"
    inv = facts.inventory
    if facts.mismatch is not None:
        yield fail(name, facts.problem, facts.mismatch.fix)
        return
    if inv is None:
        if facts.no_nvml and not facts.driver_present():
            yield skip(
                name, f"no NVML: {facts.problem} (not a GPU node? --profile NAME checks a simulated one)"
            )
        else:
            yield fail(
                name,
                facts.problem,
                "reload the driver (`nvidia-smi` on the host must work); "
                "`dmesg | grep -i nvrm` says why it fails"
                if facts.no_nvml
                else "fix --profile",
            )
        return
    where = f"simulated profile {facts.settings.profile}" if facts.simulated else "NVML"
    migs = sum(len(g.mig_devices) for g in inv.gpus)
    cuda = (
        f", CUDA {inv.cuda_driver_version // 1000}.{inv.cuda_driver_version % 1000 // 10}"
        if inv.cuda_driver_version
        else ""
    )
    yield ok(name, f"{len(inv.gpus)} GPUs, {migs} MIG devices, driver {inv.driver_version}{cuda} ({where})")
    if inv.skipped:
        yield warn(name, "GPUs left out: " + "; ".join(inv.skipped), "see `nvidia-smi -q` for these GPUs")


def check_driver(facts: NodeFacts) -> Iterable[Result]:
    name = "node/driver"
    inv = facts.inventory
    if facts.mismatch is not None:
        m = facts.mismatch
        yield fail(
            name,
            f"kernel module {m.kernel_version} but the driver libraries (libnvidia-ml) under "
            f"{facts.driver_root} are {m.library_version}: NVML refuses to initialise",
            m.fix,
        )
        return
    if inv is None:
        yield skip(name, "no NVML answer to compare with")
        return
    kernel = facts.kernel_version()
    if kernel is None:
        if facts.simulated:
            yield ok(name, f"driver {inv.driver_version} (simulated: no kernel module)")
        else:
            yield fail(
                name,
                f"NVML answers but {facts.settings.dev_root / KERNEL_VERSION_FILE} is missing",
                "is /proc the host's? run doctor on the host or in the plugin's pod",
            )
        return
    if inv.driver_version and kernel != inv.driver_version:
        yield fail(
            name,
            f"kernel module {kernel} but NVML (libnvidia-ml) reports {inv.driver_version}",
            "reboot or reload the driver so that kernel module and libraries are the same version",
        )
        return
    yield ok(name, f"kernel module {kernel} loaded")


def check_driver_files(facts: NodeFacts) -> Iterable[Result]:
    name = "node/driver-files"
    inv = facts.inventory
    if inv is None or not inv.driver_version:
        yield skip(name, "no driver version from NVML")
        return
    root = facts.driver_root
    found = discover_installation(root, inv.driver_version)
    if found.error:
        yield fail(
            name,
            found.error,
            f"install the user-space files of driver {inv.driver_version} under {root} "
            "(same version as the kernel module), or point --driver-root at them",
        )
        return
    detail = (
        f"{len(found.libraries)} libraries, {len(found.binaries)} binaries, "
        f"{len(found.firmware)} firmware files of {inv.driver_version} under {root}"
    )
    if found.other_versions:
        yield warn(
            name,
            f"{detail}; files of other versions left behind: {', '.join(found.other_versions)}",
            "remove the old driver's libraries so no container loads them",
        )
        return
    yield ok(name, detail)


def check_driver_upgrade(facts: NodeFacts) -> Iterable[Result]:
    """Libraries, kernel module and the prepared claims' specs of one driver version (an upgrade's
    states: doctor/driver_upgrade.py)."""
    return driver_upgrade_results(facts.settings, facts.driver_root)


# ---------------------------------------------------------------- device nodes


def _char_device(path: Path) -> tuple[bool, str]:
    """(ok, what is wrong)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False, "missing"
    except OSError as exc:
        return False, exc.strerror or str(exc)
    if not stat.S_ISCHR(st.st_mode):
        return False, "not a character device"
    return True, ""


def _mig_cap_problems(root: Path, minor: int, gi: int, ci: int) -> list[str]:
    """What stops a MIG device's capability nodes from going into a spec (they go by number:
    no host node is needed, only the driver's access files)."""
    caps = root / "proc/driver/nvidia/capabilities" / f"gpu{minor}" / "mig"
    out = []
    for access in (caps / f"gi{gi}" / "access", caps / f"gi{gi}" / f"ci{ci}" / "access"):
        try:
            match = _CAP_MINOR.search(access.read_text())
        except OSError:
            out.append(f"{access.relative_to(root)} (no capability file)")
            continue
        if not match:
            out.append(f"{access.relative_to(root)} (no DeviceFileMinor)")
    return out


def check_device_nodes(facts: NodeFacts) -> Iterable[Result]:
    name = "node/device-nodes"
    inv = facts.inventory
    if inv is None:
        yield skip(name, "no GPUs known (no NVML answer)")
        return
    root = facts.settings.dev_root
    majors = char_majors(root / "proc/devices")
    # The uvm nodes go into the specs by number while the module is loaded (node/nvidia-uvm).
    wanted = [n for n in CONTROL_NODES if "nvidia-uvm" not in n]
    problems = []
    mig = [(gpu, m) for gpu in inv.gpus for m in gpu.mig_devices]
    if mig and CAPS not in majors:
        problems.append(f"no {CAPS} in /proc/devices (MIG capability nodes cannot be given)")
    for gpu in sorted(inv.gpus, key=lambda g: g.minor):
        wanted.append(f"dev/nvidia{gpu.minor}")
        for m in gpu.mig_devices:
            problems.extend(_mig_cap_problems(root, gpu.minor, m.gpu_instance_id, m.compute_instance_id))
    for rel in wanted:
        good, why = _char_device(root / rel)
        if not good:
            problems.append(f"/{rel} {why}")
    if problems:
        fix = (
            f"restart the kubelet plugin: it makes the simulated nodes under {root}"
            if facts.simulated
            else "run `nvidia-modprobe -u -c=<minor>` (or `nvidia-smi` once) as root on the node; "
            "`dmesg | grep -i nvrm` if it fails"
        )
        listed = ", ".join(problems[:6]) + (f" and {len(problems) - 6} more" if len(problems) > 6 else "")
        yield fail(name, f"under {root}: {listed}", fix)
        return
    caps = f", MIG capabilities of {len(mig)} MIG devices (by number)" if mig else ""
    yield ok(name, f"{len(wanted)} device nodes under {root} (GPUs, control nodes){caps}")


def check_nvidia_uvm(facts: NodeFacts) -> Iterable[Result]:
    """CUDA needs /dev/nvidia-uvm; the specs carry it by number, which exists only while the
    nvidia-uvm module is loaded, and no container can load it."""
    name = "node/nvidia-uvm"
    proc = facts.settings.dev_root / "proc/devices"
    why = uvm_missing(proc)
    if why is not None:
        yield fail(name, why, UVM_HOST_FIX)
        return
    major = char_majors(proc)[UVM]
    yield ok(name, f"nvidia-uvm loaded (major {major}): claims get /dev/nvidia-uvm and -uvm-tools by number")


# ---------------------------------------------------------------- CDI and containerd


def check_cdi_dir(facts: NodeFacts) -> Iterable[Result]:
    name = "node/cdi-dir"
    cdi = facts.settings.cdi_dir
    if not cdi.is_dir():
        yield fail(
            name, f"{cdi} does not exist", f"mkdir -p {cdi} (the plugin writes each claim's CDI spec there)"
        )
    elif not os.access(cdi, os.W_OK | os.X_OK):
        yield fail(
            name, f"{cdi} is not writable by uid {os.getuid()}", f"make {cdi} writable by the plugin (root)"
        )
    else:
        yield ok(name, f"{cdi} exists and is writable")


def check_containerd_cdi(facts: NodeFacts) -> Iterable[Result]:
    name = "node/containerd-cdi"
    path = facts.settings.containerd_config
    if not path.exists():
        yield skip(
            name,
            f"no containerd config at {path} (not containerd, or its defaults: CDI on in 2.x with "
            "/etc/cdi and /var/run/cdi); --containerd-config PATH names another",
        )
        return
    try:
        cfg = read_containerd_cdi(path)
    except ContainerdConfigError as exc:
        yield fail(name, str(exc), "fix the file; containerd does not start with an invalid config")
        return
    section = (
        "plugins.'io.containerd.cri.v1.runtime'"
        if cfg.version >= 3
        else "plugins.'io.containerd.grpc.v1.cri'"
    )
    if cfg.enabled is False or cfg.enabled is None:
        state = "off" if cfg.enabled is False else "not set (off in containerd 1.7)"
        yield fail(
            name,
            f"enable_cdi is {state} in {path}: containers get no GPU from a claim",
            f"set enable_cdi = true under [{section}] and restart containerd",
        )
        return
    plugin_dir = facts.settings.cdi_dir
    dirs = ", ".join(cfg.spec_dirs) + (" (defaults)" if cfg.spec_dirs_default else "")
    if not any(same_directory(d, plugin_dir) for d in cfg.spec_dirs):
        yield fail(
            name,
            f"containerd reads CDI specs from {dirs}, not from {plugin_dir} where the plugin writes them",
            f"add '{plugin_dir}' to cdi_spec_dirs under [{section}] and restart containerd, "
            "or start the plugin with --cdi-dir set to one of those",
        )
        return
    yield ok(name, f"CDI on, spec dirs {dirs} include {plugin_dir} ({path})")


# ---------------------------------------------------------------- the plugin


def check_plugin_registration(facts: NodeFacts) -> Iterable[Result]:
    name = "node/plugin-registration"
    s = facts.settings
    sock = s.registration_socket
    start = (
        f"start the kubelet plugin (DaemonSet pod on {s.node_name}; "
        "`kubectl -n <ns> logs` says why it is down)"
    )
    if not sock.exists():
        yield fail(name, f"no registration socket {sock}: the kubelet does not know the plugin", start)
        return
    try:
        info = get_info(sock, s.timeout)
    except ProbeError as exc:
        yield fail(name, f"{sock} does not answer GetInfo ({exc}): a stale socket of a stopped plugin", start)
        return
    if info.name != s.driver or info.type != "DRAPlugin":
        yield fail(
            name,
            f"{sock} answers for {info.type} {info.name!r}, not DRAPlugin {s.driver!r}",
            "run the plugin with the same --driver-name as the DeviceClasses",
        )
        return
    if not same_directory(info.endpoint, s.dra_socket):
        yield warn(
            name,
            f"registered endpoint {info.endpoint} is not {s.dra_socket}",
            "pass doctor the plugin's --plugin-dir",
        )
        return
    yield ok(name, f"{sock} answers: {info.type} {info.name}, services {', '.join(info.supported_versions)}")


def check_plugin_service(facts: NodeFacts) -> Iterable[Result]:
    name = "node/plugin-service"
    s = facts.settings
    if not s.dra_socket.exists():
        yield fail(
            name,
            f"no DRA socket {s.dra_socket}: the kubelet cannot prepare claims (pods stay ContainerCreating)",
            f"start the kubelet plugin on {s.node_name}",
        )
        return
    try:
        prepare_nothing(s.dra_socket, s.timeout)
    except ProbeError as exc:
        yield fail(
            name,
            f"{s.dra_socket} does not answer NodePrepareResources ({exc})",
            f"restart the kubelet plugin on {s.node_name}",
        )
        return
    yield ok(name, f"{s.dra_socket} answers NodePrepareResources")


def _checkpoint_claims(path: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    claims = (doc.get("data") or {}).get("claims") if isinstance(doc, dict) else None
    if not isinstance(claims, dict):
        raise ValueError(f"{path}: no claims map")
    return claims


def check_prepared_claims(facts: NodeFacts) -> Iterable[Result]:
    """Every prepared claim still has its CDI spec and its devices (MIG instances included)."""
    name = "node/prepared-claims"
    s = facts.settings
    try:
        claims = _checkpoint_claims(s.checkpoint)
    except ValueError as exc:
        yield warn(
            name,
            f"checkpoint unreadable: {exc}",
            "restart the plugin: it moves a corrupt checkpoint aside and rebuilds it from the CDI specs "
            "and the claims allocated to this node",
        )
        return
    if claims is None:
        yield skip(name, f"no checkpoint at {s.checkpoint} (the plugin never ran here)")
        return
    known: set[str] = set()
    if facts.inventory is not None:
        for gpu in facts.inventory.gpus:
            known.add(gpu.device_name)
            known.update(gpu.mig_device_name(m) for m in gpu.mig_devices)
            # Dynamic MIG devices: every placement NVML offers (made at prepare).
            known.update(gpu.mig_name(p.profile.name, p.start) for p in gpu.mig_placements())
    problems = []
    for uid, entry in sorted(claims.items()):
        ref = f"{entry.get('namespace', '?')}/{entry.get('name', '?')}"
        if entry.get("state") != "completed":
            problems.append(f"claim {ref}: prepare did not finish (state {entry.get('state')!r})")
            continue
        spec = s.cdi_dir / f"k8s.{s.driver}-claim_{uid}.json"
        if not spec.exists():
            problems.append(f"claim {ref}: CDI spec {spec} missing")
        if facts.inventory is not None:
            gone = [
                str(d.get("deviceName"))
                for d in entry.get("devices") or []
                if isinstance(d, dict) and d.get("deviceName") not in known
            ]
            if gone:
                problems.append(f"claim {ref}: devices no longer on the node: {', '.join(gone)}")
    if problems:
        yield fail(
            name,
            "; ".join(problems),
            "restart the plugin (it rewrites missing specs); for a lost GPU or MIG instance delete the pod "
            "so its claim is allocated again",
        )
        return
    yield ok(name, f"{len(claims)} prepared claims, each with its CDI spec and devices")


def check_mps(facts: NodeFacts) -> Iterable[Result]:
    """The MPS daemons running against those the prepared claims record (mps_daemons)."""
    s = facts.settings
    try:
        claims = _checkpoint_claims(s.checkpoint) or {}
    except ValueError as exc:
        yield skip(mps_daemons.NAME, f"checkpoint unreadable: {exc} (see node/prepared-claims)")
        return
    version = facts.inventory.driver_version if facts.inventory is not None else None
    yield mps_daemons.check(claims, mps_daemons.node_daemons(s.plugin_dir, facts.driver_root, version))


NODE_CHECKS: tuple[tuple[str, Callable[[NodeFacts], Iterable[Result]]], ...] = (
    ("node/nvml", check_nvml),
    ("node/driver", check_driver),
    ("node/driver-files", check_driver_files),
    ("node/driver-upgrade", check_driver_upgrade),
    ("node/cdi-hook", lambda facts: check_cdi_hook(facts.settings)),
    ("node/device-nodes", check_device_nodes),
    ("node/nvidia-uvm", check_nvidia_uvm),
    ("node/cdi-dir", check_cdi_dir),
    ("node/containerd-cdi", check_containerd_cdi),
    ("node/plugin-registration", check_plugin_registration),
    ("node/plugin-service", check_plugin_service),
    ("node/prepared-claims", check_prepared_claims),
    ("node/mps-daemons", check_mps),
)


def run_node_checks(settings: NodeCheckSettings) -> list[Result]:
    facts = NodeFacts(settings)
    if facts.inventory is None and facts.no_nvml and not facts.driver_present():
        # Said once, not once a check: every node check needs the driver. A failure, not a skip:
        # the node checks were asked for (doctor on a machine that should be a GPU node).
        problem = re.sub(r" \(searched [^)]*\)", "", facts.problem)  # the directories: 10 lines
        first = fail(
            NODE_CHECKS[0][0],
            f"not a GPU node: {problem}",
            "install the NVIDIA driver or point --driver-root at it (the GPU Operator's: "
            "/run/nvidia/driver); run doctor on a GPU node or in the plugin's pod; --profile NAME "
            "checks a simulated node; --only cluster checks only the cluster",
        )
        return [first, skip("node/*", f"the other {len(NODE_CHECKS) - 1} node checks: not run without a GPU")]
    results: list[Result] = []
    for check, fn in NODE_CHECKS:
        results.extend(guarded(check, functools.partial(fn, facts)))
    return results
