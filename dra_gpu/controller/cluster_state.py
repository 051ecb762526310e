"""The webhook's view of the cluster: slices, classes and claims as last listed or watched, and a
Validator over them, rebuilt lazily after a change. Its own module so that the review workers
(review_pool.py) hold the same view without importing the HTTP side.

Each object is reduced to what reviews read as it enters (view_records.py): a claim of any size to
its allocation's devices, and a claim that holds none is not kept, so the view's memory follows
the devices in use, not the claims' count times their size. A change that leaves an object's
reduced form as it was (a claim's reservedFor, a slice's labels) changes nothing: neither the
workers nor the Validator hear of it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from dra_gpu.controller import view_records
from dra_gpu.controller.cel import CelEnvironment, Schema
from dra_gpu.controller.rules import Validator


class ChangeListener(Protocol):
    """Gets every change too (the review workers' copies of the view)."""

    def replace(self, store: str, items: list[Mapping[str, Any]]) -> None: ...

    def apply(self, store: str, event_type: str, obj: Mapping[str, Any]) -> None: ...


class ClusterState:
    """Slices, classes and claims as last seen; a Validator rebuilt lazily after a change."""

    def __init__(self, driver: str, nvidia_compatible: bool = False) -> None:
        self.driver = driver
        self.nvidia_compatible = nvidia_compatible
        self.stores: dict[str, dict[str, Mapping[str, Any]]] = {s: {} for s in view_records.STORES}
        self._validator: Validator | None = None
        self._env: tuple[tuple[Any, ...], CelEnvironment] | None = None
        self.synced: set[str] = set()
        self.pool: ChangeListener | None = None  # the webhook's workers, which get every change too

    @staticmethod
    def key(obj: Mapping[str, Any]) -> str:
        return view_records.key(obj)

    def replace(self, store: str, items: Iterable[Mapping[str, Any]]) -> None:
        """The whole store; `items` is read one at a time, each reduced before the next is read."""
        kept: dict[str, Mapping[str, Any]] = {}
        for obj in items:
            slim = view_records.slim(store, obj)
            if slim is not None:
                kept[self.key(slim)] = slim
        self.stores[store] = kept
        self.synced.add(store)
        self._validator = None
        if self.pool is not None:
            self.pool.replace(store, list(kept.values()))

    def apply(self, store: str, event_type: str, obj: Mapping[str, Any]) -> None:
        if event_type in view_records.GONE:
            slim = None
        elif event_type in ("ADDED", "MODIFIED"):
            slim = view_records.slim(store, obj)
        else:
            return
        key = self.key(obj if slim is None else slim)  # a record's own key: one string a claim
        held = self.stores[store]
        if slim is None:
            if held.pop(key, None) is None:
                return  # it was not in the view (never allocated, or gone already)
            event_type, slim = "DELETED", view_records.identity(key)
        elif held.get(key) == slim:
            return
        else:
            held[key] = slim
        self._validator = None
        if self.pool is not None:
            self.pool.apply(store, event_type, slim)

    def validator(self) -> Validator:
        if self._validator is None:
            slices = list(self.stores["slices"].values())
            schema = Schema.default(self.driver)
            schema.add_slices(slices)
            sig = (tuple(sorted(schema.attributes.items())), tuple(sorted(schema.capacities)))
            if self._env is None or self._env[0] != sig:
                self._env = (sig, CelEnvironment(schema))
            self._validator = Validator(
                self.driver,
                slices,
                self.stores["classes"].values(),
                self.stores["claims"].values(),  # allocated ones only (view_records.slim_claim)
                env=self._env[1],
                nvidia_compatible=self.nvidia_compatible,
            )
        return self._validator

    def device_count(self) -> int:
        return sum(len((s.get("spec") or {}).get("devices") or []) for s in self.stores["slices"].values())
