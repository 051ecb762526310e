"""How an MPS control daemon's pod is labelled: written by the plugin (dra_gpu.plugin.mps_pods),
read by `dra-gpu top` (dra_gpu.fleet), which shows each daemon with the claim it serves."""

from __future__ import annotations

COMPONENT_LABEL = "app.kubernetes.io/component"
COMPONENT = "mps-control-daemon"
DAEMON_LABEL = "dra-gpu.io/mps-daemon"  # the daemon's id: "<claim uid>-<n>"


def claim_uid_of(daemon_id: str) -> str:
    """The UID of the claim a daemon serves (its id without the daemon's number)."""
    return daemon_id.rsplit("-", 1)[0]
