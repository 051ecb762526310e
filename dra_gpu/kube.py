"""The few Kubernetes API calls the driver makes, on the official async client (kubernetes.aio).

Objects are plain JSON dicts: the driver builds and compares raw API objects, and skipping the
client's model classes keeps the prepare path short. Every call has a timeout.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from typing import Any

from kubernetes.aio import client as kclient
from kubernetes.aio import config as kconfig

REQUEST_TIMEOUT = 10.0


class KubeError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


async def _json(resp: Any, what: str) -> dict[str, Any]:
    try:
        body = await resp.read()
    finally:
        resp.release()
    if resp.status >= 400:
        try:
            message = json.loads(body).get("message", body.decode(errors="replace"))
        except ValueError:
            message = body.decode(errors="replace")
        raise KubeError(resp.status, f"{what}: {message}")
    data: dict[str, Any] = json.loads(body)
    return data


class Kube:
    """An API connection: from a kubeconfig file, or in-cluster when none is given."""

    def __init__(self, api_client: Any) -> None:
        self.api_client = api_client
        self.resource = kclient.ResourceV1Api(api_client)

    @classmethod
    async def connect(cls, kubeconfig: str | None = None) -> Kube:
        configuration = kclient.Configuration()
        if kubeconfig or os.environ.get("KUBECONFIG"):
            await kconfig.load_kube_config(config_file=kubeconfig or os.environ["KUBECONFIG"],
                                           client_configuration=configuration)  # type: ignore[no-untyped-call]
        else:
            kconfig.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        return cls(kclient.ApiClient(configuration))

    async def close(self) -> None:
        await self.api_client.close()

    async def get_claim(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The ResourceClaim, or None when it does not exist."""
        resp = await self.resource.read_namespaced_resource_claim_without_preload_content(
            name, namespace, _request_timeout=REQUEST_TIMEOUT)
        if resp.status == 404:
            resp.release()
            return None
        return await _json(resp, f"get resourceclaim {namespace}/{name}")

    async def apply_slice(self, body: dict[str, Any], field_manager: str) -> dict[str, Any]:
        """Server-side apply of a ResourceSlice; returns what the apiserver stored."""
        resp = await self.resource.patch_resource_slice_without_preload_content(
            body["metadata"]["name"], body, field_manager=field_manager, force=True,
            _content_type="application/apply-patch+yaml", _request_timeout=REQUEST_TIMEOUT)
        return await _json(resp, f"apply resourceslice {body['metadata']['name']}")

    async def delete_slice(self, name: str) -> None:
        resp = await self.resource.delete_resource_slice_without_preload_content(
            name, _request_timeout=REQUEST_TIMEOUT)
        if resp.status == 404:
            resp.release()
            return
        await _json(resp, f"delete resourceslice {name}")

    async def list_slices(self, field_selector: str) -> tuple[list[dict[str, Any]], str]:
        resp = await self.resource.list_resource_slice_without_preload_content(
            field_selector=field_selector, _request_timeout=REQUEST_TIMEOUT)
        data = await _json(resp, "list resourceslices")
        return list(data.get("items") or []), str(data["metadata"].get("resourceVersion", ""))

    async def watch_slices(self, field_selector: str, resource_version: str,
                           timeout_seconds: int) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """Watch events (type, object) until the server closes the watch after `timeout_seconds`."""
        resp = await self.resource.list_resource_slice_without_preload_content(
            field_selector=field_selector, resource_version=resource_version, watch=True,
            allow_watch_bookmarks=True, timeout_seconds=timeout_seconds,
            _request_timeout=timeout_seconds + REQUEST_TIMEOUT)
        if resp.status >= 400:
            await _json(resp, "watch resourceslices")
        try:
            async for line in resp.content:
                if line.strip():
                    event = json.loads(line)
                    yield event["type"], event["object"]
        finally:
            resp.release()
