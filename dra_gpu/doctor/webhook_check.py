"""Is the admission webhook reachable with a valid certificate that its configuration's caBundle
trusts, and what the apiserver does with claims and classes when it is not (its failurePolicy)."""

from __future__ import annotations

import datetime
import socket
from collections.abc import Iterable, Mapping
from typing import Any

from dra_gpu.doctor.cluster_view import ClusterView, object_name
from dra_gpu.doctor.report import Result, fail, ok, skip, warn
from dra_gpu.doctor.settings import ClusterSettings
from dra_gpu.doctor.webhook_tls import CertificateError, fetch


def _our_webhooks(view: ClusterView, driver: str) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for cfg in view.webhook_configs:
        for wh in cfg.get("webhooks") or []:
            if str(wh.get("name", "")).endswith("." + driver):
                out.append((object_name(cfg), wh))
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
