"""Where doctor looks: the same paths and names the kubelet plugin was started with.

The node's part is the plugin's NodeSettings, resolved from the same flags by the same code, so
doctor checks a node exactly as the plugin was configured, real or simulated, without depending on
the plugin's internals; the node checks add containerd's config and their time limit.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

from dra_gpu.node.settings import NodeSettings

DEFAULT_NODE_SELECTOR = "nvidia.com/gpu.present=true"  # the chart's DaemonSet nodeSelector
DEFAULT_CONTAINERD_CONFIG = "/etc/containerd/config.toml"


def mig_class_name(driver: str) -> str:
    """The chart's MIG DeviceClass: gpu.dra-gpu.io -> mig.dra-gpu.io (as in _helpers.tpl)."""
    return "mig." + (driver.removeprefix("gpu.") if driver.startswith("gpu.") else driver)


@dataclass(frozen=True)
class NodeCheckSettings(NodeSettings):
    """The node's settings and what only the node checks need."""

    containerd_config: Path = Path(DEFAULT_CONTAINERD_CONFIG)
    timeout: float = 3.0  # seconds for each call to the plugin's sockets
    cdi_hook_path: str | None = None  # the plugin's --cdi-hook-path

    @classmethod
    def of(
        cls, node: NodeSettings, containerd_config: Path, timeout: float, cdi_hook_path: str | None = None
    ) -> NodeCheckSettings:
        own = {f.name: getattr(node, f.name) for f in fields(NodeSettings)}
        return cls(**own, containerd_config=containerd_config, timeout=timeout, cdi_hook_path=cdi_hook_path)


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
