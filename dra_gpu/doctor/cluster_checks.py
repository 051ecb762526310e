"""The cluster's answers: is the DRA API served with the gates this driver needs, are the classes
there, does every GPU node publish its slices, why is each GPU pod Pending, which devices are
tainted, is the admission webhook reachable with a valid certificate.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import json
import socket
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from dra_gpu.doctor.cluster_view import FAILED_PREPARE, ClusterView, load_view
from dra_gpu.doctor.report import Result, crashed, fail, first_line, guarded, ok, skip, warn
from dra_gpu.doctor.settings import ClusterSettings
from dra_gpu.doctor.webhook_tls import CertificateError, fetch
from dra_gpu.kube import RESOURCE_V1, Kube, KubeError

STARTING_GRACE_SECONDS = 60  # a scheduled pod younger than this is still starting, not stuck

# Fields of the features this driver uses; an apiserver with the gate off drops them silently.
GATED_FIELDS = (
    ("taints", "DRADeviceTaints", "device health taints"),
    ("consumesCounters", "DRAPartitionableDevices", "dynamic MIG (counters)"),
    ("allowMultipleAllocations", "DRAConsumableCapacity", "shared GPUs (consumable memory)"),
)


def _meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    meta = obj.get("metadata")
    return meta if isinstance(meta, dict) else {}


def _spec(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    spec = obj.get("spec")
    return spec if isinstance(spec, dict) else {}


def _name(obj: Mapping[str, Any]) -> str:
    return str(_meta(obj).get("name", ""))


# ---------------------------------------------------------------- API and features


def check_resource_api(view: ClusterView, settings: ClusterSettings) -> Iterable[Result]:
    name = "cluster/resource-api"
    if "v1" not in view.resource_versions:
        served = ", ".join(view.resource_versions) or "none"
        yield fail(
            name,
            f"resource.k8s.io/v1 is not served by {view.server_version} (served: {served})",
            "upgrade the control plane to Kubernetes >= 1.34 "
            "(or enable --runtime-config=resource.k8s.io/v1=true)",
        )
        return
    yield ok(name, f"resource.k8s.io/v1 served by {view.server_version}")


def _probe_slice(driver: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"generateName": "dra-gpu-doctor-"},
        "spec": {
            "driver": driver,
            "allNodes": True,
            "pool": {"name": "dra-gpu-doctor-dry-run", "generation": 1, "resourceSliceCount": 1},
            "devices": [
                {
                    "name": "probe",
                    "allowMultipleAllocations": True,
                    "capacity": {
                        "memory": {
                            "value": "8Gi",
                            "requestPolicy": {"default": "1Gi", "validRange": {"min": "1Gi"}},
                        }
                    },
                    "consumesCounters": [{"counterSet": "probe", "counters": {"memory": {"value": "8Gi"}}}],
                    "taints": [{"key": f"{driver}/doctor", "value": "probe", "effect": "NoSchedule"}],
                }
            ],
        },
    }


async def check_dra_features(kube: Kube, view: ClusterView, settings: ClusterSettings) -> list[Result]:
    """A server-side dry run of a slice using every gated field: what comes back is what is on."""
    name = "cluster/dra-features"
    if "v1" not in view.resource_versions:
        return [skip(name, "resource.k8s.io/v1 not served")]
    try:
        got = await asyncio.wait_for(
            kube.create(f"{RESOURCE_V1}/resourceslices", _probe_slice(settings.driver), dry_run=True),
            settings.timeout,
        )
    except KubeError as exc:
        if exc.status in (401, 403):
            return [skip(name, f"cannot dry-run a ResourceSlice (HTTP {exc.status}: no create permission)")]
        raise
    device = ((got.get("spec") or {}).get("devices") or [{}])[0]
    dropped = [(f, gate, what) for f, gate, what in GATED_FIELDS if not device.get(f)]
    results = []
    if "devicetaintrules" not in view.v1_resources:
        dropped.append(("DeviceTaintRule", "DRADeviceTaintRules", "tainting devices by rule"))
    if dropped:
        results.append(
            warn(
                name,
                "dropped by the apiserver (gate off): "
                + "; ".join(f"{f} ({gate}): no {what}" for f, gate, what in dropped),
                "enable "
                + ",".join(sorted({g for _, g, _ in dropped}))
                + " =true on kube-apiserver, kube-scheduler, kube-controller-manager and kubelet",
            )
        )
    else:
        kept = ", ".join(f"{f} ({gate})" for f, gate, _ in GATED_FIELDS)
        results.append(ok(name, f"kept in a dry run: {kept}; DeviceTaintRule served"))
    return results


def check_device_classes(view: ClusterView, settings: ClusterSettings) -> Iterable[Result]:
    name = "cluster/device-classes"
    present = {_name(c) for c in view.classes}
    missing = [c for c in settings.class_names if c not in present]
    if missing:
        yield fail(
            name,
            f"DeviceClass {', '.join(missing)} missing: claims naming it never allocate",
            "reinstall the chart's classes: `helm upgrade --reuse-values <release> deploy/helm/dra-gpu` "
            "(deviceClasses.*.enabled=true)",
        )
        return
    yield ok(name, f"{', '.join(settings.class_names)} present")


# ---------------------------------------------------------------- nodes and slices


def selector_matches(selector: str, labels: Mapping[str, str]) -> bool:
    """Equality-based label selector: "a=b,c!=d,e,!f"."""
    for term in (t.strip() for t in selector.split(",")):
        if not term:
            continue
        if "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k.strip()) == v.strip():
                return False
        elif "=" in term:
            k, v = term.replace("==", "=").split("=", 1)
            if labels.get(k.strip()) != v.strip():
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


def _our_slices(view: ClusterView, driver: str) -> list[dict[str, Any]]:
    return [s for s in view.slices if _spec(s).get("driver") == driver]


def check_node_slices(view: ClusterView, settings: ClusterSettings) -> Iterable[Result]:
    """Every node labelled for the driver publishes a complete pool of the current generation."""
    driver = settings.driver
    by_node: dict[str, list[dict[str, Any]]] = {}
    for s in _our_slices(view, driver):
        by_node.setdefault(str(_spec(s).get("nodeName") or ""), []).append(s)
    labelled = sorted(
        _name(n) for n in view.nodes if selector_matches(settings.node_selector, _meta(n).get("labels") or {})
    )
    if not labelled:
        yield warn(
            "cluster/gpu-nodes",
            f"no node is labelled {settings.node_selector}: the chart's DaemonSet runs nowhere"
            + (f" (slices from {', '.join(sorted(n for n in by_node if n))})" if by_node else ""),
            f"label the GPU nodes: kubectl label node NODE {settings.node_selector} "
            "(or run NVIDIA GPU feature discovery)",
        )
    for node in labelled:
        name = f"cluster/slices/{node}"
        slices = by_node.get(node, [])
        if not slices:
            yield fail(
                name,
                f"labelled {settings.node_selector} but no ResourceSlice of {driver}: the plugin is "
                "not running there or cannot reach the API server",
                f"check the plugin pod on {node} (`kubectl get pods -A -o wide --field-selector "
                f"spec.nodeName={node}`), then run `dra-gpu doctor` on the node",
            )
            continue
        yield _pool_result(name, slices)
    known = {_name(n) for n in view.nodes}
    for node in sorted(n for n in by_node if n and n not in known):
        yield warn(
            f"cluster/slices/{node}",
            f"{len(by_node[node])} slices of {driver} for node {node}, which does not exist",
            f"kubectl delete resourceslices --field-selector spec.nodeName={node}",
        )


def _pool_result(name: str, slices: list[dict[str, Any]]) -> Result:
    pools: dict[str, list[Mapping[str, Any]]] = {}
    for s in slices:
        pool = _spec(s).get("pool") or {}
        pools.setdefault(str(pool.get("name", "")), []).append(s)
    parts, problems = [], []
    for pool_name, items in sorted(pools.items()):
        gens = [int((_spec(s).get("pool") or {}).get("generation", 0)) for s in items]
        top = max(gens)
        current = [s for s, g in zip(items, gens, strict=True) if g == top]
        want = int((_spec(current[0]).get("pool") or {}).get("resourceSliceCount", 1))
        devices = sum(len(_spec(s).get("devices") or []) for s in current)
        parts.append(f"pool {pool_name}: generation {top}, {len(current)}/{want} slices, {devices} devices")
        if len(current) != want:
            problems.append(f"pool {pool_name} generation {top} has {len(current)} of {want} slices")
        if len(current) != len(items):
            problems.append(f"pool {pool_name} has {len(items) - len(current)} slices of older generations")
    if problems:
        return warn(
            name,
            "; ".join(parts + problems) + " (the scheduler ignores an incomplete pool)",
            "wait a few seconds (an update in progress); if it stays, restart the plugin on the node",
        )
    return ok(name, "; ".join(parts))


# ---------------------------------------------------------------- taints


def _rule_matches(rule: Mapping[str, Any], driver: str, pool: str, device: str) -> bool:
    sel = _spec(rule).get("deviceSelector") or {}
    return all(
        not sel.get(field) or sel.get(field) == value
        for field, value in (("driver", driver), ("pool", pool), ("device", device))
    )


def _taint_text(t: Mapping[str, Any]) -> str:
    value = f"={t.get('value')}" if t.get("value") else ""
    return f"{t.get('key')}{value}:{t.get('effect')}"


def device_taints(view: ClusterView, driver: str) -> list[tuple[str, str, str]]:
    """(pool/device, taint, source) for every taint on a device of `driver`."""
    out = []
    for s in _our_slices(view, driver):
        pool = str((_spec(s).get("pool") or {}).get("name", ""))
        for d in _spec(s).get("devices") or []:
            dev = str(d.get("name"))
            for t in d.get("taints") or []:
                out.append((f"{pool}/{dev}", _taint_text(t), "slice"))
            for rule in view.taint_rules:
                if _rule_matches(rule, driver, pool, dev):
                    taint = _spec(rule).get("taint") or {}
                    out.append((f"{pool}/{dev}", _taint_text(taint), f"DeviceTaintRule {_name(rule)}"))
    return out


def slices_with_rule_taints(view: ClusterView) -> list[dict[str, Any]]:
    """The slices as the scheduler sees them: DeviceTaintRules' taints added to their devices."""
    out = []
    for s in view.slices:
        s = copy.deepcopy(s)
        spec = _spec(s)
        pool = str((spec.get("pool") or {}).get("name", ""))
        for d in spec.get("devices") or []:
            for rule in view.taint_rules:
                if _rule_matches(rule, str(spec.get("driver")), pool, str(d.get("name"))):
                    d.setdefault("taints", []).append(dict(_spec(rule).get("taint") or {}))
        out.append(s)
    return out


def check_device_taints(view: ClusterView, settings: ClusterSettings) -> Iterable[Result]:
    name = "cluster/device-taints"
    if "slices" in view.errors:
        yield skip(name, view.errors["slices"])
        return
    taints = device_taints(view, settings.driver)
    if not taints:
        rules = "" if "devicetaintrules" in view.v1_resources else " (DeviceTaintRule not served)"
        yield ok(name, f"no device of {settings.driver} is tainted{rules}")
        return
    listed = "; ".join(f"{dev} {taint} ({src})" for dev, taint, src in taints[:10])
    more = f" and {len(taints) - 10} more" if len(taints) > 10 else ""
    rule_names = sorted({src.split(" ", 1)[1] for _, _, src in taints if src != "slice"})
    fix = "find the cause on the node (`dmesg | grep -i xid`, `nvidia-smi -q -d ECC,PAGE_RETIREMENT`)"
    if rule_names:
        fix += f"; once repaired: kubectl delete devicetaintrule {' '.join(rule_names)}"
    else:
        fix += "; the plugin clears its health taints after recovery"
    yield warn(name, f"{len(taints)} tainted: {listed}{more}", fix)


# ---------------------------------------------------------------- Pending pods


def _class_names(spec: Mapping[str, Any]) -> list[str]:
    out = []
    for r in (spec.get("devices") or {}).get("requests") or []:
        if isinstance(r.get("exactly"), dict):
            out.append(str(r["exactly"].get("deviceClassName")))
        for sub in r.get("firstAvailable") or []:
            out.append(str(sub.get("deviceClassName")))
    return out


def _allocated(claim: Mapping[str, Any]) -> bool:
    status = claim.get("status")
    return isinstance(status, dict) and bool(status.get("allocation"))


class PendingPods:
    """Why each Pending pod with claims of this driver is Pending."""

    def __init__(self, view: ClusterView, settings: ClusterSettings) -> None:
        self.view, self.settings = view, settings
        driver = settings.driver
        self.classes = {_name(c) for c in view.classes}
        self.our_classes = set(settings.class_names) | {
            _name(c) for c in view.classes if f"'{driver}'" in json.dumps(c.get("spec")).replace('"', "'")
        }
        self.claims = {(str(_meta(c).get("namespace")), _name(c)): c for c in view.claims}

    def ours(self, claim: Mapping[str, Any]) -> bool:
        if any(c in self.our_classes for c in _class_names(_spec(claim))):
            return True
        results = (((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get(
            "results"
        ) or []
        return any(r.get("driver") == self.settings.driver for r in results)

    def pod_claims(self, pod: Mapping[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
        """(the pod's claims that exist, the names of those not created yet)."""
        ns = str(_meta(pod).get("namespace"))
        made = {
            s.get("name"): s.get("resourceClaimName")
            for s in (pod.get("status") or {}).get("resourceClaimStatuses") or []
        }
        found, missing = [], []
        for rc in _spec(pod).get("resourceClaims") or []:
            claim_name = rc.get("resourceClaimName") or made.get(rc.get("name"))
            claim = self.claims.get((ns, str(claim_name))) if claim_name else None
            if claim is None:
                missing.append(
                    str(
                        claim_name
                        or f"{rc.get('name')} (from template {rc.get('resourceClaimTemplateName')})"
                    )
                )
            else:
                found.append(claim)
        return found, missing

    def explain(
        self, claims: list[dict[str, Any]], ignore_taints: bool
    ) -> dict[tuple[str, str], dict[str, Any]]:
        from dra_gpu.controller.commands import explain_inputs
        from dra_gpu.controller.inputs import Inputs

        slices = slices_with_rule_taints(self.view)
        if ignore_taints:
            for s in slices:
                for d in _spec(s).get("devices") or []:
                    d.pop("taints", None)
        in_use = [c for c in self.view.claims if _allocated(c)]
        # Items of a list call carry no kind, and the validator dispatches on it.
        todo = [{"kind": "ResourceClaim", "apiVersion": "resource.k8s.io/v1", **c} for c in claims]
        inputs = Inputs(slices=slices, classes=list(self.view.classes), claims=in_use + todo)
        result = explain_inputs(inputs, self.settings.driver)
        return {(c["namespace"], c["name"]): c for c in result["claims"]}

    def results(self) -> list[Result]:
        pods = []
        for pod in self.view.pending_pods:
            found, missing = self.pod_claims(pod)
            if any(self.ours(c) for c in found):
                pods.append((pod, [c for c in found if self.ours(c)], missing))
        if not pods:
            return [ok("cluster/pending-pods", f"no Pending pod with claims of {self.settings.driver}")]
        unallocated = [c for _, claims, _ in pods for c in claims if not _allocated(c)]
        verdicts = self.explain(unallocated, ignore_taints=False) if unallocated else {}
        blocked = [c for c in unallocated if not verdicts.get(self._key(c), {}).get("allocatable", True)]
        untainted = self.explain(blocked, ignore_taints=True) if blocked else {}
        return [self._one(pod, claims, missing, verdicts, untainted) for pod, claims, missing in pods]

    @staticmethod
    def _key(claim: Mapping[str, Any]) -> tuple[str, str]:
        return (str(_meta(claim).get("namespace") or "default"), _name(claim))

    def _one(
        self,
        pod: Mapping[str, Any],
        claims: list[dict[str, Any]],
        missing: list[str],
        verdicts: Mapping[tuple[str, str], Mapping[str, Any]],
        untainted: Mapping[tuple[str, str], Mapping[str, Any]],
    ) -> Result:
        ns, pod_name = str(_meta(pod).get("namespace")), _name(pod)
        name = f"cluster/pending/{ns}/{pod_name}"
        node = _spec(pod).get("nodeName")
        if not node:
            for claim in claims:
                if _allocated(claim):
                    continue
                key = self._key(claim)
                verdict = verdicts.get(key, {})
                if verdict.get("allocatable", True):
                    continue
                absent = [c for c in _class_names(_spec(claim)) if c not in self.classes]
                if absent:
                    return fail(
                        name,
                        f"claim {key[1]} names DeviceClass {', '.join(absent)}, which does not exist",
                        f"create DeviceClass {absent[0]} (the chart installs it) or fix the claim",
                    )
                if untainted.get(key, {}).get("allocatable"):
                    return fail(
                        name,
                        f"claim {key[1]}: only tainted devices could satisfy it (it fits when the taints "
                        "are ignored)",
                        "repair the tainted devices (see cluster/device-taints) "
                        "or add a toleration to the claim",
                    )
                return fail(
                    name,
                    f"claim {key[1]} not allocatable: {verdict.get('reason')}",
                    "ask for fewer or other devices, or free some: `dra-gpu explain` shows what fits",
                )
            if missing:
                return warn(
                    name,
                    f"claims not created yet: {', '.join(missing)}",
                    "the ResourceClaim controller (kube-controller-manager) makes them from the templates",
                )
            message = next(
                (
                    str(c.get("message"))
                    for c in (pod.get("status") or {}).get("conditions") or []
                    if c.get("type") == "PodScheduled" and c.get("status") == "False"
                ),
                "not scheduled yet",
            )
            return warn(
                name,
                f"claims allocated, pod not scheduled: {message}",
                "`kubectl describe pod` for the scheduler's words",
            )
        events = [
            e
            for e in self.view.prepare_events
            if (e.get("involvedObject") or {}).get("name") == pod_name
            and (e.get("involvedObject") or {}).get("namespace") == ns
        ]
        if events:
            last = max(events, key=lambda e: str(e.get("lastTimestamp") or e.get("eventTime") or ""))
            return fail(
                name,
                f"on {node}: {FAILED_PREPARE}: {str(last.get('message'))[:400]}",
                f"the kubelet plugin on {node} refused to prepare the claim: run `dra-gpu doctor` there "
                "and read the plugin's log",
            )
        age = _age_seconds(_meta(pod).get("creationTimestamp"))
        waiting = [
            f"{c.get('name')}: {(c.get('state') or {}).get('waiting', {}).get('reason')}"
            for c in (pod.get("status") or {}).get("containerStatuses") or []
            if (c.get("state") or {}).get("waiting")
        ]
        if age is not None and age < STARTING_GRACE_SECONDS:
            return ok(name, f"scheduled on {node}, starting ({age:.0f} s old)")
        return warn(
            name,
            f"scheduled on {node} but not running: {', '.join(waiting) or 'no container status yet'}",
            "`kubectl describe pod` and the kubelet's log on the node",
        )


def _age_seconds(timestamp: Any) -> float | None:
    try:
        created = datetime.datetime.fromisoformat(str(timestamp).replace("Z", "+00:00"))
    except ValueError:
        return None
    return (datetime.datetime.now(datetime.UTC) - created).total_seconds()


def check_pending_pods(view: ClusterView, settings: ClusterSettings) -> Iterable[Result]:
    for need in ("pending_pods", "claims"):
        if need in view.errors:
            yield skip("cluster/pending-pods", view.errors[need])
            return
    yield from PendingPods(view, settings).results()


# ---------------------------------------------------------------- the webhook


def _our_webhooks(view: ClusterView, driver: str) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for cfg in view.webhook_configs:
        for wh in cfg.get("webhooks") or []:
            if str(wh.get("name", "")).endswith("." + driver):
                out.append((_name(cfg), wh))
    return out


def check_webhook(view: ClusterView, settings: ClusterSettings) -> Iterable[Result]:
    name = "cluster/webhook"
    if "webhook_configs" in view.errors and not settings.webhook_url:
        yield skip(name, view.errors["webhook_configs"])
        return
    hooks = _our_webhooks(view, settings.driver)
    if not hooks and not settings.webhook_url:
        yield warn(
            name,
            f"no ValidatingWebhookConfiguration has a webhook for {settings.driver}: "
            "claims and classes are not checked at admission",
            "install the controller: helm upgrade --reuse-values --set controller.enabled=true "
            "<release> deploy/helm/dra-gpu",
        )
        return
    if settings.webhook_url and len(hooks) > 1:
        hooks = hooks[:1]  # one address given: the first configuration's caBundle goes with it
    for i, (config, hook) in enumerate(hooks or [("", {})]):
        yield _one_webhook(name if i == 0 else f"{name}/{config}", config, hook, settings)


def _one_webhook(name: str, config: str, hook: Mapping[str, Any], settings: ClusterSettings) -> Result:
    client = hook.get("clientConfig") or {}
    svc = client.get("service") or {}
    url = settings.webhook_url or client.get("url")
    via_service = not url and bool(svc)
    if not url:
        host = f"{svc.get('name')}.{svc.get('namespace')}.svc:{svc.get('port') or 443}"
        url = f"https://{host}{svc.get('path') or ''}"
    policy = hook.get("failurePolicy", "Fail")
    impact = (
        "the apiserver refuses every claim and class it covers (failurePolicy Fail)"
        if policy == "Fail"
        else "claims are admitted unchecked (failurePolicy Ignore)"
    )
    where = f" of {config}" if config else ""
    try:
        served = fetch(url, client.get("caBundle"), settings.timeout)
    except socket.gaierror as exc:
        if via_service:
            return warn(
                name,
                f"cannot resolve {url} from here ({exc.strerror}): outside the cluster?",
                "kubectl -n NAMESPACE port-forward svc/NAME 8443:443, "
                "then --webhook-url https://127.0.0.1:8443/validate",
            )
        return fail(name, f"cannot resolve {url}: {exc.strerror}", "fix the webhook's clientConfig")
    except (OSError, CertificateError) as exc:
        return fail(
            name,
            f"webhook{where} at {url} unreachable ({getattr(exc, 'strerror', None) or exc}): {impact}",
            "check the controller pod (`kubectl -n NAMESPACE get pods "
            "-l app.kubernetes.io/component=controller`) and its Service",
        )
    now = datetime.datetime.now(datetime.UTC)
    days = (served.not_after - now).total_seconds() / 86400
    until = served.not_after.strftime("%Y-%m-%d %H:%M UTC")
    renew = (
        "renew it: with cert-manager `cmctl renew`; with the chart's own certificate delete its Secret and "
        "`helm upgrade` (a new CA and certificate are made together)"
    )
    if days <= 0:
        return fail(name, f"the certificate served at {url} expired {until}: {impact}", renew)
    if served.trusted is False:
        return fail(
            name,
            f"the certificate served at {url} is not trusted by the caBundle{where} "
            f"({served.trust_error}): {impact}",
            "make caBundle and the serving certificate from the same CA (`helm upgrade` does both)",
        )
    if days < settings.cert_warn_days:
        return warn(name, f"the certificate served at {url} expires in {days:.0f} days ({until})", renew)
    trust = ", trusted by the caBundle" if served.trusted else ""
    return ok(name, f"{url} reachable; certificate valid until {until} ({days:.0f} days){trust}")


# ---------------------------------------------------------------- running them


SYNC_CHECKS: tuple[tuple[str, Callable[[ClusterView, ClusterSettings], Iterable[Result]]], ...] = (
    ("cluster/resource-api", check_resource_api),
    ("cluster/device-classes", check_device_classes),
    ("cluster/slices", check_node_slices),
    ("cluster/device-taints", check_device_taints),
    ("cluster/pending-pods", check_pending_pods),
    ("cluster/webhook", check_webhook),
)


async def _run(settings: ClusterSettings) -> list[Result]:
    try:
        kube = await asyncio.wait_for(Kube.connect(settings.kubeconfig), settings.timeout)
    except Exception as exc:
        return [
            skip(
                "cluster/api-server",
                f"no usable kubeconfig: {first_line(exc)}",
            )
        ]
    try:
        try:
            view = await load_view(kube, settings.namespace, settings.timeout)
        except Exception as exc:  # refused, TLS, credentials, timeouts, HTTP errors: one verdict
            why = first_line(exc)
            return [
                fail(
                    "cluster/api-server",
                    f"API server not reachable: {why}",
                    "check the kubeconfig's server and credentials (`kubectl get --raw /version`)",
                )
            ]
        results = [ok("cluster/api-server", f"{view.server_version} reachable")]
        for what, why in sorted(view.errors.items()):
            results.append(
                warn(f"cluster/list/{what}", why, "give doctor's credentials list/get on it (RBAC)")
            )
        results.extend(
            await _guarded_async("cluster/dra-features", lambda: check_dra_features(kube, view, settings))
        )
        for check, fn in SYNC_CHECKS:
            results.extend(guarded(check, _bind(fn, view, settings)))
        return results
    finally:
        await kube.close()


def _bind(
    fn: Callable[[ClusterView, ClusterSettings], Iterable[Result]],
    view: ClusterView,
    settings: ClusterSettings,
) -> Callable[[], Iterable[Result]]:
    return lambda: fn(view, settings)


async def _guarded_async(check: str, run: Callable[[], Awaitable[Iterable[Result]]]) -> list[Result]:
    try:
        return list(await run())
    except Exception as exc:
        return [crashed(check, exc)]


def run_cluster_checks(settings: ClusterSettings) -> list[Result]:
    return asyncio.run(_run(settings))
