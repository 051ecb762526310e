"""The chart's alerts (deploy/helm/dra-gpu/templates/prometheusrule.yaml) checked by Prometheus's own
promtool (e2e/node/build_promtool.sh) against the series the e2e cluster's programs really export.

The host-process kubelet plugin serves the simulated node and prepares claims, and the controller's
webhook answers the apiserver's reviews (an admitted template and claims, a denied claim); both
/metrics are scraped several times, and the samples become the `input_series` of `promtool test
rules` with the labels the chart's PodMonitor scrape adds (job, instance, namespace, endpoint, node).
One scrape stands for one scrape interval of the chart (metrics.interval); after the last one a
gauge keeps its value and a counter its observed rate, for longer than every `for:`. Asserted:
no alert fires on that healthy install; with the webhook stopped (its scrape gone, its series
stale) DraGpuWebhookDown fires after its `for:` and nothing else does; and, to show the silence test
can fail, the same series with one device's dra_gpu_device_healthy at 0 make it fail.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import subprocess
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import yaml
from controller_support import ignore_404
from prometheus_client.parser import text_string_to_metric_families
from support import ROOT, render, wait_for
from test_controller_webhook import Controller, _free_port, _webhook_config
from test_kubelet_plugin import (
    CDI_DIR,
    DRIVER,
    HTTP,
    Plugin,
    claim_pod,
    ensure_device_classes,
    template,
)

pytestmark = pytest.mark.e2e

RELEASE, CHART_NAMESPACE = "dra-gpu", "dra-gpu"
SCRAPES = 4  # of each target while it is healthy, and again of the plugin once the webhook stopped
SCRAPE_GAP = 5.0  # seconds between two scrapes of the test
WINDOW = 30 * 60  # seconds of the series in the promtool tests, after the observed scrapes
COUNTER_SUFFIXES = ("_total", "_bucket", "_count", "_sum")  # what rate()/increase() may be applied to


@pytest.fixture(scope="module")
def promtool() -> str:
    """promtool built (once, cached) from github.com/prometheus/prometheus by build_promtool.sh.
    Without Go (or the module proxy) this fails: the alerts are then not tested, which is no skip."""
    r = subprocess.run(
        ["bash", str(ROOT / "e2e" / "node" / "build_promtool.sh")], capture_output=True, text=True
    )
    if r.returncode != 0:
        pytest.fail(f"e2e/node/build_promtool.sh failed:\n{r.stderr[-3000:]}")
    return r.stdout.strip().splitlines()[-1]


def seconds(duration: str) -> int:
    """A Prometheus duration of one unit (30s, 5m, 1h) in seconds."""
    m = re.fullmatch(r"(\d+)([smh])", duration)
    assert m, duration
    return int(m.group(1)) * {"s": 1, "m": 60, "h": 3600}[m.group(2)]


@dataclass
class Chart:
    """What the test takes from the chart as rendered: the rules, the scrape's job and interval."""

    groups: list[dict[str, Any]]
    job: str  # the Prometheus Operator's job label of a PodMonitor: <namespace>/<name>
    ports: list[str]  # the PodMonitor's endpoints (port names), the plugin's first
    interval: int  # seconds

    @property
    def alerts(self) -> dict[str, dict[str, Any]]:
        return {r["alert"]: r for g in self.groups for r in g["rules"] if "alert" in r}

    def longest_for(self) -> int:
        return max(seconds(r.get("for", "0s")) for r in self.alerts.values())


@pytest.fixture(scope="module")
def chart() -> Chart:
    objs = render(
        RELEASE,
        CHART_NAMESPACE,
        "image.registry=localhost",
        "metrics.podMonitor.enabled=true",
        "prometheusRule.enabled=true",
    )
    (rule,) = [o for o in objs if o["kind"] == "PrometheusRule"]
    (monitor,) = [o for o in objs if o["kind"] == "PodMonitor"]
    endpoints = monitor["spec"]["podMetricsEndpoints"]
    # The node label every series gets, which the test adds as the scrape would.
    for e in endpoints:
        assert {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node"} in e[
            "relabelings"
        ]
    (interval,) = {e["interval"] for e in endpoints}
    return Chart(
        groups=rule["spec"]["groups"],
        job=f"{monitor['metadata']['namespace']}/{monitor['metadata']['name']}",
        ports=[e["port"] for e in endpoints],
        interval=seconds(interval),
    )


# ------------------------------------------------------------------------------------ scrapes

Key = tuple[str, tuple[tuple[str, str], ...]]  # a series: its name and its labels, sorted


@dataclass
class Target:
    """A scraped endpoint and the labels the chart's PodMonitor scrape gives its series."""

    url: str
    labels: dict[str, str]
    scrapes: list[dict[Key, float] | None] = field(default_factory=list)  # None: not scraped (gone)

    def scrape(self) -> None:
        with urllib.request.urlopen(self.url, timeout=3) as r:
            text = r.read().decode()
        self.scrapes.append(parse(text, self.labels))

    def gone(self) -> None:
        self.scrapes.append(None)


def parse(text: str, target_labels: dict[str, str]) -> dict[Key, float]:
    """The samples of a /metrics page as Prometheus stores them: an empty label is no label, and a
    scraped label a target label overwrites is kept as exported_<name> (honor_labels: false)."""
    out: dict[Key, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = {k: v for k, v in s.labels.items() if v != ""}
            for k in target_labels:
                if k in labels:
                    labels["exported_" + k] = labels.pop(k)
            labels.update(target_labels)
            out[(s.name, tuple(sorted(labels.items())))] = float(s.value)
    return out


def number(v: float) -> str:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "Inf" if v > 0 else "-Inf"
    if v.is_integer():
        return str(int(v))
    return format(Decimal(repr(v)), "f")  # never an exponent (1e+09+0x60 would not parse)


def selector(key: Key) -> str:
    name, labels = key
    return name + "{" + ",".join(f"{k}={json.dumps(v)}" for k, v in labels) + "}"


def input_series(targets: list[Target], steps: int) -> list[dict[str, str]]:
    """promtool's input_series: one sample a scrape as seen (`_` before a series appears, `stale`
    where it or its target went, as Prometheus marks it), then, to `steps` samples, a series still
    scraped at the end keeps its value (a gauge) or its observed rate (a counter)."""
    series = []
    for t in targets:
        keys = sorted({k for s in t.scrapes if s for k in s})
        for key in keys:
            seen = [s.get(key) if s is not None else None for s in t.scrapes]
            values: list[str] = []
            for i, v in enumerate(seen):
                if v is not None:
                    values.append(number(v))
                else:
                    values.append("stale" if i and seen[i - 1] is not None else "_")
            observed = [v for v in seen if v is not None]
            rest = steps - len(seen)
            if seen[-1] is not None and rest > 0:
                last = observed[-1]
                step = 0.0
                if key[0].endswith(COUNTER_SUFFIXES) and len(observed) > 1:
                    step = max(0.0, (last - observed[0]) / (len(observed) - 1))
                if step:
                    values.append(f"{number(last + step)}+{number(step)}x{rest - 1}")
                elif math.isfinite(last):
                    values.append(f"{number(last)}x{rest - 1}")
                else:
                    values += [number(last)] * rest
            series.append({"series": selector(key), "values": " ".join(values)})
    return series


# ------------------------------------------------------------------------------------ promtool


def promtool_run(promtool: str, *args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool, *map(str, args)], capture_output=True, text=True, timeout=300)


def write_rules(chart: Chart, where: Path) -> Path:
    path = where / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": chart.groups}, sort_keys=False))
    return path


def minutes(s: int) -> str:
    assert s % 60 == 0, s
    return f"{s // 60}m"


def unit_test(
    where: Path,
    name: str,
    chart: Chart,
    series: list[dict[str, str]],
    expect: dict[int, dict[str, list[dict[str, Any]]]],
) -> Path:
    """A promtool test file: at each eval time (seconds) the firing alerts of every alert name, []
    unless `expect` names some."""
    tests = [
        {"eval_time": minutes(at), "alertname": alert, "exp_alerts": firing.get(alert, [])}
        for at, firing in sorted(expect.items())
        for alert in sorted(chart.alerts)
    ]
    doc = {
        "rule_files": ["rules.yaml"],
        "evaluation_interval": f"{chart.interval}s",
        "tests": [
            {
                "name": name,
                "interval": f"{chart.interval}s",
                "input_series": series,
                "alert_rule_test": tests,
            }
        ],
    }
    path = where / f"{name}.test.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False, width=1 << 20))
    return path


def failed_alerts(output: str) -> set[str]:
    """The alert names of promtool's failed checks."""
    return set(re.findall(r"alertname: (\w+),", output))


# ------------------------------------------------------------------------------------ the cluster


@dataclass
class Observed:
    plugin: Target
    controller: Target
    healthy_steps: int  # scrapes of both
    total_scrapes: int


@pytest.fixture(scope="module")
def observed(target, core, dyn, chart, busybox_image, tmp_path_factory) -> Observed:
    """The plugin and the webhook running a healthy install's work, scraped SCRAPES times; then
    the webhook stopped (its /metrics gone) and the plugin scraped SCRAPES times more."""
    if not target.local:
        pytest.skip("the plugin and the controller run as host processes of the local e2e cluster")
    tmp = tmp_path_factory.mktemp("alerts")
    node = core.list_node().items[0].metadata.name
    namespace = "e2e-alerts-" + uuid.uuid4().hex[:6]
    hooks = dyn.resources.get(
        api_version="admissionregistration.k8s.io/v1", kind="ValidatingWebhookConfiguration"
    )
    claims = dyn.resources.get(api_version="resource.k8s.io/v1", kind="ResourceClaim")
    hook_name = f"dra-gpu-e2e-alerts-{uuid.uuid4().hex[:6]}"
    metrics_port = _free_port()
    plugin_port, controller_port = chart.ports
    labels = {"job": chart.job, "namespace": CHART_NAMESPACE, "node": node}
    plugin = Target(f"http://{HTTP}/metrics", {**labels, "instance": HTTP, "endpoint": plugin_port})
    controller = Target(
        f"http://127.0.0.1:{metrics_port}/metrics",
        {**labels, "instance": f"127.0.0.1:{metrics_port}", "endpoint": controller_port},
    )

    ensure_device_classes(dyn)
    core.create_namespace({"metadata": {"name": namespace}})
    p = Plugin(target.kubeconfig, node, tmp / "plugin.log")
    ctl: Controller | None = None
    try:
        wait_for(
            "the default service account",
            lambda: any(
                sa.metadata.name == "default" for sa in core.list_namespaced_service_account(namespace).items
            ),
            timeout=30,
        )
        p.start()
        ctl = Controller(target.kubeconfig, tmp, driver=DRIVER, extra=("--metrics-port", str(metrics_port)))
        wait_for("the controller to serve and list the cluster", ctl.ready, timeout=60, interval=0.2)
        hooks.create(body=_webhook_config(hook_name, ctl, namespace))
        typo = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": "typo"},
            "spec": {
                "devices": {
                    "requests": [
                        {
                            "name": "gpus",
                            "exactly": {
                                "deviceClassName": DRIVER,
                                "selectors": [
                                    {
                                        "cel": {
                                            "expression": f'device.attributes["{DRIVER}"].prodcutName == "x"'
                                        }
                                    }
                                ],
                            },
                        }
                    ]
                }
            },
        }

        def typo_denied() -> bool:  # a user's mistake the webhook denies: healthy
            try:
                claims.create(body=typo, namespace=namespace)
            except Exception as exc:
                if "admission webhook" not in str(getattr(exc, "body", "")):
                    raise
                return True
            claims.delete(name="typo", namespace=namespace)  # the configuration not yet picked up
            return False

        wait_for("the webhook to deny a CEL typo", typo_denied, timeout=30, interval=0.5)
        template(dyn, namespace, "one")  # admitted by the webhook, as the claims made from it
        claim_pod(
            core, namespace, "holder", {"resource_claim_template_name": "one"}, "sleep 3600", busybox_image
        )
        claim_pod(core, namespace, "done", {"resource_claim_template_name": "one"}, "true", busybox_image)
        wait_for(
            "one pod running with its GPU, one done",
            lambda: (
                core.read_namespaced_pod("holder", namespace).status.phase == "Running"
                and core.read_namespaced_pod("done", namespace).status.phase == "Succeeded"
            ),
            timeout=120,
            interval=0.5,
        )
        for i in range(SCRAPES):
            if i:  # work going on between the scrapes: a claim made, admitted, prepared, unprepared
                claim_pod(
                    core,
                    namespace,
                    f"run-{i}",
                    {"resource_claim_template_name": "one"},
                    "true",
                    busybox_image,
                )
                time.sleep(SCRAPE_GAP)
            plugin.scrape()
            controller.scrape()
        # The webhook stops (the configuration first: with failurePolicy Fail the claims' updates
        # of the clean-up would be refused). Its /metrics answers no more.
        ignore_404(hooks.delete, name=hook_name)
        ctl.stop()
        with pytest.raises(OSError):
            controller.scrape()
        for _ in range(SCRAPES):
            time.sleep(SCRAPE_GAP)
            plugin.scrape()
            controller.gone()
        assert "Traceback" not in ctl.log(), ctl.log()[-3000:]
        # The plugin unprepares the claims before it stops (nothing left for the next file).
        uids = [c["metadata"]["uid"] for c in claims.get(namespace=namespace).to_dict()["items"]]
        for pod in core.list_namespaced_pod(namespace).items:
            core.delete_namespaced_pod(pod.metadata.name, namespace, grace_period_seconds=0)
        wait_for(
            "the claims to be unprepared",
            lambda: not [u for u in uids if (CDI_DIR / f"k8s.{DRIVER}-claim_{u}.json").exists()],
            timeout=90,
        )
    finally:
        with contextlib.suppress(Exception):
            hooks.delete(name=hook_name)
        if ctl is not None:
            ctl.stop()
        p.stop()
        ignore_404(core.delete_namespace, namespace, grace_period_seconds=0)
        slices = dyn.resources.get(api_version="resource.k8s.io/v1", kind="ResourceSlice")
        for s in slices.get(field_selector=f"spec.driver={DRIVER}").to_dict()["items"]:
            ignore_404(slices.delete, name=s["metadata"]["name"])
    return Observed(plugin, controller, SCRAPES, 2 * SCRAPES)


# ------------------------------------------------------------------------------------ tests


def test_the_rules_pass_promtool_check(promtool, chart, tmp_path):
    rules = write_rules(chart, tmp_path)
    r = promtool_run(promtool, "check", "rules", "--lint=all", "--lint-fatal", rules)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {sum(len(g['rules']) for g in chart.groups)} rules found" in r.stdout, r.stdout
    assert "DraGpuWebhookDown" in chart.alerts  # rendered: the chart's PodMonitor is on


def healthy_only(obs: Observed) -> list[Target]:
    """Both targets as in the healthy scrapes only."""
    return [Target(t.url, t.labels, t.scrapes[: obs.healthy_steps]) for t in (obs.plugin, obs.controller)]


def test_silent_on_a_healthy_install(promtool, chart, observed, tmp_path):
    obs = observed
    steps = obs.healthy_steps + WINDOW // chart.interval
    series = input_series(healthy_only(obs), steps)
    names = sorted({s["series"].split("{", 1)[0] for s in series})
    # The alerts' own inputs are among the series the programs really export (not
    # dra_gpu_slice_fields_dropped, which has a series only for a field the apiserver dropped).
    for needed in (
        "dra_gpu_device_healthy",
        "dra_gpu_node_requests_total",
        "dra_gpu_admission_throttled_total",
        "dra_gpu_admission_over_budget_total",
        "dra_gpu_admission_refused_clients_total",
        "dra_gpu_build_info",
    ):
        assert needed in names, names
    info = [s["series"] for s in series if s["series"].startswith("dra_gpu_build_info{")]
    assert any('component="controller"' in i for i in info), info
    write_rules(chart, tmp_path)
    after_every_for = obs.healthy_steps * chart.interval + chart.longest_for() + 60
    times = sorted({-(-after_every_for // 60) * 60, 20 * 60, WINDOW})
    test = unit_test(tmp_path, "healthy", chart, series, {t: {} for t in times})
    t0 = time.time()
    r = promtool_run(promtool, "test", "rules", test)
    took = time.time() - t0
    assert r.returncode == 0, f"an alert fires on a healthy install:\n{r.stdout}{r.stderr}"
    plugin_n = len({k for s in obs.plugin.scrapes[: obs.healthy_steps] if s for k in s})
    print(
        f"\n[alerts] {len(series)} series ({plugin_n} of the plugin, {len(series) - plugin_n} of the "
        f"webhook; {len(names)} names) from {obs.healthy_steps} scrapes {SCRAPE_GAP:.0f} s apart, "
        f"one a {chart.interval} s interval, over {WINDOW // 60}m: {len(chart.alerts)} alerts silent "
        f"at {', '.join(minutes(t) for t in times)} (promtool test rules {took:.1f} s)"
    )


def test_webhook_down_fires_when_the_webhook_stops(promtool, chart, observed, tmp_path):
    obs = observed
    stopped = obs.healthy_steps * chart.interval  # the first scrape without it
    steps = obs.total_scrapes + WINDOW // chart.interval
    series = input_series([obs.plugin, obs.controller], steps)
    # The webhook's series end with the staleness marker Prometheus writes when a target goes.
    gone = ["stale"] + ["_"] * (obs.total_scrapes - obs.healthy_steps - 1)
    instance = json.dumps(obs.controller.labels["instance"])
    webhook = [s for s in series if f"instance={instance}" in s["series"]]
    assert webhook and all(s["values"].split()[obs.healthy_steps :] == gone for s in webhook), webhook
    write_rules(chart, tmp_path)
    down = chart.alerts["DraGpuWebhookDown"]
    wait = seconds(down["for"])
    firing = [
        {"exp_labels": {**down["labels"], "component": "controller"}, "exp_annotations": down["annotations"]}
    ]
    before = -(-(stopped + wait) // 60) * 60 - 60  # the last whole minute before it may fire
    after = -(-(stopped + wait + 2 * chart.interval) // 60) * 60
    expect: dict[int, dict[str, list[dict[str, Any]]]] = {
        before: {},
        after: {"DraGpuWebhookDown": firing},
        WINDOW: {"DraGpuWebhookDown": firing},
    }
    test = unit_test(tmp_path, "webhook-down", chart, series, expect)
    r = promtool_run(promtool, "test", "rules", test)
    assert r.returncode == 0, r.stdout + r.stderr
    print(
        f"\n[alerts] webhook stopped at {stopped} s: DraGpuWebhookDown silent at {minutes(before)}, "
        f"firing at {minutes(after)} and {minutes(WINDOW)}; the other alerts silent"
    )


def test_a_tainted_device_makes_the_silence_test_fail(promtool, chart, observed, tmp_path):
    """The negative control: the healthy series with one device's dra_gpu_device_healthy at 0 from
    the start. Expecting silence then fails, and only for DraGpuDeviceTainted."""
    obs = observed
    steps = obs.healthy_steps + WINDOW // chart.interval
    series = input_series(healthy_only(obs), steps)
    health = [s for s in series if s["series"].startswith("dra_gpu_device_healthy{")]
    assert health and all(set(s["values"].split()[: obs.healthy_steps]) == {"1"} for s in health), health
    health[0]["values"] = f"0x{steps - 1}"
    write_rules(chart, tmp_path)
    test = unit_test(tmp_path, "tainted", chart, series, {20 * 60: {}, WINDOW: {}})
    r = promtool_run(promtool, "test", "rules", test)
    assert r.returncode != 0, r.stdout + r.stderr
    assert failed_alerts(r.stdout + r.stderr) == {"DraGpuDeviceTainted"}, r.stdout + r.stderr
    device = re.search(r'device="([^"]+)"', health[0]["series"])
    assert device and f'device="{device.group(1)}"' in r.stdout + r.stderr, r.stdout + r.stderr
