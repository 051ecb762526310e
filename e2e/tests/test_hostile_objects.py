"""One tenant's object cannot stop the fleet (docs/security.md), against the real apiserver:

a ResourceClaim nested 1,500 levels deep (the apiserver stores it: its decoder allows 10,000) and
one whose JSON is larger than an object may be (characters the apiserver writes as 6-byte escapes)
are created; after them, the kubelet plugin on the simulated node still prepares a normal claim
from its watch, a webhook started after them becomes ready and admits the claim, and each bad
claim is reported: a log line, the rejected-objects counter, and an Event on the claim.
"""

from __future__ import annotations

import contextlib
import re
import sys

import pytest
from controller_support import RESOURCE, RUN
from support import wait_for
from test_compat import get_raw
from test_controller_webhook import Controller, _webhook_config
from test_kubelet_plugin import claim_pod, plugin, template  # noqa: F401 - fixture

from dra_gpu.kube.bounds import MAX_OBJECT_BYTES

pytestmark = pytest.mark.e2e

DEPTH = 1500


def poisoned_claim(name: str) -> dict:
    nested: object = "bottom"
    for _ in range(DEPTH):
        nested = [nested]  # 2 bytes a level: opaque parameters may be at most 10 KiB
    parameters = {"n": nested}
    return {
        "apiVersion": RESOURCE,
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {
            "devices": {
                "requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.dra-gpu.io"}}],
                "config": [{"opaque": {"driver": "gpu.dra-gpu.io", "parameters": parameters}}],
            }
        },
    }


@contextlib.contextmanager
def deep_objects():
    """The client encodes the claim recursively: the interpreter's limit raised meanwhile."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20_000)
    try:
        yield
    finally:
        sys.setrecursionlimit(limit)


def oversized_claim(name: str) -> dict:
    """~1.2 MB stored, ~7 MB as the apiserver's JSON: every '<' is written as \\u003c. The bytes sit
    in selectors' string literals (10 KiB an expression, 32 a request) since annotations are
    limited to 256 KiB."""
    literal = "<" * 9_000
    per_request, requests = 32, 4
    assert 6 * len(literal) * per_request * requests > MAX_OBJECT_BYTES
    return {
        "apiVersion": RESOURCE,
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": f"r{r}",
                        "exactly": {
                            "deviceClassName": "gpu.dra-gpu.io",
                            "selectors": [
                                {"cel": {"expression": f'"{literal}{i}" != ""'}} for i in range(per_request)
                            ],
                        },
                    }
                    for r in range(requests)
                ]
            }
        },
    }


def test_bad_claims_stop_neither_the_plugin_nor_the_webhook(
    target,
    core,
    dyn,
    namespace,
    tmp_path,
    plugin,  # noqa: F811
    busybox_image,
    wait_pod,
):
    claims = dyn.resources.get(api_version=RESOURCE, kind="ResourceClaim")
    with deep_objects():
        claims.create(namespace=namespace, body=poisoned_claim("poisoned"))
    claims.create(namespace=namespace, body=oversized_claim("oversized"))
    raw = get_raw(core, f"/apis/{RESOURCE}/namespaces/{namespace}/resourceclaims/oversized")
    assert len(raw) > MAX_OBJECT_BYTES, len(raw)  # the apiserver's JSON of it, as a watch line holds it

    # Both are in the plugin's next list and in its watch now: both are reported, nothing stops.
    def reported() -> bool:
        log = plugin.log_path.read_text(errors="replace")
        return all(f"namespace={namespace} name={n} " in log for n in ("poisoned", "oversized"))

    wait_for("the plugin to report both bad claims", reported, timeout=60)
    counted = re.search(
        r'dra_gpu_apiserver_objects_rejected_total\{resource="resourceclaims"\} (\S+)', plugin.metrics()
    )
    assert counted and float(counted.group(1)) >= 2, plugin.metrics()

    # A webhook started after them lists the claims and becomes ready.
    hooks = dyn.resources.get(
        api_version="admissionregistration.k8s.io/v1", kind="ValidatingWebhookConfiguration"
    )
    hook_name = f"dra-gpu-e2e-hostile-{RUN}"
    ctl = Controller(target.kubeconfig, tmp_path, driver="gpu.dra-gpu.io")
    try:
        wait_for("a webhook started after the bad claims to be ready", ctl.ready, timeout=60, interval=0.2)
        hooks.create(body=_webhook_config(hook_name, ctl, namespace))
        # A normal claim after them: admitted by the webhook (failurePolicy Fail) and prepared.
        template(dyn, namespace, "after")
        claim_pod(
            core, namespace, "after", {"resource_claim_template_name": "after"}, "ls /dev", busybox_image
        )
        assert wait_pod(core, namespace, "after", timeout=120) == "Succeeded"
        wait_for(
            "the webhook to have reviewed the claim",
            lambda: 'dra_gpu_admission_reviews_total{kind="ResourceClaim"' in ctl.get("/metrics"),
            timeout=30,
        )
        assert "left out of the view" in ctl.log() and "name=poisoned" in ctl.log()
    finally:
        try:
            hooks.delete(name=hook_name)
        finally:
            ctl.stop()
    log = plugin.log_path.read_text(errors="replace")
    assert "list+watch failed" not in log, plugin.log_tail()

    # Reported on the claims themselves, once however many components saw them.
    def events() -> dict[str, dict]:
        api = dyn.resources.get(api_version="events.k8s.io/v1", kind="Event")
        listed = api.get(namespace=namespace).to_dict()["items"]
        return {e["regarding"]["name"]: e for e in listed if e.get("reason") == "ObjectRejected"}

    found = wait_for("an Event on each bad claim", lambda: len(events()) == 2 and events(), timeout=30)
    assert set(found) == {"poisoned", "oversized"}
    assert "nested more than 64 levels deep" in found["poisoned"]["note"]
    assert found["poisoned"]["regarding"]["kind"] == "ResourceClaim"
