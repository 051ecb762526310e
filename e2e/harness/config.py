"""Settings of the e2e cluster: pinned versions, binaries, the state dir, ports and feature gates.

Everything comes from the environment once, at import (see the table in e2e/README.md).
"""

import os
import socket

E2E_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _versions() -> dict[str, str]:
    """The simple `NAME=value` pins of e2e/versions.sh."""
    out = {}
    with open(os.path.join(E2E_DIR, "node", "versions.sh")) as f:
        for line in f:
            line = line.strip()
            if "=" in line and not line.startswith(("#", "K8S_PKGS")) and "(" not in line:
                k, v = line.split("=", 1)
                out[k] = v
    return out


V = _versions()
CACHE = os.environ.get("DRA_GPU_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "dra-gpu")
STATE = os.path.abspath(os.environ.get("DRA_GPU_E2E_STATE", "/var/lib/dra-gpu-e2e"))

# The Kubernetes release of the control plane and of the kubelet (they differ in a version-skew
# run): $DRA_GPU_KUBE_VERSION / $DRA_GPU_KUBELET_VERSION, else what `up` recorded for the running
# cluster (so that later commands use the same programs), else the pin.
CLUSTER_VERSIONS = os.path.join(STATE, "versions")


def _recorded() -> dict[str, str]:
    try:
        with open(CLUSTER_VERSIONS) as f:
            return dict(line.strip().split("=", 1) for line in f if "=" in line)
    except OSError:
        return {}


_REC = _recorded()
KUBE_VERSION = os.environ.get("DRA_GPU_KUBE_VERSION") or _REC.get("kube") or V["K8S_VERSION"]
KUBELET_VERSION = os.environ.get("DRA_GPU_KUBELET_VERSION") or _REC.get("kubelet") or KUBE_VERSION
# DRA feature gates: "pinned" (the list below; the pinned release's default), "default" (none
# set: the release's own defaults; other releases' default), or "all" (every DRA gate the
# program knows, turned on).
DRA_GATES = (
    os.environ.get("DRA_GPU_E2E_DRA_GATES")
    or _REC.get("gates")
    or ("pinned" if V["K8S_VERSION"] == KUBE_VERSION else "default")
)
BIN_K8S = os.path.join(CACHE, "bin", "kubernetes-" + KUBE_VERSION)
BIN_KUBELET = os.path.join(CACHE, "bin", "kubernetes-" + KUBELET_VERSION)
BIN_ETCD = os.path.join(CACHE, "bin", "etcd-" + V["ETCD_VERSION"])
BIN_CTRD = os.path.join(CACHE, "bin", "containerd-" + V["CONTAINERD_VERSION"])
KUBELET_ROOT = os.path.abspath(os.environ.get("DRA_GPU_E2E_KUBELET_ROOT", "/var/lib/kubelet"))
CDI_DIRS = [d for d in os.environ.get("DRA_GPU_E2E_CDI_DIRS", "/etc/cdi:/var/run/cdi").split(":") if d]
NODE_NAME = os.environ.get("DRA_GPU_E2E_NODE_NAME") or socket.gethostname().split(".")[0].lower()
APISERVER_PORT = int(os.environ.get("DRA_GPU_E2E_APISERVER_PORT", "6443"))
ETCD_PORT = int(os.environ.get("DRA_GPU_E2E_ETCD_PORT", "23790"))
# kube-scheduler's secure port (/healthz); another control plane beside this one sets its own.
SCHEDULER_PORT = int(os.environ.get("DRA_GPU_E2E_SCHEDULER_PORT", "10259"))
POD_CIDR = os.environ.get("DRA_GPU_E2E_POD_CIDR", "10.88.0.0/16")
SERVICE_CIDR = os.environ.get("DRA_GPU_E2E_SERVICE_CIDR", "10.96.0.0/16")
BRIDGE = os.environ.get("DRA_GPU_E2E_BRIDGE", "dragpu0")
CNI_BIN = os.environ.get("DRA_GPU_E2E_CNI_BIN", "/usr/lib/cni")
TIMEOUT = float(os.environ.get("DRA_GPU_E2E_TIMEOUT", "120"))
PAUSE_IMAGE = os.environ.get("E2E_PAUSE_IMAGE", "registry.k8s.io/pause:3.10.1")
BUSYBOX_IMAGE = os.environ.get("E2E_BUSYBOX_IMAGE", "localhost/dra-gpu-e2e/busybox:1")

# DRA gates of 1.37 that are beta (or GA but still settable); all default on in 1.37 except
# DRADeviceTaintRules' API. Listing them keeps the cluster honest if defaults move.
DEFAULT_GATES = ",".join(
    g + "=true"
    for g in (
        "DRAPartitionableDevices",
        "DRADeviceTaints",
        "DRADeviceTaintRules",
        "DRAConsumableCapacity",
        "DRAExtendedResource",
        "DRADeviceBindingConditions",
        "DRAResourceClaimDeviceStatus",
        "DRAAdminAccess",
        "DRAPrioritizedList",
        "DRASchedulerFilterTimeout",
        "ResourceHealthStatus",
        "DRAFractionalCapacityRange",
    )
)
# Gates that are DRA's though their names do not say so.
_DRA_GATE_NAMES = ("DynamicResourceAllocation", "ResourceHealthStatus")
# DRA gates of workload scheduling, not devices: DRAWorkloadResourceClaims needs GenericWorkload
# (the apiserver refuses to start with it alone, 1.36 and 1.37).
_NOT_DEVICE_GATES = ("DRAWorkloadResourceClaims",)


def feature_gates(binary: str) -> str:
    """The --feature-gates value for one program: $DRA_GPU_E2E_FEATURE_GATES when set, else as
    DRA_GATES says; "all" reads the gates from the program's own --help (a gate it does not
    know would stop it)."""
    if "DRA_GPU_E2E_FEATURE_GATES" in os.environ:
        return os.environ["DRA_GPU_E2E_FEATURE_GATES"]
    if DRA_GATES == "pinned":
        return DEFAULT_GATES
    if DRA_GATES == "default":
        return ""
    if DRA_GATES != "all":
        raise ValueError(f"DRA gates {DRA_GATES!r}: one of pinned, default, all")
    import re
    import subprocess

    text = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=60).stdout
    known = re.findall(r"^\s+(?:kube:)?(\w+)=true\|false \((ALPHA|BETA)", text, re.MULTILINE)
    gates = sorted(
        {g for g, _ in known if (g.startswith("DRA") or g in _DRA_GATE_NAMES) and g not in _NOT_DEVICE_GATES}
    )
    return ",".join(g + "=true" for g in gates)


def _runtime_config() -> str:
    """$DRA_GPU_E2E_RUNTIME_CONFIG, else, with all DRA gates on, the API version that serves
    DeviceTaintRules before v1 did (1.34/1.35 v1alpha3, 1.36 v1beta2): with DRADeviceTaints on, the
    scheduler and the controller-manager wait for that API, and schedule nothing without it."""
    if "DRA_GPU_E2E_RUNTIME_CONFIG" in os.environ:
        return os.environ["DRA_GPU_E2E_RUNTIME_CONFIG"]
    if DRA_GATES != "all":
        return ""
    minor = int(KUBE_VERSION.lstrip("v").split(".")[1])
    return {34: "resource.k8s.io/v1alpha3=true", 35: "resource.k8s.io/v1alpha3=true"}.get(
        minor, "resource.k8s.io/v1beta2=true" if minor == 36 else ""
    )


RUNTIME_CONFIG = _runtime_config()

PKI = os.path.join(STATE, "pki")
LOGS = os.path.join(STATE, "logs")
PIDS = os.path.join(STATE, "pids")
ADMIN_KUBECONFIG = os.path.join(STATE, "admin.kubeconfig")
CTRD_SOCK = os.path.join(STATE, "containerd", "containerd.sock")

# This project's driver: the name its plugin dir and CDI specs on the node carry.
DRIVER_NAME = "gpu.dra-gpu.io"

# The peer driver: upstream's DRA test driver as a host-process kubelet plugin.
PLUGIN_NAME = os.environ.get("DRA_GPU_E2E_PEER_DRIVER_NAME", "gpu.example.com")
PEER_CDI_DIR = os.environ.get("DRA_GPU_E2E_PEER_CDI_DIR", "/var/run/cdi")

# The cluster's programs (as `status` lists them); `up` starts them all, `down` stops them.
ORDER = [
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "containerd",
    "kubelet",
]
