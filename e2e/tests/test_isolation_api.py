"""Tenant isolation, the API side (docs/security.md), against the real apiserver:

- the chart's slice policy: a kubelet plugin's token bound to node A writes no ResourceSlice whose
  spec.pool.name is another node, nor one of another driver;
- the chart's claim-status policy: that plugin changes only the status.devices entries of its
  driver and its own pool: not another pool's entries, not the allocation;
- the webhook refuses a sharing config (MPS) on an adminAccess request, naming the claim and the
  field;
- the webhook over its in-flight cap answers 429 with Retry-After, which the apiserver retries:
  the claim is admitted once a slot is free, even with failurePolicy Fail.

The plugin's service account, RBAC and policies come from the chart (test_deploy's fixture), with
a test driver so that no real plugin's slices are touched.
"""

from __future__ import annotations

import json
import socket
import ssl
import time

import pytest
from controller_support import RESOURCE, RUN, status_of
from support import wait_for
from test_controller_webhook import Controller, _webhook_config
from test_deploy import (  # noqa: F401 - fixtures
    TEST_DRIVER,
    as_token,
    helm,
    plugin_identity,
    pod_bound_token,
    slice_body,
)

pytestmark = pytest.mark.e2e

OTHER_DRIVER = "other.dra-gpu.io"


def call(fn, *args, **kwargs) -> tuple[int, str]:
    """(200, "") when `fn` succeeds, else the API error's status and message."""
    try:
        fn(*args, **kwargs)
        return 200, ""
    except Exception as exc:
        code = status_of(exc)
        if code is None:
            raise
        try:
            return code, str(json.loads(exc.body).get("message"))
        except (ValueError, AttributeError, TypeError):
            return code, str(getattr(exc, "body", exc))


def plugin_api(api_client, core, ident):
    """The resource API as the plugin on node A: a token of its account bound to its pod."""
    from kubernetes import client

    return client.ResourceV1Api(as_token(api_client, pod_bound_token(core, ident)))


def first_denial(what, attempt, undo):
    """The first denial of `attempt` (the apiserver loads a new policy asynchronously): each
    success before it is undone."""

    def denied():
        code, msg = attempt()
        if code == 200:
            undo()
            return None
        return code, msg

    return wait_for(what, denied, timeout=60, interval=0.5)


# ---------------------------------------------------------------- slices


def test_plugin_writes_no_slice_of_another_pool_or_driver(api_client, core, plugin_identity):  # noqa: F811
    from kubernetes import client

    node_a, node_b = plugin_identity["nodes"]
    plugin = plugin_api(api_client, core, plugin_identity)
    admin = client.ResourceV1Api(api_client)

    # Its own node's name, another node's pool: the scheduler would take these for node B's devices.
    foreign_pool = slice_body(f"{node_a}-pool-b", node_a)
    foreign_pool["spec"]["pool"]["name"] = node_b
    code, msg = first_denial(
        "the slice policy to deny another node's pool",
        lambda: call(plugin.create_resource_slice, foreign_pool),
        lambda: call(admin.delete_resource_slice, foreign_pool["metadata"]["name"]),
    )
    assert code == 403, (code, msg)
    assert f"may write only ResourceSlices whose spec.pool.name is its node, not '{node_b}'" in msg, msg

    other_driver = slice_body(f"{node_a}-other-driver", node_a)
    other_driver["spec"]["driver"] = OTHER_DRIVER
    code, msg = call(plugin.create_resource_slice, other_driver)
    assert code == 403, (code, msg)
    assert f"only ResourceSlices of driver '{TEST_DRIVER}', not '{OTHER_DRIVER}'" in msg, msg

    # Its own slice passes (moving it to another pool later the apiserver refuses itself: the pool
    # name is immutable).
    own = slice_body(f"{node_a}-own", node_a)
    assert call(plugin.create_resource_slice, own) == (200, "")
    assert call(plugin.delete_resource_slice, own["metadata"]["name"]) == (200, "")


# ---------------------------------------------------------------- claim status


def allocated_claim(admin, namespace, node_a, node_b):
    """A claim allocated on node A with one device of node A's pool, one of node B's pool (a
    network-attached device, as far as the API is concerned) and one of another driver; node B's
    device already has a status entry (its own plugin's)."""
    name = f"status-{RUN}"
    admin.create_namespaced_resource_claim(
        namespace,
        {
            "apiVersion": RESOURCE,
            "kind": "ResourceClaim",
            "metadata": {"name": name},
            "spec": {
                "devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "x", "count": 3}}]}
            },
        },
    )
    results = [
        {"request": "gpu", "driver": TEST_DRIVER, "pool": node_a, "device": "dev-a"},
        {"request": "gpu", "driver": TEST_DRIVER, "pool": node_b, "device": "dev-b"},
        {"request": "gpu", "driver": OTHER_DRIVER, "pool": node_a, "device": "dev-x"},
    ]
    status = {
        "allocation": {
            "devices": {"results": results},
            "nodeSelector": {
                "nodeSelectorTerms": [
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node_a]}]}
                ]
            },
        },
        "devices": [{"driver": TEST_DRIVER, "pool": node_b, "device": "dev-b", "data": {"by": "node-b"}}],
    }
    admin.patch_namespaced_resource_claim_status(
        name, namespace, {"status": status}, _content_type="application/merge-patch+json"
    )
    return name


def test_plugin_writes_only_its_own_status_entries(api_client, core, plugin_identity):  # noqa: F811
    from kubernetes import client

    node_a, node_b = plugin_identity["nodes"]
    ns = plugin_identity["namespace"]
    admin = client.ResourceV1Api(api_client)
    name = allocated_claim(admin, ns, node_a, node_b)
    plugin = plugin_api(api_client, core, plugin_identity)
    theirs = {"driver": TEST_DRIVER, "pool": node_b, "device": "dev-b", "data": {"by": "node-b"}}
    mine = {"driver": TEST_DRIVER, "pool": node_a, "device": "dev-a", "data": {"by": "node-a"}}

    def patch(devices=None, status=None):
        body = {"status": status if status is not None else {"devices": devices}}
        return call(
            plugin.patch_namespaced_resource_claim_status,
            name,
            ns,
            body,
            _content_type="application/merge-patch+json",
        )

    def restore():
        admin.patch_namespaced_resource_claim_status(
            name, ns, {"status": {"devices": [theirs]}}, _content_type="application/merge-patch+json"
        )

    def devices_now():
        return [
            {"driver": d.driver, "pool": d.pool, "device": d.device, "data": d.data}
            for d in admin.read_namespaced_resource_claim_status(name, ns).status.devices or []
        ]

    # Node B's entry rewritten by node A's plugin.
    code, msg = first_denial(
        "the claim-status policy to deny another pool's entry",
        lambda: patch([{**theirs, "data": {"by": "node-a, forged"}}]),
        restore,
    )
    assert code == 403, (code, msg)
    assert (
        f"the kubelet plugin on node '{node_a}' may write only status.devices entries with driver "
        f"'{TEST_DRIVER}' and pool '{node_a}' of ResourceClaim {ns}/{name}"
    ) in msg, msg
    assert devices_now() == [theirs]

    # Node B's entry removed: refused the same way.
    code, msg = patch([mine])
    assert code == 403 and "may write only status.devices entries" in msg, (code, msg)
    # Its own entry added beside node B's: accepted.
    assert patch([theirs, mine]) == (200, "")
    assert devices_now() == [theirs, mine]
    # Another driver's device on its own node: refused, by the apiserver's per-driver check of
    # resourceclaims/driver (422, granular status authorization, on by default since 1.36) before
    # the policy (403) would.
    code, msg = patch([theirs, mine, {"driver": OTHER_DRIVER, "pool": node_a, "device": "dev-x"}])
    assert code in (403, 422), (code, msg)
    # The allocation itself: refused (resourceclaims/binding, or the policy).
    code, msg = patch(status={"allocation": None})
    assert code in (403, 422), (code, msg)
    claim = admin.read_namespaced_resource_claim_status(name, ns)
    assert len(claim.status.allocation.devices.results) == 3 and devices_now() == [theirs, mine]


# ---------------------------------------------------------------- the webhook


@pytest.fixture
def webhook(target, dyn, namespace, tmp_path, request):
    """`dra-gpu controller` (host process) registered for `namespace` with failurePolicy Fail."""
    if not target.local:
        pytest.skip("the controller runs as a host process; the apiserver must reach 127.0.0.1")
    extra = getattr(request, "param", ())
    hooks = dyn.resources.get(
        api_version="admissionregistration.k8s.io/v1", kind="ValidatingWebhookConfiguration"
    )
    ctl = Controller(target.kubeconfig, tmp_path, extra=extra)
    hook_name = f"dra-gpu-e2e-iso-{RUN}"
    try:
        wait_for("the controller to serve and list the cluster", ctl.ready, timeout=60, interval=0.2)
        hooks.create(body=_webhook_config(hook_name, ctl, namespace))
        yield ctl
    finally:
        try:
            hooks.delete(name=hook_name)
        except Exception as exc:
            if status_of(exc) != 404:
                raise
        ctl.stop()


def sharing_claim(name: str, admin_access: bool):
    exactly = {"deviceClassName": "x", "count": 1}
    if admin_access:
        exactly["adminAccess"] = True
    params = {"apiVersion": "gpu.dra-gpu.io/v1alpha1", "kind": "GpuConfig", "sharing": {"strategy": "MPS"}}
    from controller_support import HGX

    return {
        "apiVersion": RESOURCE,
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {
            "devices": {
                "requests": [{"name": "gpu", "exactly": exactly}],
                "config": [{"requests": ["gpu"], "opaque": {"driver": HGX, "parameters": params}}],
            }
        },
    }


def test_webhook_refuses_sharing_on_admin_access(core, dyn, namespace, webhook):
    core.patch_namespace(namespace, {"metadata": {"labels": {"resource.kubernetes.io/admin-access": "true"}}})
    claims = dyn.resources.get(api_version=RESOURCE, kind="ResourceClaim")
    debug = sharing_claim("debug", admin_access=True)
    code, msg = first_denial(
        "the webhook to deny MPS on adminAccess",
        lambda: call(claims.create, body=debug, namespace=namespace),
        lambda: claims.delete(name="debug", namespace=namespace),
    )
    assert code == 403, (code, msg)
    assert 'admission webhook "claims.e2e.dra-gpu.io" denied the request' in msg, msg
    assert f"spec.devices.config[0].opaque.parameters.sharing.strategy: claim {namespace}/debug" in msg, msg
    assert "sharing strategy MPS applies to request 'gpu', which has adminAccess" in msg, msg
    # The same claim without adminAccess is admitted.
    assert call(claims.create, body=sharing_claim("shared", admin_access=False), namespace=namespace) == (
        200,
        "",
    )


@pytest.mark.parametrize("webhook", [("--max-in-flight", "1")], indirect=True)
def test_apiserver_retries_the_webhooks_429(dyn, namespace, webhook):
    claims = dyn.resources.get(api_version=RESOURCE, kind="ResourceClaim")
    probes = iter(range(1000))

    def reviewed() -> bool:  # the configuration is loaded once a claim's review reaches the webhook
        call(
            claims.create,
            body=sharing_claim(f"probe-{next(probes)}", admin_access=False),
            namespace=namespace,
        )
        return 'dra_gpu_admission_reviews_total{kind="ResourceClaim"' in webhook.get("/metrics")

    wait_for("the webhook to answer a review", reviewed, timeout=60, interval=0.5)
    # Hold the only slot: a review whose body never comes (the webhook drops it after 2 s).
    ctx = ssl.create_default_context(cadata=webhook.ca_pem.decode())
    raw = socket.create_connection(("127.0.0.1", webhook.port), timeout=10)
    stalled = ctx.wrap_socket(raw, server_hostname="127.0.0.1")
    try:
        stalled.sendall(b"POST /validate HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        time.sleep(0.2)
        start = time.monotonic()
        assert call(claims.create, body=sharing_claim("later", admin_access=False), namespace=namespace) == (
            200,
            "",
        )
        took = time.monotonic() - start
    finally:
        stalled.close()
    throttled = [
        line
        for line in webhook.get("/metrics").splitlines()
        if line.startswith("dra_gpu_admission_throttled_total ")
    ]
    assert throttled and float(throttled[0].split()[1]) >= 1, throttled
    assert took >= 0.9, took  # the apiserver waited Retry-After: 1 before it retried
