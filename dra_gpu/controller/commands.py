"""`dra-gpu validate`, `dra-gpu explain` and `dra-gpu controller`: argparse wiring and the offline fronts.

The CEL engine and the webhook's HTTP stack are imported by the handlers, so other subcommands of
`dra-gpu` (the kubelet plugin) neither load nor need them.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from dra_gpu.common.exit_codes import EXIT_INVALID, EXIT_OK, EXIT_UNALLOCATABLE, EXIT_USAGE
from dra_gpu.common.output_format import add_output_flag, dump
from dra_gpu.controller.inputs import InputError, Inputs, load_cluster, load_files
from dra_gpu.controller.workload_claims import (
    ClaimToExplain,
    References,
    allocation_of,
    claims_to_explain,
    is_allocated,
    pod_claim_entries,
)
from dra_gpu.model import nvidia_compat
from dra_gpu.model.device_classes import chart_device_classes
from dra_gpu.model.inventory import DEFAULT_DRIVER_NAME

if TYPE_CHECKING:
    from dra_gpu.controller.explain import SharedValue
    from dra_gpu.controller.rules import Verdict

# ---------------------------------------------------------------- the driver name


def _driver(args: argparse.Namespace) -> str | None:
    """The driver name --driver-name and --nvidia-compatible give; None (said on stderr) when
    they contradict each other. Running as gpu.nvidia.com is NVIDIA-compatible mode however it was
    asked for (the chart passes only --driver-name): args.nvidia_compatible is set then."""
    try:
        driver = nvidia_compat.driver_name(args.driver_name, args.nvidia_compatible)
    except nvidia_compat.DriverNameError as exc:
        print(f"dra-gpu {args.command}: {exc}", file=sys.stderr)
        return None
    args.nvidia_compatible = driver == nvidia_compat.DRIVER_NAME
    return driver


def _with_chart_classes(classes: list[dict[str, Any]], driver: str) -> list[dict[str, Any]]:
    """`classes` and the chart's DeviceClasses for `driver` that none of them names: a user's
    claims name the chart's classes without shipping them."""
    known = {str((c.get("metadata") or {}).get("name") or "") for c in classes}
    return classes + [c for c in chart_device_classes(driver) if c["metadata"]["name"] not in known]


# ---------------------------------------------------------------- validate


def cmd_validate(args: argparse.Namespace) -> int:
    from dra_gpu.controller.bounded import OverBudget, run_bounded
    from dra_gpu.controller.extended_resources import gpu_requests, workload_verdict
    from dra_gpu.controller.rules import Problem, Validator, Verdict  # the CEL engine loads only here

    driver = _driver(args)
    if driver is None:
        return EXIT_USAGE
    try:
        inputs = load_files(args.filename)
        cluster = _read_cluster(args, inputs)
    except InputError as exc:
        print(f"dra-gpu: {exc}", file=sys.stderr)
        return EXIT_USAGE
    invalid = bool(inputs.problems)
    for line in inputs.problems if args.output == "text" else ():
        print(line)
    # Files such as the examples hold Pods and other workload objects beside the claims: those
    # are not DRA objects and are skipped with a note, unless they ask for nvidia.com/gpu or
    # nvidia.com/mig-* (served through a DeviceClass's extendedResourceName); anything of the
    # resource.k8s.io group (or with no apiVersion at all) is checked and an unsupported kind
    # there is an error.
    others, workloads, claim_users = [], [], []
    for obj in inputs.others:
        group = str(obj.get("apiVersion") or "").rpartition("/")[0]
        if obj.get("apiVersion") and obj.get("kind") and group != "resource.k8s.io":
            if gpu_requests(obj):
                workloads.append(obj)
                continue
            if pod_claim_entries(obj):
                claim_users.append(obj)
                continue
            meta = obj.get("metadata") or {}
            where = f"{inputs.file_of(obj)}: " if inputs.from_directory else ""
            print(f"{where}{obj['kind']}/{meta.get('name', '?')}: skipped: not a DRA object", file=sys.stderr)
        else:
            others.append(obj)
    to_check = inputs.classes + [c for c in inputs.claims if not is_allocated(c)] + others
    validator = Validator(
        driver,
        inputs.slices,
        _with_chart_classes(inputs.classes, driver),
        [c for c in inputs.claims if is_allocated(c)],
        nvidia_compatible=args.nvidia_compatible,
    )
    references = References(
        (cluster.claims if cluster else []) + inputs.claims,
        (cluster.others if cluster else []) + inputs.others,
        cluster_read=cluster is not None,
    )
    if not to_check and not workloads and not claim_users and not inputs.problems:
        print("dra-gpu: no DeviceClass, ResourceClaim or ResourceClaimTemplate in the input", file=sys.stderr)
        return EXIT_USAGE
    # A directory is a report: every object gets a line, in the input's order, each line names
    # the file it came from.
    report = inputs.from_directory
    judged = [(o, "object") for o in to_check] + [(o, "resources") for o in workloads]
    judged += [(o, "claims") for o in claim_users]
    if report:
        judged.sort(key=lambda item: inputs.place_of(item[0]))
    document: list[dict[str, Any]] = []
    for obj, how in judged:
        try:  # bounded: a selector too costly to evaluate costs this object its verdict, no more
            if how == "resources":
                verdict = workload_verdict(validator, obj)
            elif how == "claims":
                verdict = references.verdict(obj)
            else:
                verdict = run_bounded(lambda obj=obj: validator.validate(obj))  # type: ignore[misc]
        except OverBudget as exc:
            meta = obj.get("metadata") or {}
            name = str(meta.get("name") or meta.get("generateName") or "?")
            verdict = Verdict(
                str(obj.get("kind") or "?"), name, errors=[Problem("(object)", f"validation {exc}")]
            )
        invalid = invalid or not verdict.allowed
        if args.output != "text":
            document.append(_verdict_document(verdict, inputs.file_of(obj), driver))
            continue
        where = f"{inputs.file_of(obj) or '(cluster)'}: " if report else ""
        for line in verdict.lines() or ([_passed(verdict, driver)] if report else []):
            print(where + line)
        for line in verdict.warning_lines():
            print(where + line, file=sys.stderr)
    if args.output != "text":
        print(
            dump({"objects": document, "problems": inputs.problems, "valid": not invalid}, args.output),
            end="",
        )
    return EXIT_INVALID if invalid else EXIT_OK


def _verdict_document(verdict: Verdict, file: str, driver: str) -> dict[str, Any]:
    """One object's verdict for -o json|yaml."""
    return {
        "kind": verdict.kind,
        "namespace": verdict.namespace,
        "name": verdict.name,
        "file": file,
        "valid": verdict.allowed,
        "concernsDriver": verdict.concerned,
        "summary": _passed(verdict, driver) if verdict.allowed else "",
        "errors": [{"path": p.path, "message": p.message} for p in verdict.errors],
        "warnings": [{"path": p.path, "message": p.message} for p in verdict.warnings],
    }


def _passed(verdict: Verdict, driver: str) -> str:
    """The report line of an object without errors."""
    who = f"{verdict.kind}/{verdict.name}"
    if verdict.kind == "DeviceClass":
        if verdict.concerned:
            return f"{who}: selects devices of dra-gpu ({driver})"
        return f"{who}: selects no device of {driver}: not dra-gpu's, left as it is"
    if verdict.concerned:
        return f"{who}: runs on dra-gpu"
    return f"{who}: asks for no device of {driver}: not dra-gpu's, left as it is"


def _key(obj: dict[str, Any]) -> tuple[str, str, str]:
    meta = obj.get("metadata") or {}
    return (str(obj.get("kind")), str(meta.get("namespace") or ""), str(meta.get("name") or ""))


# ---------------------------------------------------------------- explain


@contextlib.contextmanager
def _heap_frozen() -> Iterator[None]:
    """Keep the objects that exist now (the inputs: ~10^5 dicts for 100 nodes) out of the garbage
    collector's passes until the block ends: a full collection, which the devices and caches
    built meanwhile set off, would walk all of them (~50 ms) and could free none."""
    if gc.get_freeze_count():  # the caller froze the heap itself: its choice stands
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def explain_inputs(
    inputs: Inputs,
    driver: str = DEFAULT_DRIVER_NAME,
    bounded: bool = False,
    nvidia_compatible: bool = False,
    to_explain: list[ClaimToExplain] | None = None,
) -> dict[str, Any]:
    """Each claim's simulated allocation: `to_explain` (default: the input's unallocated claims).
    `bounded` (the command line): each claim in a forked child with a deadline and a memory cap
    (not from a process with threads: the doctor). `nvidia_compatible`: the rules refuse what of
    NVIDIA's driver dra-gpu does not do."""
    if to_explain is None:
        to_explain = claims_to_explain(inputs.claims, [])
    with _heap_frozen():
        return _explain_inputs(inputs, driver, bounded, nvidia_compatible, to_explain)


def _explain_inputs(
    inputs: Inputs, driver: str, bounded: bool, nvidia_compatible: bool, to_explain: list[ClaimToExplain]
) -> dict[str, Any]:
    from dra_gpu.controller.bounded import OverBudget, run_bounded_each
    from dra_gpu.controller.explain import explain, shared_values
    from dra_gpu.controller.rules import ProblemKind, Validator

    allocated = [c for c in inputs.claims if is_allocated(c)]
    # One view of the cluster for the rules and the simulation: selector results and candidate
    # lists are worked out once, and the rules' "right now" check is the explanation itself.
    validator = Validator(
        driver, inputs.slices, inputs.classes, allocated, nvidia_compatible=nvidia_compatible
    )
    cluster = validator.cluster
    cluster.explained = {}
    if bounded:
        cluster.warm()
    steps: list[tuple[dict[str, Any], Callable[[], dict[str, Any]]]] = []
    ordered: list[dict[str, Any]] = []  # every entry, in the order asked
    answered: list[dict[str, Any]] = []  # those answered without a simulation
    for item in to_explain:
        entry: dict[str, Any] = {
            "namespace": item.namespace,
            "name": item.name,
            "source": item.source,  # "": a ResourceClaim given as it is
            "usedBy": item.users,  # the workloads whose pods use it
            "allocatable": False,
            "allocated": False,  # True: allocated already (node and devices are the allocation's)
            "invalid": False,  # True: the claim (or a reference to it) is wrong, not just unplaceable
            "node": "",
            "devices": [],
            "results": [],
            "linkCost": 0,
            "bestDevices": [],
            "bestLinkCost": 0,
            # What each matchAttribute constraint holds equal in the placement: {attribute, value,
            # requests, drivers} (a GPU and another driver's NIC on one PCIe root).
            "sharedAttributes": [],
            "reason": "",
            "simulated": True,  # False: a selector uses Kubernetes CEL functions dra-gpu does not model
            "concernsDriver": True,  # False: no request asks for the driver's devices
        }
        ordered.append(entry)
        claim = item.claim
        if claim is None:
            entry.update(invalid=True, reason=item.problem)
            answered.append(entry)
            continue
        if is_allocated(claim):
            node, devices = allocation_of(claim)
            entry.update(allocatable=True, allocated=True, node=node, devices=devices)
            answered.append(entry)
            continue

        def one(claim: dict[str, Any] = claim, entry: dict[str, Any] = entry) -> dict[str, Any]:
            verdict = validator.validate({**claim, "status": {}})
            entry["concernsDriver"] = verdict.concerned
            if verdict.errors and not any(p.kind is ProblemKind.UNSATISFIABLE for p in verdict.errors):
                entry["invalid"] = True
                entry["reason"] = "; ".join(f"{p.path}: {p.message}" for p in verdict.errors)
                return entry
            spec: dict[str, Any] = claim["spec"] if isinstance(claim.get("spec"), dict) else {}
            e = explain(cluster, spec)
            if e.allocatable and e.placement is not None and e.best is not None:
                entry.update(
                    allocatable=True,
                    node=e.placement.node,
                    devices=e.placement.devices,
                    results=[
                        _result(r, d, used)
                        for (r, d), used in zip(e.placement.results, e.placement.consumed, strict=True)
                    ],
                    linkCost=e.placement.link_cost,
                    bestDevices=e.best.devices,
                    bestLinkCost=e.best.link_cost,
                    sharedAttributes=[
                        {
                            "attribute": v.attribute,
                            "value": v.value,
                            "requests": list(v.requests),
                            "drivers": list(v.drivers),
                        }
                        for v in shared_values(spec, e.placement)
                    ],
                )
            else:
                entry.update(reason=e.reason, simulated=e.simulated)
            return entry

        steps.append((entry, one))
    if not bounded:
        simulated = [one() for _, one in steps]
    else:
        simulated = []
        for (entry, _), answer in zip(steps, run_bounded_each([one for _, one in steps]), strict=True):
            if isinstance(answer, OverBudget):
                entry["reason"] = f"simulation {answer}"
                answer = entry
            simulated.append(answer)
    # The answers of forked children are copies: each matched to its entry by position.
    by_id = {id(e): a for (e, _), a in zip(steps, simulated, strict=True)}
    by_id |= {id(e): e for e in answered}
    return {"claims": [by_id[id(e)] for e in ordered]}


def _result(request: str, d: Any, consumed: dict[str, Any]) -> dict[str, Any]:
    """An allocation result as the scheduler would write it; a share says what it consumes
    (request policy applied: rounded up to a valid amount)."""
    from dra_gpu.kube.values import format_quantity

    out: dict[str, Any] = {"request": request, "driver": d.driver, "pool": d.pool, "device": d.name}
    if consumed:
        out["consumedCapacity"] = {k: format_quantity(v) for k, v in sorted(consumed.items())}
    return out


def _shared(v: dict[str, Any]) -> SharedValue:
    from dra_gpu.controller.explain import SharedValue

    return SharedValue(str(v["attribute"]), str(v["value"]), tuple(v["requests"]), tuple(v["drivers"]))


def render_text(result: dict[str, Any], wide: bool = False) -> str:
    """One line a claim (and a line for each share it consumes, each value a constraint holds
    equal across drivers, each cheaper placement); `wide`: also each request's device and pool,
    and the workloads that use the claim."""
    lines = []
    for c in result["claims"]:
        head = f"{c['namespace']}/{c['name']}"
        if c.get("source"):
            head += f" ({c['source']})"
        head += ":"
        if c.get("allocated"):
            lines.append(
                f"{head} allocated already: node {c['node'] or '?'}, devices {', '.join(c['devices'])}"
            )
        elif not c["allocatable"]:
            verdict = "invalid" if c.get("invalid") else "not allocatable"
            verdict = verdict if c.get("simulated", True) else "cannot be simulated"
            lines.append(f"{head} {verdict}: {c['reason']}")
        else:
            lines.append(
                f"{head} node {c['node']}, devices {', '.join(c['devices'])} (link cost {c['linkCost']})"
            )
        if wide and len(c.get("usedBy") or []) > 1:
            lines.append(f"  used by {', '.join(c['usedBy'])}")
        for r in c["results"]:
            if wide:
                lines.append(f"  request {r['request']}: {r['driver']} pool {r['pool']} device {r['device']}")
            if r.get("consumedCapacity"):
                used = ", ".join(f"{k} {v}" for k, v in r["consumedCapacity"].items())
                lines.append(f"  {r['device']}: a share consuming {used}")
        if not c["allocatable"] or c.get("allocated"):
            continue
        for shared in map(_shared, c.get("sharedAttributes") or []):
            if shared.spans_drivers:  # "gpu and nic on pcieRoot pci0000:16": said where drivers meet
                lines.append(f"  {shared.describe()}")
        if c["bestLinkCost"] < c["linkCost"]:
            lines.append(
                f"  a cheaper placement on {c['node']}: {', '.join(c['bestDevices'])} "
                f"(link cost {c['bestLinkCost']})"
            )
    return "\n".join(lines)


def cmd_explain(args: argparse.Namespace) -> int:
    driver = _driver(args)
    if driver is None:
        return EXIT_USAGE
    try:
        inputs = load_files(args.filename)
        cluster = _read_cluster(args, inputs)
    except InputError as exc:
        print(f"dra-gpu: {exc}", file=sys.stderr)
        return EXIT_USAGE
    for line in inputs.problems:
        print(line, file=sys.stderr)
    if inputs.problems:
        return EXIT_INVALID
    to_explain = claims_to_explain(
        inputs.claims,
        inputs.others,
        cluster.claims if cluster else (),
        cluster.others if cluster else (),
        cluster_read=cluster is not None,
    )
    if not to_explain:
        print(
            "dra-gpu: nothing to explain: no unallocated ResourceClaim, no ResourceClaimTemplate and no "
            "workload with spec.resourceClaims in the input",
            file=sys.stderr,
        )
        return EXIT_USAGE
    if not inputs.slices:
        print(
            "dra-gpu: warning: no ResourceSlice in the input: give the cluster (--kubeconfig/--context) "
            "or files of slices (kubectl get resourceslices -o yaml)",
            file=sys.stderr,
        )
    inputs.classes = _with_chart_classes(inputs.classes, driver)
    result = explain_inputs(
        inputs, driver, bounded=True, nvidia_compatible=args.nvidia_compatible, to_explain=to_explain
    )
    if args.output in ("json", "yaml"):
        print(dump(result, args.output), end="")
    else:
        print(render_text(result, wide=args.output == "wide"))
    if any(c["invalid"] for c in result["claims"]):
        return EXIT_INVALID
    return EXIT_OK if all(c["allocatable"] for c in result["claims"]) else EXIT_UNALLOCATABLE


def _read_cluster(args: argparse.Namespace, inputs: Inputs) -> Inputs | None:
    """With --kubeconfig or --context: the cluster's objects (None without). Its slices, classes
    and allocated claims join `inputs` where the files have no object of the same name (the files
    win: "what if" this class were so); its templates and unallocated claims are returned, for the
    references of the input's workloads."""
    if not (args.kubeconfig or args.context):
        return None
    cluster = Inputs()
    load_cluster(args.kubeconfig, cluster, context=args.context, templates=True)
    in_files = {_key(o) for o in inputs.slices + inputs.classes + inputs.claims}
    inputs.slices += [o for o in cluster.slices if _key(o) not in in_files]
    inputs.classes += [o for o in cluster.classes if _key(o) not in in_files]
    inputs.claims += [o for o in cluster.claims if _key(o) not in in_files and is_allocated(o)]
    return cluster


# ---------------------------------------------------------------- controller


def cmd_controller(args: argparse.Namespace) -> int:
    from dra_gpu.controller.webhook import WebhookConfig, run

    if args.client_name and not args.client_ca:
        print("dra-gpu controller: --client-name needs --client-ca", file=sys.stderr)
        return EXIT_USAGE
    driver = _driver(args)
    if driver is None:
        return EXIT_USAGE
    return run(
        WebhookConfig(
            cert=args.cert,
            key=args.key,
            address=args.address,
            port=args.port,
            driver=driver,
            nvidia_compatible=args.nvidia_compatible,
            kubeconfig=args.kubeconfig,
            watch=not args.no_watch,
            files=tuple(args.filename),
            max_in_flight=args.max_in_flight,
            client_ca=args.client_ca,
            client_names=tuple(args.client_name),
            metrics_port=args.metrics_port,
        )
    )


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _add_driver_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--driver-name",
        default=None,
        help=f"DRA driver name (default: {DEFAULT_DRIVER_NAME}; {nvidia_compat.DRIVER_NAME} with "
        "--nvidia-compatible)",
    )
    parser.add_argument(
        "--nvidia-compatible",
        action="store_true",
        help=f"as NVIDIA's DRA driver: driver and class names {nvidia_compat.GPU_CLASS} and "
        f"{nvidia_compat.MIG_CLASS}, and claims for what of NVIDIA's driver dra-gpu does not do "
        "(VFIO, ComputeDomains/IMEX) refused with the reason",
    )


def _add_cluster_flags(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--kubeconfig", metavar="PATH", help=f"also read the cluster's {what} (the kubeconfig's cluster)"
    )
    parser.add_argument(
        "--context",
        metavar="NAME",
        help="with the kubeconfig's context NAME (--kubeconfig, else $KUBECONFIG or ~/.kube/config)",
    )


def add_commands(sub: Any) -> dict[str, Callable[[argparse.Namespace], int]]:
    """Add the controller's subcommands to `sub` (argparse subparsers); returns name -> handler."""
    v = sub.add_parser("validate", help="validate DeviceClasses, ResourceClaims and templates offline")
    v.add_argument(
        "-f",
        "--filename",
        action="append",
        required=True,
        metavar="FILE",
        help="YAML/JSON file ('-' for stdin), or a directory: its *.yaml, *.yml and *.json files, "
        "recursively, and a line for every object, naming its file; may hold ResourceSlices used for "
        "feasibility",
    )
    _add_cluster_flags(v, "slices, classes and allocated claims")
    add_output_flag(v)
    _add_driver_flags(v)
    e = sub.add_parser("explain", help="simulate the scheduler's allocation of claims against slices")
    e.add_argument(
        "-f",
        "--filename",
        action="append",
        required=True,
        metavar="FILE",
        help="YAML/JSON file ('-' for stdin) or directory: ResourceClaims, ResourceClaimTemplates and "
        "workloads (Pods, Deployments, Jobs...: their spec.resourceClaims resolved) to explain, and "
        "ResourceSlices, DeviceClasses and allocated claims to explain them against",
    )
    _add_cluster_flags(e, "slices, classes, allocated claims and the templates workloads name")
    add_output_flag(e, wide=True)
    _add_driver_flags(e)
    c = sub.add_parser("controller", help="run the validating admission webhook (HTTPS)")
    c.add_argument("--cert", required=True, help="TLS certificate file (PEM); reloaded when it changes")
    c.add_argument("--key", required=True, help="TLS private key file (PEM); reloaded when it changes")
    c.add_argument("--address", default="0.0.0.0", help="listen address")
    c.add_argument("--port", type=int, default=8443, help="listen port")
    _add_driver_flags(c)
    c.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="also serve /metrics, /healthz and /readyz over plain HTTP on this port (0: off)",
    )
    c.add_argument(
        "--max-in-flight",
        type=_positive_int,
        default=16,
        help="reviews at once; more are answered 429 with Retry-After, which the apiserver retries",
    )
    c.add_argument(
        "--client-ca",
        metavar="FILE",
        help="CA (PEM) of the apiserver's client certificate: clients without one it signed are refused",
    )
    c.add_argument(
        "--client-name",
        action="append",
        default=[],
        metavar="NAME",
        help="with --client-ca: the client certificate's CN or a DNS SAN must be one of these (repeatable)",
    )
    c.add_argument("--kubeconfig", metavar="PATH", help="kubeconfig (default: in-cluster config)")
    c.add_argument(
        "--no-watch",
        action="store_true",
        help="do not watch the cluster (no feasibility checks); for tests and local runs",
    )
    c.add_argument(
        "-f",
        "--filename",
        action="append",
        default=[],
        metavar="FILE",
        help="static slices/classes/claims to use as the cluster view (with --no-watch)",
    )
    return {"validate": cmd_validate, "explain": cmd_explain, "controller": cmd_controller}
