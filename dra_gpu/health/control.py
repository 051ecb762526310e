"""The plugin's health control socket (`<plugin-dir>/health.sock`, root only): what
`dra-gpu health status|taint|clear|simulate` talks to.

One JSON object per line each way. `taint` and `clear` are the operator's overrides, on any node
(in a pod: `kubectl exec` into the plugin). `simulate` exists only on a simulated node: it makes
the node's simulated kernel report an XID, an ECC error, a lost GPU, a recovery action or the
recovery (`simnode.inject`, into the node's device-node directory), which the plugin's
monitor then receives through NVML (`nvmlEventSetWait_v2`, `GPU_IS_LOST`, the recovery-action
field) exactly as on a real node.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
from pathlib import Path
from typing import Any

import pynvml

from dra_gpu.health.classification import Effect
from dra_gpu.health.manager import RECOVERY_ACTIONS, HealthManager
from dra_gpu.health.monitor import NO_ID
from dra_gpu.model.inventory import Gpu
from dra_gpu.node.catalog import DeviceCatalog, MadeInstances
from dra_gpu.node.profiles import NodeEvents

log = logging.getLogger(__name__)

SOCKET_NAME = "health.sock"
EFFECTS = {"NoSchedule": Effect.NO_SCHEDULE, "NoExecute": Effect.NO_EXECUTE}
SIMULATED_EVENTS = ("xid", "ecc", "lose", "recover", "recovery-action")
LOST_XIDS = frozenset({79})  # the GPU fell off the bus: NVML loses it too
RESET_XIDS = frozenset({48, 64, 74, 95, 119, 120, 140})  # need a GPU reset (catalog)


class ControlError(ValueError):
    """A request the plugin refuses; the message names the field."""


def _find_gpu(catalog: DeviceCatalog, target: str, made: MadeInstances) -> tuple[Gpu, int, int]:
    """(GPU, gi, ci) for a GPU index, UUID or device name, a MIG device's UUID or name, or a
    dynamic-MIG placement's name (its instance's IDs while a claim holds one, else the GPU's)."""
    for gpu in catalog.gpus:
        if target in (str(gpu.index), gpu.uuid, gpu.device_name):
            return gpu, NO_ID, NO_ID
        for mig in gpu.mig_devices:
            if target in (mig.uuid, gpu.mig_device_name(mig)):
                return gpu, mig.gpu_instance_id, mig.compute_instance_id
    device = catalog.get(target)
    if device is not None and device.placement is not None:
        held = [gi for (uuid, gi), name in made.items() if uuid == device.gpu.uuid and name == target]
        return device.gpu, held[0] if held else NO_ID, NO_ID
    known = ", ".join(f"{g.index}={g.device_name}" for g in catalog.gpus)
    raise ControlError(f"gpu: {target!r} is no GPU index, UUID or device name of this node ({known})")


class ControlServer:
    def __init__(self, path: Path, manager: HealthManager, events: NodeEvents | None) -> None:
        self.path = path
        self.manager = manager
        self.events = events  # None on a real node
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.path))
        os.chmod(self.path, 0o600)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(10):
                line = await reader.readline()
            try:
                request = json.loads(line)
                if not isinstance(request, dict):
                    raise ControlError("request: must be a JSON object")
                reply: dict[str, Any] = {"ok": True, **await self.dispatch(request)}
            except (ControlError, KeyError, ValueError) as exc:
                reply = {"ok": False, "error": str(exc).strip('"')}
            except Exception as exc:  # a bug or a failed write: say so, keep serving
                log.exception("health control request failed request=%r", line[:200])
                reply = {"ok": False, "error": f"internal error: {exc!r}"}
            writer.write(json.dumps(reply).encode() + b"\n")
            await writer.drain()
        except (TimeoutError, ConnectionError) as exc:
            log.warning("health control request dropped error=%r", str(exc))
        finally:
            writer.close()

    async def dispatch(self, req: dict[str, Any]) -> dict[str, Any]:
        op = req.get("op")
        if op == "status":
            return {"devices": self.status()}
        if op == "taint":
            effect = EFFECTS.get(str(req.get("effect", "NoSchedule")))
            if effect is None:
                raise ControlError(f"effect: {req.get('effect')!r}; valid: {', '.join(EFFECTS)}")
            await self.manager.force(str(req["device"]), effect, str(req.get("cause") or "operator"))
            return {}
        if op == "clear":
            return {"wasTainted": await self.manager.clear(str(req["device"]))}
        if op == "simulate":
            return self.simulate(req)
        raise ControlError(f"op: {op!r}; valid: status, taint, clear, simulate")

    def status(self) -> list[dict[str, Any]]:
        health = self.manager.health()
        out = []
        for name in self.manager.device_names():
            s = self.manager.book.devices[name]
            healthy, message = health[name]
            out.append(
                {
                    "device": name,
                    "healthy": healthy,
                    "taint": f"{self.manager.taint_key}={s.cause}:{s.effect.api}" if s.tainted else None,
                    "forced": s.forced,
                    "holdDownSeconds": s.hold_down if s.tainted else None,
                    "message": message,
                }
            )
        return out

    def simulate(self, req: dict[str, Any]) -> dict[str, Any]:
        if self.events is None:
            raise ControlError(
                "simulate: this plugin watches real NVML; events can be simulated only "
                "on a simulated node (--profile)"
            )
        event = req.get("event")
        made = self.manager.made_instances() if self.manager.made_instances is not None else {}
        gpu, gi, ci = _find_gpu(self.manager.catalog, str(req.get("gpu", "")), made)
        if req.get("gi") is not None:
            gi, ci = int(req["gi"]), int(req.get("ci", NO_ID) if req.get("ci") is not None else NO_ID)
        kernel, uuid = self.events, gpu.uuid
        if event == "xid":
            xid = int(req["xid"])
            delivered = kernel.inject_event(uuid, pynvml.nvmlEventTypeXidCriticalError, xid, gi, ci)
            if xid in LOST_XIDS:
                kernel.set_recovery_action(uuid, pynvml.NVML_GPU_RECOVERY_ACTION_NODE_REBOOT)
                kernel.set_lost(uuid, True)
            elif xid in RESET_XIDS:
                kernel.set_recovery_action(uuid, pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET)
        elif event == "ecc":
            delivered = kernel.inject_event(uuid, pynvml.nvmlEventTypeDoubleBitEccError, 0, gi, ci)
            kernel.set_recovery_action(uuid, pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET)
        elif event == "lose":
            kernel.set_recovery_action(uuid, pynvml.NVML_GPU_RECOVERY_ACTION_NODE_REBOOT)
            kernel.set_lost(uuid, True)
            delivered = 1
        elif event == "recover":
            kernel.set_lost(uuid, False)
            kernel.set_recovery_action(uuid, pynvml.NVML_GPU_RECOVERY_ACTION_NONE)
            delivered = 1
        elif event == "recovery-action":
            names = {v: k for k, v in RECOVERY_ACTIONS.items()}
            action = names.get(str(req.get("action")))
            if action is None:
                raise ControlError(f"action: {req.get('action')!r}; valid: {', '.join(names)}")
            kernel.set_recovery_action(uuid, action)
            # nvml.h: eventData is 0 for events other than XIDs; the action is read from the field.
            delivered = kernel.inject_event(uuid, pynvml.nvmlEventTypeGpuRecoveryAction, 0)
        else:
            raise ControlError(f"event: {event!r}; valid: {', '.join(SIMULATED_EVENTS)}")
        log.warning("simulated gpu event event=%s gpu=%s request=%s", event, uuid, json.dumps(req))
        return {"gpu": uuid, "device": gpu.device_name, "delivered": delivered}


def request(path: Path, body: dict[str, Any], timeout: float = 10.0) -> dict[str, Any]:
    """One request to a running plugin's control socket (blocking; for the CLI)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(str(path))
        sock.sendall(json.dumps(body).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    reply: dict[str, Any] = json.loads(data)
    return reply
