"""Validation rules for DeviceClasses, ResourceClaims and ResourceClaimTemplates that concern the driver.

One core for the admission webhook and `dra-gpu validate`: structure and API limits, CEL selectors
(compile, type-check against the attributes the driver publishes), constraints, opaque config, and
feasibility against the published ResourceSlices. Objects that do not concern the driver pass
untouched. Every problem names its field path and says what would be valid.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from dra_gpu.controller import sharing_fit
from dra_gpu.controller.allocation_errors import AllocationError
from dra_gpu.controller.allocator_view import Cluster, allocated_devices, shared_consumption
from dra_gpu.controller.cel import CelEnvironment, Schema
from dra_gpu.controller.claim_requests import parse_requests
from dra_gpu.controller.explain import Failure, explain
from dra_gpu.controller.schemas import decode_object
from dra_gpu.kube.values import (
    DNS_LABEL,
    DNS_SUBDOMAIN,
    QUALIFIED_NAME_PART,
    RESOURCE_API_VERSION,
    qualified_name_problem,
)
from dra_gpu.model import nvidia_compat
from dra_gpu.model.config import ConfigError, decode
from dra_gpu.model.device_classes import mig_class_name
from dra_gpu.model.inventory import DEFAULT_DRIVER_NAME

KINDS = ("DeviceClass", "ResourceClaim", "ResourceClaimTemplate")
MAX_OBJECT_BYTES = 3 * 1024 * 1024  # the apiserver's request size limit
MAX_REQUESTS = MAX_SELECTORS = MAX_CONSTRAINTS = MAX_CONFIGS = 32
MAX_SUBREQUESTS = 8
MAX_PARAMETERS_BYTES = 10 * 1024


class ProblemKind(Enum):
    """What kind of problem, for callers that act on it; the words for people are in `message`."""

    INVALID = "invalid"  # wrong as written: structure, limits, CEL, names, opaque config
    UNSATISFIABLE = "unsatisfiable"  # valid, but the published devices can never satisfy it
    UNKNOWN_CLASS = "unknown-class"  # names a DeviceClass that does not exist (it may be created later)
    IN_USE = "in-use"  # satisfiable, but not now: the devices it needs are allocated
    NOT_CHECKED = "not-checked"  # a check was skipped (no published slices, CEL functions not modelled)


@dataclass(frozen=True)
class Problem:
    path: str
    message: str
    kind: ProblemKind = ProblemKind.INVALID


@dataclass
class Verdict:
    kind: str
    name: str
    namespace: str = ""
    concerned: bool = False
    errors: list[Problem] = field(default_factory=list)
    warnings: list[Problem] = field(default_factory=list)

    @property
    def allowed(self) -> bool:
        return not self.errors

    def lines(self) -> list[str]:
        who = f"{self.kind}/{self.name}"
        return [f"{who}: {p.path}: {p.message}" for p in self.errors]

    def warning_lines(self) -> list[str]:
        who = f"{self.kind}/{self.name}"
        return [f"{who}: {p.path}: warning: {p.message}" for p in self.warnings]


def is_extended_resource_name(name: str) -> str | None:
    """None when `name` is a valid extended resource name (as Kubernetes checks it), else why not."""
    if "/" not in name or "kubernetes.io/" in name:
        return "must be a domain-prefixed name outside kubernetes.io, such as example.com/gpu"
    if name.startswith("requests."):
        return "must not start with 'requests.'"
    prefix, _, ident = ("requests." + name).partition("/")
    if len(prefix) > 253 or not DNS_SUBDOMAIN.match(prefix):
        return f"domain {name.partition('/')[0]!r} must be a lowercase DNS subdomain"
    if len(ident) > 63 or not QUALIFIED_NAME_PART.match(ident):
        return (
            f"name {ident!r} must be <= 63 characters of [A-Za-z0-9-_.], "
            "starting and ending with an alphanumeric character"
        )
    return None


class Validator:
    """The rules, over one view of the cluster (published slices, classes, allocated claims).

    `nvidia_compatible` (the driver runs as NVIDIA's gpu.nvidia.com): a request for one of NVIDIA's
    classes dra-gpu has no devices for, or a config for NVIDIA's other driver, is refused with the
    reason (nvidia_compat), unless the class exists, or the other driver shows (a class selects
    it, it publishes slices): then NVIDIA's other driver runs beside this one and serves it.
    """

    def __init__(
        self,
        driver: str = DEFAULT_DRIVER_NAME,
        slices: Iterable[Mapping[str, Any]] = (),
        classes: Iterable[Mapping[str, Any]] = (),
        claims: Iterable[Mapping[str, Any]] = (),
        env: CelEnvironment | None = None,
        nvidia_compatible: bool = False,
    ) -> None:
        self.driver = driver
        self.nvidia_compatible = nvidia_compatible
        self.slices = list(slices)
        if env is None:
            schema = Schema.default(driver)
            schema.add_slices(self.slices)
            env = CelEnvironment(schema)
        self.env = env
        self.classes = {str((c.get("metadata") or {}).get("name", "")): c for c in classes}
        claims = list(claims)
        self.cluster = Cluster(
            env, self.slices, self.classes, allocated_devices(claims), shared_use=shared_consumption(claims)
        )
        self.has_driver_slices = any((s.get("spec") or {}).get("driver") == driver for s in self.slices)
        self._other_drivers_present: dict[str, bool] = {}
        self._checked: dict[str, list[str]] = {}

    # -- entry point

    def validate(self, obj: Any) -> Verdict:
        if not isinstance(obj, dict):
            return Verdict(
                "?", "?", errors=[Problem("(document)", "must be a Kubernetes object (a mapping)")]
            )
        kind = str(obj.get("kind") or "?")
        meta: dict[str, Any] = obj["metadata"] if isinstance(obj.get("metadata"), dict) else {}
        name = str(meta.get("name") or meta.get("generateName") or "?")
        v = Verdict(kind, name, str(meta.get("namespace") or ""))
        if kind not in KINDS:
            v.errors.append(Problem("kind", f"unsupported kind {kind!r} (validated: {', '.join(KINDS)})"))
            return v
        if obj.get("apiVersion") != RESOURCE_API_VERSION:
            v.errors.append(
                Problem("apiVersion", f"must be {RESOURCE_API_VERSION!r}, got {obj.get('apiVersion')!r}")
            )
            return v
        # Decode before any rule: bounded sizes and nesting, and every field the rules read typed.
        problems = decode_object(obj)
        if problems:
            v.concerned = True
            v.errors.extend(Problem(path or "(object)", msg) for path, msg in problems)
            return v
        size = len(json.dumps(obj, default=str))
        if size > MAX_OBJECT_BYTES:
            v.errors.append(
                Problem("(object)", f"is {size} bytes; the apiserver accepts at most {MAX_OBJECT_BYTES}")
            )
            return v
        if name == "?":
            v.errors.append(Problem("metadata.name", "required"))
        if kind == "DeviceClass":
            self._device_class(obj, v)
        elif kind == "ResourceClaim":
            self._claim_spec(
                obj.get("spec"),
                "spec",
                v,
                feasibility=not obj.get("status", {}).get("allocation")
                if isinstance(obj.get("status"), dict)
                else True,
            )
        else:
            spec = obj.get("spec")
            inner = spec.get("spec") if isinstance(spec, dict) else None
            self._claim_spec(inner, "spec.spec", v, feasibility=True)
        if not v.concerned:
            v.errors.clear()
            v.warnings.clear()
        return v

    # -- helpers

    def _mentions_driver(self, text: str) -> bool:
        return self.driver in text

    def _unsupported_class(self, name: str) -> str | None:
        """Why a request for DeviceClass `name` is refused in NVIDIA-compatible mode, else None."""
        if not self.nvidia_compatible or name in self.classes:
            return None
        return nvidia_compat.unsupported_reason(name)

    def _unsupported_driver(self, driver: Any) -> str | None:
        """Why an opaque config for `driver` is refused in NVIDIA-compatible mode, else None."""
        if not self.nvidia_compatible or not isinstance(driver, str):
            return None
        what = nvidia_compat.UNSUPPORTED_DRIVERS.get(driver)
        if what is None or self._driver_present(driver):
            return None
        return f"driver {driver} is NVIDIA's driver for {what}, which dra-gpu does not do"

    def _driver_present(self, driver: str) -> bool:
        """Another driver shows in the view: it publishes slices, or a class names it."""
        found = self._other_drivers_present.get(driver)
        if found is None:
            found = any((s.get("spec") or {}).get("driver") == driver for s in self.slices) or any(
                driver in json.dumps(c.get("spec") or {}, default=str) for c in self.classes.values()
            )
            self._other_drivers_present[driver] = found
        return found

    def _list(self, value: Any, path: str, v: Verdict, limit: int) -> list[Any]:
        if value is None:
            return []
        if not isinstance(value, list):
            v.errors.append(Problem(path, "must be a list"))
            return []
        if len(value) > limit:
            v.errors.append(Problem(path, f"has {len(value)} entries, at most {limit} are allowed"))
        return value

    def _selectors(self, selectors: Any, path: str, v: Verdict) -> None:
        for i, s in enumerate(self._list(selectors, path, v, MAX_SELECTORS)):
            p = f"{path}[{i}].cel.expression"
            expr = (
                s.get("cel", {}).get("expression")
                if isinstance(s, dict) and isinstance(s.get("cel"), dict)
                else None
            )
            if not isinstance(expr, str):
                v.errors.append(Problem(p, "required: a CEL expression (string)"))
                continue
            if expr not in self._checked:
                self._checked[expr] = self.env.check(expr)
            v.errors.extend(Problem(p, m) for m in self._checked[expr])
            unmodelled = self.env.unmodelled(expr)
            if unmodelled:
                v.warnings.append(
                    Problem(
                        p,
                        f"uses {', '.join(unmodelled)} of the Kubernetes CEL libraries, which dra-gpu does "
                        "not model: not type-checked, and feasibility is not checked",
                        ProblemKind.NOT_CHECKED,
                    )
                )

    def _configs(self, configs: Any, path: str, v: Verdict, request_names: set[str] | None) -> None:
        for i, c in enumerate(self._list(configs, path, v, MAX_CONFIGS)):
            p = f"{path}[{i}]"
            if not isinstance(c, dict):
                v.errors.append(Problem(p, "must be an object"))
                continue
            if request_names is not None:
                for j, r in enumerate(c.get("requests") or []):
                    if str(r) not in request_names and str(r).split("/")[0] not in request_names:
                        v.errors.append(
                            Problem(
                                f"{p}.requests[{j}]",
                                f"unknown request {r!r} "
                                f"(requests: {', '.join(sorted(request_names)) or 'none'})",
                            )
                        )
            opaque = c.get("opaque")
            # A claim's only: a DeviceClass configuring NVIDIA's other driver shows that it runs.
            refused = (
                self._unsupported_driver(opaque.get("driver"))
                if isinstance(opaque, dict) and request_names is not None
                else None
            )
            if refused:
                v.concerned = True
                v.errors.append(Problem(f"{p}.opaque.driver", refused))
                continue
            if not isinstance(opaque, dict) or opaque.get("driver") != self.driver:
                continue
            v.concerned = True
            params = opaque.get("parameters")
            if len(json.dumps(params, default=str)) > MAX_PARAMETERS_BYTES:
                v.errors.append(
                    Problem(f"{p}.opaque.parameters", f"larger than {MAX_PARAMETERS_BYTES} bytes")
                )
                continue
            try:
                decode(params)
            except ConfigError as exc:
                where = f"{p}.opaque.parameters" + (f".{exc.path}" if exc.path else "")
                v.errors.append(Problem(where, exc.message))

    # -- DeviceClass

    def _device_class(self, obj: Mapping[str, Any], v: Verdict) -> None:
        spec = obj.get("spec")
        if not isinstance(spec, dict):
            v.errors.append(Problem("spec", "required: an object"))
            return
        exprs = [json.dumps(s) for s in spec.get("selectors") or [] if isinstance(s, dict)]
        if any(self._mentions_driver(e) for e in exprs):
            v.concerned = True
        self._selectors(spec.get("selectors"), "spec.selectors", v)
        self._configs(spec.get("config"), "spec.config", v, None)
        ern = spec.get("extendedResourceName")
        if ern is not None:
            problem = is_extended_resource_name(ern) if isinstance(ern, str) else "must be a string"
            if problem:
                v.errors.append(Problem("spec.extendedResourceName", f"{ern!r}: {problem}"))

    # -- ResourceClaim / template

    def class_concerns_driver(self, name: str) -> bool:
        """DeviceClass `name` selects this driver's devices (an unknown one: by its name, the
        chart's classes' names or a name under the driver's)."""
        cls = self.classes.get(name)
        if cls is None:
            return name in (self.driver, mig_class_name(self.driver)) or name.endswith("." + self.driver)
        return self._mentions_driver(json.dumps(cls.get("spec") or {}))

    def _claim_spec(self, spec: Any, path: str, v: Verdict, feasibility: bool) -> None:
        if not isinstance(spec, dict) or not isinstance(spec.get("devices", {}), dict):
            v.errors.append(Problem(path, "must be an object with 'devices'"))
            v.concerned = True
            return
        devices = spec.get("devices") or {}
        dpath = f"{path}.devices"
        names: set[str] = set()
        full_names: set[str] = set()
        for i, r in enumerate(self._list(devices.get("requests"), f"{dpath}.requests", v, MAX_REQUESTS)):
            self._request(r, f"{dpath}.requests[{i}]", v, names, full_names)
        for i, c in enumerate(
            self._list(devices.get("constraints"), f"{dpath}.constraints", v, MAX_CONSTRAINTS)
        ):
            self._constraint(c, f"{dpath}.constraints[{i}]", v, names, full_names)
        self._configs(devices.get("config"), f"{dpath}.config", v, names)
        self._admin_access_sharing(devices, dpath, v)
        if v.concerned and not v.errors and feasibility and names:
            self._feasibility(spec, dpath, v)

    def _sharing_strategy(self, config: Any) -> str | None:
        """The sharing strategy of one config entry of this driver other than Exclusive, else None."""
        opaque = config.get("opaque") if isinstance(config, dict) else None
        if not isinstance(opaque, dict) or opaque.get("driver") != self.driver:
            return None
        try:
            strategy = decode(opaque.get("parameters")).sharing.strategy
        except ConfigError:
            return None  # reported by _configs
        return strategy if strategy != "Exclusive" else None

    def _admin_access_sharing(self, devices: Mapping[str, Any], dpath: str, v: Verdict) -> None:
        """Refuse a sharing config (MPS, TimeSlicing) on an adminAccess request.

        Admin access gets a device that other claims may hold exclusively; a sharing config would
        change that device's compute mode or start a daemon on it under their feet.
        """
        requests = devices.get("requests")
        requests = requests if isinstance(requests, list) else []
        admin = {  # request name -> (its index, its `exactly`)
            str(r.get("name")): (i, r["exactly"])
            for i, r in enumerate(requests)
            if isinstance(r, dict) and isinstance(r.get("exactly"), dict) and r["exactly"].get("adminAccess")
        }
        if not admin:
            return
        claim = f"{v.namespace}/{v.name}" if v.namespace else v.name
        configs = devices.get("config")
        configs = configs if isinstance(configs, list) else []
        for i, c in enumerate(configs):
            strategy = self._sharing_strategy(c)
            if strategy is None:
                continue
            targets = [str(r) for r in c.get("requests") or []] or list(admin)
            for name in sorted(set(targets) & set(admin)):
                v.concerned = True
                v.errors.append(
                    Problem(
                        f"{dpath}.config[{i}].opaque.parameters.sharing.strategy",
                        f"claim {claim}: sharing strategy {strategy} applies to request {name!r}, which "
                        "has adminAccess: an admin-access device may be held exclusively by another "
                        "claim, so it cannot be shared",
                    )
                )
        for name, (index, exact) in sorted(admin.items()):
            cls = self.classes.get(str(exact.get("deviceClassName")))
            class_configs = (cls.get("spec") or {}).get("config") if cls else None
            for c in class_configs if isinstance(class_configs, list) else []:
                strategy = self._sharing_strategy(c)
                if strategy is not None:
                    v.concerned = True
                    v.errors.append(
                        Problem(
                            f"{dpath}.requests[{index}].exactly.deviceClassName",
                            f"claim {claim}: DeviceClass {exact.get('deviceClassName')!r} configures "
                            f"sharing strategy {strategy}, which request {name!r} with adminAccess "
                            "cannot take",
                        )
                    )

    def _request(self, r: Any, p: str, v: Verdict, names: set[str], full: set[str]) -> None:
        if not isinstance(r, dict):
            v.errors.append(Problem(p, "must be an object"))
            return
        name = r.get("name")
        if not isinstance(name, str) or not DNS_LABEL.match(name) or len(name) > 63:
            v.errors.append(Problem(f"{p}.name", f"{name!r}: must be a DNS label"))
        elif name in names:
            v.errors.append(Problem(f"{p}.name", f"duplicate request name {name!r}"))
        names.add(str(name))
        full.add(str(name))
        has_exact, has_first = r.get("exactly") is not None, r.get("firstAvailable") is not None
        if has_exact == has_first:
            v.errors.append(Problem(p, "exactly one of 'exactly' and 'firstAvailable' is required"))
            return
        if has_exact:
            self._exact(r["exactly"], f"{p}.exactly", v)
            return
        subs = self._list(r["firstAvailable"], f"{p}.firstAvailable", v, MAX_SUBREQUESTS)
        if not subs:
            v.errors.append(Problem(f"{p}.firstAvailable", "must list at least one subrequest"))
        seen: set[str] = set()
        for j, s in enumerate(subs):
            sp = f"{p}.firstAvailable[{j}]"
            if not isinstance(s, dict):
                v.errors.append(Problem(sp, "must be an object"))
                continue
            sname = s.get("name")
            if not isinstance(sname, str) or not DNS_LABEL.match(sname):
                v.errors.append(Problem(f"{sp}.name", f"{sname!r}: must be a DNS label"))
            elif sname in seen:
                v.errors.append(Problem(f"{sp}.name", f"duplicate subrequest name {sname!r}"))
            seen.add(str(sname))
            full.add(f"{name}/{sname}")
            if "adminAccess" in s:
                v.errors.append(Problem(f"{sp}.adminAccess", "not allowed in a subrequest"))
            self._exact(s, sp, v)

    def _exact(self, e: Any, p: str, v: Verdict) -> None:
        if not isinstance(e, dict):
            v.errors.append(Problem(p, "must be an object"))
            return
        cls = e.get("deviceClassName")
        if not isinstance(cls, str) or not cls:
            v.errors.append(Problem(f"{p}.deviceClassName", "required"))
        else:
            refused = self._unsupported_class(cls)
            if refused:
                v.concerned = True
                v.errors.append(Problem(f"{p}.deviceClassName", refused))
            elif self.class_concerns_driver(cls):
                v.concerned = True
        sels = e.get("selectors") or []
        if any(self._mentions_driver(json.dumps(s)) for s in sels if isinstance(s, dict)):
            v.concerned = True
        mode = e.get("allocationMode", "ExactCount")
        count = e.get("count")
        if mode not in ("ExactCount", "All"):
            v.errors.append(Problem(f"{p}.allocationMode", f"{mode!r}: must be ExactCount or All"))
        elif mode == "All" and count is not None:
            v.errors.append(Problem(f"{p}.count", "must not be set with allocationMode All"))
        elif count is not None and (isinstance(count, bool) or not isinstance(count, int) or count <= 0):
            v.errors.append(Problem(f"{p}.count", f"{count!r}: must be a positive integer"))
        elif isinstance(count, int) and count > 32:
            v.errors.append(Problem(f"{p}.count", f"{count}: a claim can hold at most 32 devices"))
        self._selectors(sels, f"{p}.selectors", v)

    def _constraint(self, c: Any, p: str, v: Verdict, names: set[str], full: set[str]) -> None:
        if not isinstance(c, dict):
            v.errors.append(Problem(p, "must be an object"))
            return
        for j, r in enumerate(c.get("requests") or []):
            if str(r) not in full:
                v.errors.append(
                    Problem(
                        f"{p}.requests[{j}]",
                        f"unknown request {r!r} (requests: {', '.join(sorted(full)) or 'none'})",
                    )
                )
        keys = [k for k in ("matchAttribute", "distinctAttribute") if c.get(k) is not None]
        if len(keys) != 1:
            v.errors.append(Problem(p, "exactly one of matchAttribute and distinctAttribute is required"))
            return
        key = keys[0]
        attr = c[key]
        ap = f"{p}.{key}"
        if not isinstance(attr, str):
            v.errors.append(Problem(ap, "must be a string"))
            return
        domain, sep, ident = attr.rpartition("/")
        if not sep:
            hint = f"{self.driver}/{attr}" if attr in self.env.schema.attributes else f"<domain>/{attr}"
            v.errors.append(Problem(ap, f"{attr!r} must be fully qualified, e.g. {hint!r}"))
            return
        if qualified_name_problem(attr) is not None:
            v.errors.append(Problem(ap, f"{attr!r} is not a valid qualified attribute name"))
            return
        if domain == self.driver:
            v.concerned = True
            if ident not in self.env.schema.attributes:
                v.errors.append(Problem(ap, f"unknown attribute {attr}: {self.env.schema.suggest(ident)}"))

    def _sharing_fit(self, spec: Mapping[str, Any], path: str, v: Verdict) -> None:
        """Sharing configs the devices a request can get cannot take (see sharing_fit)."""
        try:
            errors, warnings = sharing_fit.check(self.cluster, spec, self.driver)
        except AllocationError:
            return  # the feasibility check reports it
        v.errors += [Problem(f"{path}.{e.split(':', 1)[0]}", e.split(": ", 1)[1]) for e in errors]
        v.warnings += [Problem(f"{path}.{w.split(':', 1)[0]}", w.split(": ", 1)[1]) for w in warnings]

    def _other_driver_unpublished(self, spec: Mapping[str, Any]) -> str:
        """Why a claim that asks for this driver's devices and another driver's (a GPU and a NIC
        of a network driver) is not refused for the other's: a request every alternative of which
        names another driver's class that selects no published device yet. Empty when none does."""
        try:
            requests, _ = parse_requests(spec)
            for req in requests:
                empty = [
                    s.device_class
                    for s in req.alternatives
                    if s.device_class in self.classes
                    and not self.class_concerns_driver(s.device_class)
                    and not any(
                        self.cluster.candidates(node, dataclasses.replace(s, selectors=[]))
                        for node in self.cluster.nodes
                    )
                ]
                if empty and len(empty) == len(req.alternatives):
                    names = ", ".join(repr(c) for c in dict.fromkeys(empty))
                    return (
                        f"request {req.name!r}: class {names} is not {self.driver}'s and selects no "
                        "published device (its driver may not have published its slices yet)"
                    )
        except AllocationError:
            return ""
        return ""

    def _feasibility(self, spec: Mapping[str, Any], path: str, v: Verdict) -> None:
        if not self.has_driver_slices:
            v.warnings.append(
                Problem(
                    path,
                    f"no ResourceSlices of {self.driver} are published; feasibility not checked",
                    ProblemKind.NOT_CHECKED,
                )
            )
            return
        try:
            ever = explain(self.cluster, spec, ignore_in_use=True, best=False)
        except AllocationError as exc:  # pragma: no cover - explain reports these in .reason
            v.warnings.append(Problem(path, str(exc), ProblemKind.NOT_CHECKED))
            return
        self._sharing_fit(spec, path, v)
        if not ever.allocatable:
            if not ever.simulated:  # a selector (the claim's or its class's) is valid but not modelled
                v.warnings.append(
                    Problem(path, f"feasibility not checked: {ever.reason}", ProblemKind.NOT_CHECKED)
                )
            elif ever.failure is Failure.UNKNOWN_CLASS:  # the class may be created later
                v.warnings.append(Problem(path, ever.reason, ProblemKind.UNKNOWN_CLASS))
            elif waiting := self._other_driver_unpublished(spec):  # its driver may publish later
                v.warnings.append(
                    Problem(path, f"feasibility not checked: {waiting}", ProblemKind.NOT_CHECKED)
                )
            else:
                v.errors.append(
                    Problem(
                        path,
                        f"can never be satisfied by the published devices: {ever.reason}",
                        ProblemKind.UNSATISFIABLE,
                    )
                )
            return
        tainted = self.cluster.tainted
        if not self.cluster.busy and not tainted:
            return
        now = explain(self.cluster, spec, best=False)
        if not now.allocatable:
            why = {(True, False): "in use", (False, True): "tainted"}.get(
                (bool(self.cluster.in_use), tainted), "in use or tainted"
            )
            v.warnings.append(
                Problem(
                    path,
                    f"cannot be allocated right now (devices {why}): {now.reason}",
                    ProblemKind.IN_USE,
                )
            )
