"""`dra-gpu controller`: the validating admission webhook (AdmissionReview v1 over HTTPS).

One asyncio loop serves HTTPS (aiohttp, already a dependency of `kubernetes.aio`, so no second HTTP
stack) and keeps the cluster view current with list+watch loops (`dra_gpu.kube.api.list_watch`) on
ResourceSlices, DeviceClasses and ResourceClaims. The certificate and key are re-read when their files
change: the new chain is loaded into the live SSLContext, so new connections get it without a restart.

The rules themselves (CEL evaluation, quantity arithmetic) run in worker processes with a deadline
and a memory cap (review_pool.py), so one costly review never blocks the loop: /healthz and other
reviews keep answering, and the costly one is denied. Every review is decoded first (the
AdmissionReview's shape here, the object's in the rules), so a wrong type is a 400 or a deny,
never a 500.

Anything that reaches the port is bounded: at most `max_in_flight` reviews at once (the next is
answered 429 at once, see `Webhook.review`), a body must arrive within BODY_TIMEOUT, and metric
labels come from closed sets (a request's own kind or operation never becomes a series). With
`client_ca`, only clients with a certificate from that CA (the apiserver's, configured by its
AdmissionConfiguration) complete the TLS handshake.

Endpoints: POST /validate (also /), GET /healthz (liveness), GET /readyz (200 once the watch caches
have their first list), GET /metrics (Prometheus text). With `metrics_port`, /healthz, /readyz and
/metrics are also served over plain HTTP on that port (the kubelet's probes and Prometheus, which
present no client certificate). On SIGTERM it stops accepting connections, lets the reviews in
flight finish (at most SHUTDOWN_TIMEOUT seconds) and exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import re
import signal
import ssl
import sys
import time
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from dra_gpu.common.build_info import register_build_info
from dra_gpu.common.decoding import decode
from dra_gpu.common.exit_codes import EXIT_OK, EXIT_USAGE
from dra_gpu.common.log_format import V
from dra_gpu.controller import view_records
from dra_gpu.controller.cluster_state import ClusterState
from dra_gpu.controller.inputs import InputError, load_files
from dra_gpu.controller.review_pool import OverBudget, ReviewPool, ReviewResult
from dra_gpu.controller.rules import KINDS
from dra_gpu.controller.schemas import ADMISSION_REVIEW
from dra_gpu.kube.api import RESOURCE_V1, Backoff, Kube, list_watch
from dra_gpu.kube.bounds import IDENTITY_PREFIX, TOO_DEEP
from dra_gpu.model.inventory import DEFAULT_DRIVER_NAME

log = logging.getLogger(__name__)
MAX_REVIEW_BYTES = 4 * 1024 * 1024
ADMISSION_API = "admission.k8s.io/v1"
SHUTDOWN_TIMEOUT = 10.0  # well inside the pod's 30 s grace period
# The apiserver sends a review's body at once; a client that trickles one holds a review slot.
BODY_TIMEOUT = 2.0
# Label values of dra_gpu_admission_reviews_total: closed sets, whatever a request says.
KIND_LABELS = frozenset(KINDS)
OPERATION_LABELS = frozenset({"CREATE", "UPDATE", "DELETE", "CONNECT"})
OTHER = "other"  # any kind or operation outside those sets
MALFORMED = "?"  # a review whose kind and operation were never read
# Over max_in_flight: 429 with Retry-After, which the apiserver's webhook client retries.
RETRY_AFTER_S = 1


@dataclass(frozen=True)
class WebhookConfig:
    """What `dra-gpu controller` was asked to serve; typed, so the webhook does not depend on argparse."""

    cert: str  # TLS certificate file (PEM), reloaded when it changes
    key: str  # TLS private key file (PEM), reloaded when it changes
    address: str = "0.0.0.0"
    port: int = 8443
    driver: str = DEFAULT_DRIVER_NAME
    nvidia_compatible: bool = False  # refuse what of NVIDIA's driver dra-gpu does not do (nvidia_compat)
    kubeconfig: str | None = None  # None: in-cluster config
    watch: bool = True  # False: no list+watch of the cluster (tests and local runs)
    files: tuple[str, ...] = ()  # static slices/classes/claims for the cluster view
    workers: int = 3  # processes that run the rules (CEL), so one costly review never blocks the loop
    review_deadline_s: float = 1.0  # a review still running then is denied and its worker replaced
    max_in_flight: int = 16  # reviews at once (bodies read or being validated); the next gets a 429
    client_ca: str | None = None  # CA file (PEM): require a client certificate it signed
    client_names: tuple[str, ...] = ()  # with client_ca: the certificate's CN or a DNS SAN must be one
    metrics_port: int = 0  # >0: plain-HTTP /metrics, /healthz, /readyz on this port too


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.reviews = Counter(
            "dra_gpu_admission_reviews_total",
            "Admission reviews by kind and result",
            ["kind", "operation", "result"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "dra_gpu_admission_duration_seconds",
            "Time to answer an admission review",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 1, 5),
            registry=self.registry,
        )
        # Not dra_gpu_published_devices: that is the kubelet plugin's (devices in its node's slices).
        self.watched_devices = Gauge(
            "dra_gpu_webhook_watched_devices",
            "Devices in the watched ResourceSlices",
            registry=self.registry,
        )
        self.cert_reloads = Counter(
            "dra_gpu_cert_reloads_total", "Certificate reloads", ["result"], registry=self.registry
        )
        for result in ("ok", "error"):  # from 0, so that the alert's increase() sees the first error
            self.cert_reloads.labels(result)
        self.throttled = Counter(
            "dra_gpu_admission_throttled_total",
            "Reviews answered 429 (retry later) because max_in_flight reviews were already running",
            registry=self.registry,
        )
        self.refused_clients = Counter(
            "dra_gpu_admission_refused_clients_total",
            "Requests refused because the client certificate's name is not an allowed one",
            registry=self.registry,
        )
        self.over_budget = Counter(
            "dra_gpu_admission_over_budget_total",
            "Reviews denied because validation passed its time or memory budget",
            registry=self.registry,
        )
        self.watch_events = Counter(
            "dra_gpu_watch_events_total", "Watch events by resource", ["resource"], registry=self.registry
        )


def label_of(value: str, allowed: frozenset[str]) -> str:
    """A metric label value: `value` when it is one of `allowed`, else OTHER (never the request's text)."""
    return value if value in allowed else OTHER


class CertReloader:
    """Loads cert+key into one SSLContext and reloads them when either file changes.

    With `client_ca`, the handshake requires a client certificate signed by that CA (the
    apiserver's, see README "Security"); a client without one never reaches the HTTP layer.
    """

    def __init__(self, cert: str, key: str, metrics: Metrics, client_ca: str | None = None) -> None:
        self.cert, self.key, self.metrics = cert, key, metrics
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.minimum_version = ssl.TLSVersion.TLSv1_2
        self.context.load_cert_chain(cert, key)
        if client_ca:
            self.context.load_verify_locations(cafile=client_ca)
            self.context.verify_mode = ssl.CERT_REQUIRED
        self.stamp = self._stamp()

    def _stamp(self) -> tuple[float, int, float, int]:
        c, k = os.stat(self.cert), os.stat(self.key)
        return (c.st_mtime, c.st_size, k.st_mtime, k.st_size)

    def check(self) -> bool:
        """Reload when the files changed; True when a new chain was loaded."""
        try:
            stamp = self._stamp()
        except OSError as exc:
            log.warning("event=cert_stat_failed error=%r", str(exc))
            return False
        if stamp == self.stamp:
            return False
        try:
            self.context.load_cert_chain(self.cert, self.key)
        except (OSError, ssl.SSLError) as exc:  # e.g. cert written, key not yet: keep the old chain
            log.warning("event=cert_reload_failed cert=%s error=%r", self.cert, str(exc))
            self.metrics.cert_reloads.labels("error").inc()
            return False
        self.stamp = stamp
        self.metrics.cert_reloads.labels("ok").inc()
        log.info("event=cert_reloaded cert=%s", self.cert)
        return True

    async def run(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            self.check()


def _bad_request(message: str) -> web.Response:
    return web.json_response({"error": message}, status=400)


class Webhook:
    def __init__(
        self,
        state: ClusterState,
        metrics: Metrics,
        pool: ReviewPool | None = None,
        watched: Collection[str] = (),
        max_in_flight: int = 16,
        client_names: Collection[str] = (),
    ) -> None:
        self.state = state
        self.metrics = metrics
        self.pool = pool
        self.watched = watched  # the stores /readyz waits for (their first list)
        self.max_in_flight = max_in_flight
        self.client_names = frozenset(client_names)
        self.in_flight = 0  # requests of any path (drained at shutdown)
        self.reviews_in_flight = 0
        self._idle = asyncio.Event()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_REVIEW_BYTES, middlewares=[self._count_in_flight])
        app.router.add_post("/validate", self.review)
        app.router.add_post("/", self.review)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/readyz", self.readyz)
        app.router.add_get("/metrics", self.metrics_page)
        return app

    def probes_app(self) -> web.Application:
        """The plain-HTTP side (metrics_port): probes and metrics only, never a review."""
        app = web.Application(client_max_size=1024)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/readyz", self.readyz)
        app.router.add_get("/metrics", self.metrics_page)
        return app

    @web.middleware
    async def _count_in_flight(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        self.in_flight += 1
        try:
            return await handler(request)
        finally:
            self.in_flight -= 1
            if not self.in_flight:
                self._idle.set()

    async def drain(self, timeout: float) -> int:
        """Wait until no request is in flight, at most `timeout` seconds; returns how many still are.

        aiohttp's own shutdown stops reading from open connections, which would drop a review whose
        body is still arriving; so the listener is closed first and the open connections drained here.
        """
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                while self.in_flight:
                    self._idle.clear()
                    await self._idle.wait()
        return self.in_flight

    async def healthz(self, _: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def readyz(self, _: web.Request) -> web.Response:
        waiting = sorted(set(self.watched) - self.state.synced)
        if waiting:
            return web.Response(status=503, text=f"not ready: waiting for the first list of {waiting}\n")
        return web.Response(text="ok\n")

    async def metrics_page(self, _: web.Request) -> web.Response:
        self.metrics.watched_devices.set(self.state.device_count())
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def review(self, request: web.Request) -> web.Response:
        """One AdmissionReview, or a 429 when max_in_flight are already running.

        Over the cap the answer is a 429 with Retry-After, not a deny: the apiserver's webhook
        client (client-go's rest client) retries a 429 that carries Retry-After within the
        webhook's timeoutSeconds, and after that applies the chart's failurePolicy. With the
        default Ignore the claim is admitted unchecked (the scheduler stays the authority), with
        Fail it is refused and its writer retries. A deny would instead turn load from anyone who
        can reach the port into refusals of valid claims, which nobody retries.
        """
        if not self._client_allowed(request):
            self.metrics.refused_clients.inc()
            return web.json_response({"error": "client certificate name not allowed"}, status=403)
        if self.reviews_in_flight >= self.max_in_flight:
            self.metrics.throttled.inc()
            return web.json_response(
                {"error": f"{self.max_in_flight} reviews in flight; retry later"},
                status=429,
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        self.reviews_in_flight += 1
        try:
            return await self._review(request)
        finally:
            self.reviews_in_flight -= 1

    def _client_allowed(self, request: web.Request) -> bool:
        """With client_names: the verified client certificate's CN or a DNS SAN is one of them."""
        if not self.client_names:
            return True
        cert = request.transport.get_extra_info("peercert") if request.transport else None
        if not cert:
            return False
        names = {value for rdn in cert.get("subject", ()) for key, value in rdn if key == "commonName"}
        names |= {value for key, value in cert.get("subjectAltName", ()) if key == "DNS"}
        return bool(names & self.client_names)

    async def _review(self, request: web.Request) -> web.Response:
        start = time.perf_counter()
        try:
            async with asyncio.timeout(BODY_TIMEOUT):
                raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            self.metrics.reviews.labels(MALFORMED, MALFORMED, "malformed").inc()
            return _bad_request(f"review larger than {MAX_REVIEW_BYTES} bytes")
        except TimeoutError:
            self.metrics.reviews.labels(MALFORMED, MALFORMED, "malformed").inc()
            return web.json_response({"error": f"body not received in {BODY_TIMEOUT:.0f} s"}, status=408)
        try:
            review = json.loads(raw)
        except RecursionError:
            # An object nested deeper than the decoder goes: denied by its uid, with the reason
            # (the apiserver stores such a claim, and no node could read it).
            too_deep = _too_deep(raw)
            if too_deep is not None:
                kind, denial = too_deep
                self.metrics.reviews.labels(label_of(kind, KIND_LABELS), MALFORMED, "denied").inc()
                return web.json_response(
                    {"apiVersion": ADMISSION_API, "kind": "AdmissionReview", "response": denial}
                )
            self.metrics.reviews.labels(MALFORMED, MALFORMED, "malformed").inc()
            return _bad_request("body is not JSON")
        except ValueError:
            self.metrics.reviews.labels(MALFORMED, MALFORMED, "malformed").inc()
            return _bad_request("body is not JSON")
        problem = _review_problem(review)
        if problem:
            self.metrics.reviews.labels(MALFORMED, MALFORMED, "malformed").inc()
            return _bad_request(problem)
        req = review["request"]
        kind = str((req.get("kind") or {}).get("kind") or (req.get("object") or {}).get("kind") or "")
        op = str(req.get("operation") or "")
        response: dict[str, Any] = {"uid": req["uid"], "allowed": True}
        result = "allowed"
        if kind in KINDS and op in ("CREATE", "UPDATE") and not _unchanged_spec(req):
            obj = req.get("object")
            if isinstance(obj, dict):
                obj = {
                    **obj,
                    "kind": obj.get("kind") or kind,
                    "apiVersion": obj.get("apiVersion")
                    or f"{(req.get('kind') or {}).get('group')}/{(req.get('kind') or {}).get('version')}",
                }
            verdict = await self._validate(obj)
            if verdict.errors:
                result = "denied"
                response["allowed"] = False
                response["status"] = {
                    "code": 403,
                    "reason": "Invalid",
                    "message": "; ".join(f"{path}: {message}" for path, message in verdict.errors),
                }
            if verdict.warnings:
                result = "warned" if result == "allowed" else result
                response["warnings"] = [f"{path}: {message}"[:1000] for path, message in verdict.warnings]
            # Denials and warnings at info; an allowed review at -v=5 (each request): every claim
            # of every pod passes here, and the reviews counter has them all.
            log.log(
                V(5) if result == "allowed" else logging.INFO,
                "event=admission kind=%s name=%s namespace=%s operation=%s result=%s uid=%s",
                kind,
                verdict.name,
                verdict.namespace,
                op,
                result,
                req["uid"],
            )
        self.metrics.reviews.labels(label_of(kind, KIND_LABELS), label_of(op, OPERATION_LABELS), result).inc()
        self.metrics.latency.observe(time.perf_counter() - start)
        return web.json_response(
            {"apiVersion": ADMISSION_API, "kind": "AdmissionReview", "response": response}
        )

    async def _validate(self, obj: Any) -> ReviewResult:
        """The rules' verdict, from a worker process when there is a pool (always, when serving)."""
        if self.pool is None:
            v = self.state.validator().validate(obj)
            errors = [(p.path, p.message) for p in v.errors]
            return ReviewResult(v.name, v.namespace, errors, [(p.path, p.message) for p in v.warnings])
        try:
            return await self.pool.validate(obj)
        except OverBudget as exc:
            meta = obj.get("metadata") if isinstance(obj, dict) else None
            meta = meta if isinstance(meta, dict) else {}
            self.metrics.over_budget.inc()
            return ReviewResult(
                str(meta.get("name") or meta.get("generateName") or "?"),
                str(meta.get("namespace") or ""),
                [("(object)", str(exc))],
                [],
            )


# The apiserver writes an AdmissionRequest's uid and kind first, before the objects.
_REQUEST_UID = re.compile(r'"request"\s*:\s*\{\s*"uid"\s*:\s*"([A-Za-z0-9-]{1,128})"')
_REQUEST_KIND = re.compile(r'"kind"\s*:\s*\{[^{}]*"kind"\s*:\s*"([A-Za-z]{1,64})"')


def _too_deep(raw: bytes) -> tuple[str, dict[str, Any]] | None:
    """The kind and a denial of a review too deep to decode, when its uid can be read."""
    head = raw[:IDENTITY_PREFIX].decode(errors="replace")
    uid = _REQUEST_UID.search(head)
    if uid is None:
        return None
    kind = _REQUEST_KIND.search(head, uid.end())
    message = f"request.object: {TOO_DEEP}; the GPU driver reads no such object"
    response = {
        "uid": uid.group(1),
        "allowed": False,
        "status": {"code": 400, "reason": "BadRequest", "message": message},
    }
    return (kind.group(1) if kind else MALFORMED), response


def _review_problem(review: Any) -> str | None:
    if not isinstance(review, dict):
        return "body must be an AdmissionReview object"
    problems = decode(review, ADMISSION_REVIEW)
    if problems:
        path, message = problems[0]
        return f"{path}: {message}"
    if review.get("apiVersion") != ADMISSION_API or review.get("kind") != "AdmissionReview":
        return f"apiVersion/kind must be {ADMISSION_API}/AdmissionReview"
    req = review.get("request")
    if not isinstance(req, dict):
        return "request is missing"
    if not isinstance(req.get("uid"), str) or not req["uid"]:
        return "request.uid is missing"
    if req.get("object") is not None and not isinstance(req.get("object"), dict):
        return "request.object must be an object"
    return None


def _unchanged_spec(req: Mapping[str, Any]) -> bool:
    """UPDATEs that leave the spec alone (finalizers, labels) are never blocked."""
    if req.get("operation") != "UPDATE":
        return False
    old, new = req.get("oldObject"), req.get("object")
    return isinstance(old, dict) and isinstance(new, dict) and old.get("spec") == new.get("spec")


# ---------------------------------------------------------------- watching the cluster


WATCHED = (("slices", "resourceslices"), ("classes", "deviceclasses"), ("claims", "resourceclaims"))
WATCH_BACKOFF = Backoff(initial=1.0, maximum=30.0)


async def watch_resource(
    state: ClusterState,
    store: str,
    kube: Kube,
    path: str,
    metrics: Metrics,
    backoff: Backoff = WATCH_BACKOFF,
) -> None:
    """Keep one store of the cluster view current (see dra_gpu.kube.api.list_watch)."""

    async def replace(items: list[dict[str, Any]], version: str) -> None:
        listed = len(items)
        state.replace(store, items)  # each reduced to what reviews read (view_records.py)
        log.info(
            "event=listed resource=%s count=%d kept=%d resourceVersion=%s",
            store,
            listed,
            len(state.stores[store]),
            version,
        )

    async def apply(kind: str, obj: dict[str, Any]) -> bool:
        metrics.watch_events.labels(store).inc()
        state.apply(store, kind, obj)  # REJECTED (undecodable) drops the object, as DELETED does
        return True

    # Each listed object is reduced as it is decoded: a relist holds the view, not the claims.
    await list_watch(
        kube,
        path,
        replace,
        apply,
        watch_seconds=300,
        backoff=backoff,
        transform=functools.partial(view_records.slim, store),
    )


async def start_watches(
    state: ClusterState, kubeconfig: str | None, metrics: Metrics
) -> list[asyncio.Task[None]]:
    """One task watching the three stores; /readyz waits until each was listed once."""
    kube = await Kube.connect(kubeconfig)
    kube.rejections.register(metrics.registry)
    state.synced.difference_update(store for store, _ in WATCHED)  # files loaded with -f do not count

    async def watch_all() -> None:
        try:
            async with asyncio.TaskGroup() as group:
                for store, plural in WATCHED:
                    group.create_task(watch_resource(state, store, kube, f"{RESOURCE_V1}/{plural}", metrics))
        finally:
            await kube.close()

    return [asyncio.create_task(watch_all(), name="watches")]


async def serve(
    config: WebhookConfig,
    ready: asyncio.Event | None = None,
    reload_interval: float = 2.0,
    stop: asyncio.Event | None = None,
) -> None:
    """Serve until `stop` is set (or the task is cancelled), then shut down gracefully."""
    metrics = Metrics()
    register_build_info(metrics.registry, "controller")
    state = ClusterState(config.driver, config.nvidia_compatible)
    pool = ReviewPool(
        config.driver,
        workers=config.workers,
        deadline_s=config.review_deadline_s,
        nvidia_compatible=config.nvidia_compatible,
    )
    state.pool = pool
    if config.files:
        inputs = load_files(config.files)
        state.replace("slices", inputs.slices)
        state.replace("classes", inputs.classes)
        state.replace("claims", inputs.claims)
    certs = CertReloader(config.cert, config.key, metrics, config.client_ca)
    await pool.start()
    webhook = Webhook(
        state,
        metrics,
        pool,
        watched=[store for store, _ in WATCHED] if config.watch else (),
        max_in_flight=config.max_in_flight,
        client_names=config.client_names,
    )
    runner = web.AppRunner(webhook.app(), access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, config.address, config.port, ssl_context=certs.context)
    await site.start()
    probes: web.AppRunner | None = None
    if config.metrics_port:
        probes = web.AppRunner(webhook.probes_app(), access_log=None, shutdown_timeout=1.0)
        await probes.setup()
        await web.TCPSite(probes, config.address, config.metrics_port).start()
    log.info(
        "event=serving address=%s port=%d driver=%s nvidia_compatible=%s",
        config.address,
        config.port,
        state.driver,
        str(config.nvidia_compatible).lower(),
    )
    tasks = [asyncio.create_task(certs.run(reload_interval))]
    if config.watch:
        tasks += await start_watches(state, config.kubeconfig, metrics)
    if ready is not None:
        ready.set()
    try:
        await (stop or asyncio.Event()).wait()
        log.info("event=stopping in_flight=%d timeout=%.0fs", webhook.in_flight, SHUTDOWN_TIMEOUT)
        await site.stop()  # new connections are refused; the open ones are still served
        left = await webhook.drain(SHUTDOWN_TIMEOUT)
        if left:
            log.warning("event=stop_timeout in_flight=%d", left)
    finally:
        await runner.cleanup()
        if probes is not None:
            await probes.cleanup()
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        await pool.close()


def run(config: WebhookConfig) -> int:
    root = logging.getLogger()
    root.setLevel(min(root.level or logging.INFO, logging.INFO))  # at least info; -v=N keeps V(N)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(config, stop=stop)

    try:
        asyncio.run(main())
    except (OSError, ssl.SSLError, InputError) as exc:
        print(f"dra-gpu controller: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_OK
    return EXIT_OK
