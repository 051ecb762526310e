"""The plugin-registration service the kubelet's plugin watcher calls on the registration socket."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from dra_gpu.kubeletplugin._proto import pluginregistration_v1_pb2 as reg_pb
from dra_gpu.kubeletplugin._proto import pluginregistration_v1_pb2_grpc as reg_grpc

log = logging.getLogger(__name__)

# The kubelet picks the first entry it supports, so v1 comes first (as in the Go library).
SUPPORTED_SERVICES = (
    "v1.DRAPlugin",
    "v1beta1.DRAPlugin",
    "v1.DRAResourceHealth",  # 1.37+ kubelets prefer it
    "v1alpha1.DRAResourceHealth",
)


class RegistrationService(reg_grpc.RegistrationServicer):  # type: ignore[misc]
    def __init__(self, driver_name: str, endpoint: str) -> None:
        self.driver_name = driver_name
        self.endpoint = endpoint
        self.registered = asyncio.Event()

    async def GetInfo(self, request: Any, context: Any) -> Any:
        return reg_pb.PluginInfo(
            type="DRAPlugin",
            name=self.driver_name,
            endpoint=self.endpoint,
            supported_versions=list(SUPPORTED_SERVICES),
        )

    async def NotifyRegistrationStatus(self, request: Any, context: Any) -> Any:
        if request.plugin_registered:
            log.info("registered with the kubelet driver=%s", self.driver_name)
            self.registered.set()
        else:
            log.error("kubelet refused the registration driver=%s error=%r", self.driver_name, request.error)
            self.registered.clear()
        return reg_pb.RegistrationStatusResponse()
