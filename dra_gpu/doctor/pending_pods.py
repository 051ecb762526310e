"""Why each Pending pod with claims of the driver is Pending: a claim not created yet, a class that
does not exist, only tainted devices that fit, no devices that fit (`explain`'s reason), a prepare
the kubelet plugin refused, or a pod scheduled but not starting."""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterable, Mapping
from typing import Any

from dra_gpu.controller.workload_claims import is_allocated
from dra_gpu.doctor.cluster_view import FAILED_PREPARE, ClusterView, object_meta, object_name, object_spec
from dra_gpu.doctor.device_taints import slices_with_rule_taints
from dra_gpu.doctor.report import Result, fail, ok, skip, warn
from dra_gpu.doctor.settings import ClusterSettings

STARTING_GRACE_SECONDS = 60  # a scheduled pod younger than this is still starting, not stuck


def _class_names(spec: Mapping[str, Any]) -> list[str]:
    out = []
    for r in (spec.get("devices") or {}).get("requests") or []:
        if isinstance(r.get("exactly"), dict):
            out.append(str(r["exactly"].get("deviceClassName")))
        for sub in r.get("firstAvailable") or []:
            out.append(str(sub.get("deviceClassName")))
    return out


class PendingPods:
    """Why each Pending pod with claims of this driver is Pending."""

    def __init__(self, view: ClusterView, settings: ClusterSettings) -> None:
        self.view, self.settings = view, settings
        driver = settings.driver
        self.classes = {object_name(c) for c in view.classes}
        self.our_classes = set(settings.class_names) | {
            object_name(c)
            for c in view.classes
            if f"'{driver}'" in json.dumps(c.get("spec")).replace('"', "'")
        }
        self.claims = {(str(object_meta(c).get("namespace")), object_name(c)): c for c in view.claims}

    def ours(self, claim: Mapping[str, Any]) -> bool:
        if any(c in self.our_classes for c in _class_names(object_spec(claim))):
            return True
        results = (((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get(
            "results"
        ) or []
        return any(r.get("driver") == self.settings.driver for r in results)

    def pod_claims(self, pod: Mapping[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
        """(the pod's claims that exist, the names of those not created yet)."""
        ns = str(object_meta(pod).get("namespace"))
        made = {
            s.get("name"): s.get("resourceClaimName")
            for s in (pod.get("status") or {}).get("resourceClaimStatuses") or []
        }
        found, missing = [], []
        for rc in object_spec(pod).get("resourceClaims") or []:
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
                for d in object_spec(s).get("devices") or []:
                    d.pop("taints", None)
        in_use = [c for c in self.view.claims if is_allocated(c)]
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
        unallocated = [c for _, claims, _ in pods for c in claims if not is_allocated(c)]
        verdicts = self.explain(unallocated, ignore_taints=False) if unallocated else {}
        blocked = [c for c in unallocated if not verdicts.get(self._key(c), {}).get("allocatable", True)]
        untainted = self.explain(blocked, ignore_taints=True) if blocked else {}
        return [self._one(pod, claims, missing, verdicts, untainted) for pod, claims, missing in pods]

    @staticmethod
    def _key(claim: Mapping[str, Any]) -> tuple[str, str]:
        return (str(object_meta(claim).get("namespace") or "default"), object_name(claim))

    def _one(
        self,
        pod: Mapping[str, Any],
        claims: list[dict[str, Any]],
        missing: list[str],
        verdicts: Mapping[tuple[str, str], Mapping[str, Any]],
        untainted: Mapping[tuple[str, str], Mapping[str, Any]],
    ) -> Result:
        ns, pod_name = str(object_meta(pod).get("namespace")), object_name(pod)
        name = f"cluster/pending/{ns}/{pod_name}"
        node = object_spec(pod).get("nodeName")
        if not node:
            for claim in claims:
                if is_allocated(claim):
                    continue
                key = self._key(claim)
                verdict = verdicts.get(key, {})
                if verdict.get("allocatable", True):
                    continue
                absent = [c for c in _class_names(object_spec(claim)) if c not in self.classes]
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
        age = _age_seconds(object_meta(pod).get("creationTimestamp"))
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
