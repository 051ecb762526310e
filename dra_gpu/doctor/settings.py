"""Where doctor looks: the same paths and names the kubelet plugin was started with.

Defined here from the command-line flags (not imported from the plugin) so that doctor checks a
node exactly as the plugin was configured, real or simulated, without depending on its internals.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DEFAULT_NODE_SELECTOR = "nvidia.com/gpu.present=true"  # the chart's DaemonSet nodeSelector
DEFAULT_CONTAINERD_CONFIG = "/etc/containerd/config.toml"


def default_plugin_dir(driver: str) -> Path:
    return Path(f"/var/lib/kubelet/plugins/{driver}")


def mig_class_name(driver: str) -> str:
    """The chart's MIG DeviceClass: gpu.dra-gpu.io -> mig.dra-gpu.io (as in _helpers.tpl)."""
    return "mig." + (driver.removeprefix("gpu.") if driver.startswith("gpu.") else driver)


@dataclass(frozen=True)
class NodeSettings:
    node_name: str
    driver: str
    profile: str | None  # a simulated node (its simulated driver's NVML)
    plugin_dir: Path
    registry_dir: Path
    cdi_dir: Path
    dev_root: Path  # root of dev/ and proc/: "/" on a real node
    driver_root: Path | None  # the driver's user-space files; None: "/" (simulated: its own)
    containerd_config: Path
    timeout: float = 3.0  # seconds for each call to the plugin's sockets

    @property
    def dra_socket(self) -> Path:
        return self.plugin_dir / "dra.sock"

    @property
    def registration_socket(self) -> Path:
        return self.registry_dir / f"{self.driver}-reg.sock"

    @property
    def checkpoint(self) -> Path:
        return self.plugin_dir / "checkpoint.json"


@dataclass(frozen=True)
class ClusterSettings:
    kubeconfig: str | None  # None: in-cluster
    driver: str
    node_selector: str = DEFAULT_NODE_SELECTOR
    namespace: str | None = None  # Pending pods of this namespace only; None: all
    webhook_url: str | None = None  # overrides the ValidatingWebhookConfiguration's address
    timeout: float = 10.0  # seconds for each API or network call
    cert_warn_days: int = 30

    @property
    def class_names(self) -> tuple[str, str]:
        return (self.driver, mig_class_name(self.driver))
