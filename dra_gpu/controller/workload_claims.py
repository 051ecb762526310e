"""The claims that the manifests users apply stand for, so that `explain` answers for them as the
scheduler would see them: a ResourceClaim as it is, a ResourceClaimTemplate as the claim the
kubelet's controller makes from it, and a workload (a Pod, or the pod template of a Deployment,
Job, StatefulSet...) as each `spec.resourceClaims` entry of its pods resolved to the claim it
names or a claim made from the template it names.

References are looked up among the input's objects first, then the cluster's (when it was read),
in the workload's namespace, as the apiserver does. A workload's claims are explained one by one;
the scheduler puts a pod's claims on one node, which a claim explained alone may not be.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dra_gpu.controller.rules import Verdict

# Where each workload kind holds its pod spec.
POD_SPEC_PATHS: Mapping[str, tuple[str, ...]] = {
    "Pod": ("spec",),
    "PodTemplate": ("template", "spec"),
    "Deployment": ("spec", "template", "spec"),
    "ReplicaSet": ("spec", "template", "spec"),
    "StatefulSet": ("spec", "template", "spec"),
    "DaemonSet": ("spec", "template", "spec"),
    "ReplicationController": ("spec", "template", "spec"),
    "Job": ("spec", "template", "spec"),
    "CronJob": ("spec", "jobTemplate", "spec", "template", "spec"),
}
TEMPLATE = "ResourceClaimTemplate"
CLAIM = "ResourceClaim"
# The apiserver's name limit for what the claim made from a template is called here.
_MAX_NAME = 253


def namespace_of(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata")
    return str((meta if isinstance(meta, Mapping) else {}).get("namespace") or "default")


def name_of(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata")
    meta = meta if isinstance(meta, Mapping) else {}
    return str(meta.get("name") or meta.get("generateName") or "")


def pod_spec(obj: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The pod spec a workload holds (None: not a workload kind, or none there)."""
    where = POD_SPEC_PATHS.get(str(obj.get("kind")))
    if where is None:
        return None
    spec: Any = obj
    for key in where:
        spec = spec.get(key) if isinstance(spec, Mapping) else None
    return spec if isinstance(spec, Mapping) else None


def pod_claim_entries(obj: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """A workload's `resourceClaims` entries (empty for anything else)."""
    spec = pod_spec(obj)
    entries = spec.get("resourceClaims") if spec is not None else None
    return [e for e in entries if isinstance(e, Mapping)] if isinstance(entries, list) else []


def claim_from_template(template: Mapping[str, Any], name: str, namespace: str) -> dict[str, Any]:
    """The ResourceClaim made from `template` (its spec.spec), called `name` here."""
    spec = template.get("spec")
    claim_spec = spec.get("spec") if isinstance(spec, Mapping) else None
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": CLAIM,
        "metadata": {"name": name[:_MAX_NAME], "namespace": namespace},
        "spec": dict(claim_spec) if isinstance(claim_spec, Mapping) else {},
    }


@dataclass
class ClaimToExplain:
    """One claim to explain: `claim` (None: a reference that could not be resolved, `problem`
    says why), where it came from (`source`: "" for a ResourceClaim given as it is)."""

    namespace: str
    name: str
    claim: dict[str, Any] | None
    source: str = ""
    problem: str = ""
    users: list[str] = field(default_factory=list)  # the workloads whose pods use it


def _key(obj: Mapping[str, Any]) -> tuple[str, str]:
    return namespace_of(obj), name_of(obj)


class References:
    """The claims and templates a workload's `resourceClaims` may name, by namespace and name;
    of two with one name, the later given wins (the input's over the cluster's)."""

    def __init__(
        self, claims: Iterable[dict[str, Any]], others: Iterable[dict[str, Any]], cluster_read: bool = False
    ) -> None:
        self.claims = {_key(c): c for c in claims}
        self.templates = {_key(o): o for o in others if o.get("kind") == TEMPLATE}
        # The cluster was read: a reference found nowhere is missing, not just left out of the input.
        self.cluster_read = cluster_read

    def missing(self, kind: str, namespace: str, name: str) -> str:
        where = (
            "not in the input nor in the cluster"
            if self.cluster_read
            else "not in the input (give its manifest with -f, or the cluster with --kubeconfig/--context)"
        )
        return f"{kind} {namespace}/{name} is {where}"

    def verdict(self, obj: Mapping[str, Any]) -> Verdict:
        """A workload's `resourceClaims` checked: each names a claim or template there is (an error
        once the cluster was read; a warning otherwise, the input being maybe only part of it)."""
        from dra_gpu.controller.rules import Problem, Verdict  # the CEL engine loads with the rules

        ns = namespace_of(obj)
        v = Verdict(str(obj.get("kind")), name_of(obj) or "?", ns, concerned=True)
        path = ".".join(POD_SPEC_PATHS.get(str(obj.get("kind")), ("spec",)))
        for i, entry in enumerate(pod_claim_entries(obj)):
            where = f"{path}.resourceClaims[{i}]"
            template, claim = entry.get("resourceClaimTemplateName"), entry.get("resourceClaimName")
            if isinstance(template, str) and template:
                problem = None if (ns, template) in self.templates else self.missing(TEMPLATE, ns, template)
                where += ".resourceClaimTemplateName"
            elif isinstance(claim, str) and claim:
                problem = None if (ns, claim) in self.claims else self.missing(CLAIM, ns, claim)
                where += ".resourceClaimName"
            else:
                v.errors.append(
                    Problem(where, "names neither resourceClaimName nor resourceClaimTemplateName")
                )
                continue
            if problem is not None:
                (v.errors if self.cluster_read else v.warnings).append(Problem(where, problem))
        return v


def claims_to_explain(
    claims: Iterable[dict[str, Any]],
    others: Iterable[dict[str, Any]],
    cluster_claims: Iterable[dict[str, Any]] = (),
    cluster_templates: Iterable[dict[str, Any]] = (),
    cluster_read: bool = False,
) -> list[ClaimToExplain]:
    """What to explain: each unallocated ResourceClaim, then each template, then each workload's
    claims, in the input's order (a claim or template a workload uses is explained under its users).
    `cluster_read`: the cluster was read, so a reference found nowhere is missing, not just left
    out of the input."""
    claims = list(claims)
    others = list(others)
    refs = References([*cluster_claims, *claims], [*cluster_templates, *others], cluster_read)
    out: list[ClaimToExplain] = []
    by_claim: dict[tuple[str, str], ClaimToExplain] = {}
    used_templates: set[tuple[str, str]] = set()
    for obj in others:
        entries = pod_claim_entries(obj)
        if not entries:
            continue
        ns, workload = namespace_of(obj), f"{obj.get('kind')}/{name_of(obj)}"
        for i, entry in enumerate(entries):
            entry_name = str(entry.get("name") or f"resourceClaims[{i}]")
            template_name = entry.get("resourceClaimTemplateName")
            claim_name = entry.get("resourceClaimName")
            if isinstance(template_name, str) and template_name:
                used_templates.add((ns, template_name))
                source = f"{workload}, claim {entry_name}: {TEMPLATE}/{template_name}"
                made_name = f"{name_of(obj)}-{entry_name}"
                template = refs.templates.get((ns, template_name))
                if template is None:
                    problem = refs.missing(TEMPLATE, ns, template_name)
                    out.append(ClaimToExplain(ns, made_name, None, source, problem, [workload]))
                else:
                    claim = claim_from_template(template, made_name, ns)
                    out.append(ClaimToExplain(ns, made_name, claim, source, users=[workload]))
            elif isinstance(claim_name, str) and claim_name:
                key = (ns, claim_name)
                if key in by_claim:  # pods sharing one claim: one answer, naming them all
                    by_claim[key].users.append(workload)
                    continue
                found = refs.claims.get(key)
                problem = "" if found is not None else refs.missing(CLAIM, ns, claim_name)
                item = ClaimToExplain(
                    ns, claim_name, found, f"{workload}, claim {entry_name}", problem, [workload]
                )
                by_claim[key] = item
                out.append(item)
            else:
                problem = (
                    f"spec.resourceClaims[{i}]: names neither resourceClaimName nor resourceClaimTemplateName"
                )
                out.append(
                    ClaimToExplain(ns, f"{name_of(obj)}-{entry_name}", None, workload, problem, [workload])
                )
    own = [ClaimToExplain(*_key(c), c) for c in claims if not is_allocated(c) and _key(c) not in by_claim]
    made = [
        ClaimToExplain(ns, name, claim_from_template(t, name, ns), f"{TEMPLATE}/{name}")
        for t in others
        if t.get("kind") == TEMPLATE and (key := _key(t)) not in used_templates
        for ns, name in [key]
    ]
    return own + made + out


def allocation_of(claim: Mapping[str, Any]) -> tuple[str, list[str]]:
    """An allocated claim's node (from its node selector's metadata.name field, "" if none) and
    devices."""
    alloc = (claim.get("status") or {}).get("allocation") or {}
    devices = [
        str(r.get("device"))
        for r in (alloc.get("devices") or {}).get("results") or []
        if isinstance(r, Mapping)
    ]
    node = ""
    for term in (alloc.get("nodeSelector") or {}).get("nodeSelectorTerms") or []:
        for f in (term or {}).get("matchFields") or []:
            if f.get("key") == "metadata.name" and f.get("operator") == "In" and f.get("values"):
                node = str(f["values"][0])
    return node, devices


def is_allocated(claim: Mapping[str, Any]) -> bool:
    status = claim.get("status")
    return isinstance(status, Mapping) and bool(status.get("allocation"))
