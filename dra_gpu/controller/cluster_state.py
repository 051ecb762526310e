"""The webhook's view of the cluster: slices, classes and claims as last listed or watched, and a
Validator over them, rebuilt lazily after a change. Its own module so that the review workers
(review_pool.py) hold the same view without importing the HTTP side.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from dra_gpu.controller.cel import CelEnvironment, Schema
from dra_gpu.controller.rules import Validator


class ChangeListener(Protocol):
    """Gets every change too (the review workers' copies of the view)."""

    def replace(self, store: str, items: list[dict[str, Any]]) -> None: ...

    def apply(self, store: str, event_type: str, obj: dict[str, Any]) -> None: ...


class ClusterState:
    """Slices, classes and claims as last seen; a Validator rebuilt lazily after a change."""

    def __init__(self, driver: str) -> None:
        self.driver = driver
        self.stores: dict[str, dict[str, dict[str, Any]]] = {"slices": {}, "classes": {}, "claims": {}}
        self._validator: Validator | None = None
        self._env: tuple[tuple[Any, ...], CelEnvironment] | None = None
        self.synced: set[str] = set()
        self.pool: ChangeListener | None = None  # the webhook's workers, which get every change too

    @staticmethod
    def key(obj: Mapping[str, Any]) -> str:
        meta = obj.get("metadata") or {}
        return f"{meta.get('namespace') or ''}/{meta.get('name') or ''}"

    def replace(self, store: str, items: Iterable[dict[str, Any]]) -> None:
        self.stores[store] = {self.key(o): o for o in items}
        self.synced.add(store)
        self._validator = None
        if self.pool is not None:
            self.pool.replace(store, list(self.stores[store].values()))

    def apply(self, store: str, event_type: str, obj: dict[str, Any]) -> None:
        if event_type == "DELETED":
            self.stores[store].pop(self.key(obj), None)
        elif event_type in ("ADDED", "MODIFIED"):
            self.stores[store][self.key(obj)] = obj
        else:
            return
        self._validator = None
        if self.pool is not None:
            self.pool.apply(store, event_type, obj)

    def validator(self) -> Validator:
        if self._validator is None:
            slices = list(self.stores["slices"].values())
            schema = Schema.default(self.driver)
            schema.add_slices(slices)
            sig = (tuple(sorted(schema.attributes.items())), tuple(sorted(schema.capacities)))
            if self._env is None or self._env[0] != sig:
                self._env = (sig, CelEnvironment(schema))
            claims = [c for c in self.stores["claims"].values() if (c.get("status") or {}).get("allocation")]
            self._validator = Validator(
                self.driver, slices, self.stores["classes"].values(), claims, env=self._env[1]
            )
        return self._validator

    def device_count(self) -> int:
        return sum(len((s.get("spec") or {}).get("devices") or []) for s in self.stores["slices"].values())
