"""The claim the kubelet names, read for the driver (Go: the helper's claim lookup before
PrepareResourceClaims): from a watch's cache when it vouches for the claim, else from the
apiserver, and refused unless its UID is the kubelet's (a claim deleted and created again under
the same name is another claim). The driver is handed the claim it can trust.
"""

from __future__ import annotations

from typing import Any, Protocol

from dra_gpu.kubeletplugin.driver import ClaimError, ClaimRef


class ClaimGetter(Protocol):
    """The apiserver's ResourceClaims (dra_gpu.kube.api.Kube)."""

    async def get_claim(self, namespace: str, name: str) -> dict[str, Any] | None: ...


class ClaimLookup(Protocol):
    """Claims kept current by a watch; None means: ask the apiserver."""

    def lookup(self, ref: ClaimRef) -> dict[str, Any] | None: ...


class ClaimFetcher:
    def __init__(self, api: ClaimGetter, cache: ClaimLookup | None = None) -> None:
        self.api = api
        self.cache = cache

    async def fetch(self, ref: ClaimRef) -> dict[str, Any]:
        """The claim; ClaimError when it is gone or was replaced (another UID)."""
        claim = self.cache.lookup(ref) if self.cache is not None else None
        if claim is None:
            claim = await self.api.get_claim(ref.namespace, ref.name)
        if claim is None:
            raise ClaimError(f"ResourceClaim {ref.namespace}/{ref.name} not found")
        uid = (claim.get("metadata") or {}).get("uid")
        if uid != ref.uid:
            raise ClaimError(
                f"ResourceClaim {ref.namespace}/{ref.name} got replaced: "
                f"uid is {uid}, the kubelet asked for {ref.uid}"
            )
        return claim
