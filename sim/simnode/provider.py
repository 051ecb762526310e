"""The simulator as dra-gpu's `--profile` (entry point `dra_gpu.node_profiles`, see
`dra_gpu.node.profiles`): a profile's simulated node, handed to the driver as what a real node has."""

from __future__ import annotations

from pathlib import Path

from dra_gpu.node.profiles import NodePreparationError, PreparedNode
from simnode.node import SimulatedNodeError, prepare_simulated_node
from simnode.profiles import BUILTIN_PROFILES, ProfileError


class SimulatedProfiles:
    names = BUILTIN_PROFILES

    def prepare(
        self, profile: str, dev_root: Path, driver_root: Path | None, cache_dir: Path | None
    ) -> PreparedNode:
        try:
            node = prepare_simulated_node(profile, dev_root, driver_root, cache_dir)
        except ProfileError as exc:
            raise NodePreparationError(f"invalid profile {profile!r}: {exc}") from exc
        except SimulatedNodeError as exc:
            raise NodePreparationError(str(exc)) from exc
        return PreparedNode(node.driver_root, node.dev_root, node.events(), node.env())
