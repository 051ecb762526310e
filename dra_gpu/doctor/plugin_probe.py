"""Ask the kubelet plugin's two sockets what the kubelet asks them, without its generated code.

The registration socket's GetInfo answer and an empty NodePrepareResources call are enough to
know the plugin is up and answering for the right driver; the messages are decoded here by hand
(only string fields are needed) so doctor does not depend on where the plugin's stubs live.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import grpc

GET_INFO = "/pluginregistration.Registration/GetInfo"
DRA_V1_PREPARE = "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources"
MAX_MESSAGE = 1024 * 1024


class ProbeError(Exception):
    """The socket did not answer (the words say how)."""


@dataclass
class PluginInfo:
    type: str = ""
    name: str = ""
    endpoint: str = ""
    supported_versions: list[str] = field(default_factory=list)


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(data) or shift > 63:
            raise ProbeError("malformed protobuf message")
        b = data[i]
        i += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, i


def decode_plugin_info(data: bytes) -> PluginInfo:
    """pluginregistration.PluginInfo: type=1, name=2, endpoint=3, supported_versions=4 (strings)."""
    if len(data) > MAX_MESSAGE:
        raise ProbeError("PluginInfo larger than 1 MiB")
    info = PluginInfo()
    i = 0
    while i < len(data):
        key, i = _varint(data, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            _, i = _varint(data, i)
            continue
        if wire == 1:
            i += 8
            continue
        if wire == 5:
            i += 4
            continue
        if wire != 2:
            raise ProbeError(f"unexpected wire type {wire} in PluginInfo")
        length, i = _varint(data, i)
        if i + length > len(data):
            raise ProbeError("truncated PluginInfo")
        text = data[i : i + length].decode("utf-8", errors="replace")
        i += length
        if number == 1:
            info.type = text
        elif number == 2:
            info.name = text
        elif number == 3:
            info.endpoint = text
        elif number == 4:
            info.supported_versions.append(text)
    return info


def _call(socket: Path, method: str, timeout: float) -> bytes:
    try:
        with grpc.insecure_channel(f"unix://{socket}") as channel:
            answer: bytes = channel.unary_unary(method)(b"", timeout=timeout)
            return answer
    except grpc.RpcError as exc:
        code = exc.code().name if hasattr(exc, "code") else "ERROR"
        details = exc.details() if hasattr(exc, "details") else str(exc)
        raise ProbeError(f"{code}: {details}") from exc


def get_info(registration_socket: Path, timeout: float) -> PluginInfo:
    return decode_plugin_info(_call(registration_socket, GET_INFO, timeout))


def prepare_nothing(dra_socket: Path, timeout: float) -> None:
    """An empty NodePrepareResources (no claims): answers only when the DRA service is up."""
    _call(dra_socket, DRA_V1_PREPARE, timeout)
