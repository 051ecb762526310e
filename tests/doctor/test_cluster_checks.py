"""Cluster checks over a cluster view built here: classes, slices per labelled node, taints from
slices and DeviceTaintRules, why Pending pods are Pending, the admission webhook's certificate."""

from __future__ import annotations

import base64
import copy
import datetime
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dra_gpu.doctor.cluster_checks import check_device_classes, check_resource_api
from dra_gpu.doctor.cluster_view import FAILED_PREPARE, ClusterView
from dra_gpu.doctor.device_taints import check_device_taints
from dra_gpu.doctor.node_slices import check_node_slices, selector_matches
from dra_gpu.doctor.pending_pods import check_pending_pods
from dra_gpu.doctor.report import Result, Status
from dra_gpu.doctor.settings import ClusterSettings
from dra_gpu.doctor.webhook_check import check_webhook
from dra_gpu.doctor.webhook_tls import not_after
from tests.controller.objects import DRIVER, GPU_CLASS, claim, node_slices

MIG_CLASS = {**copy.deepcopy(GPU_CLASS), "metadata": {"name": "mig.dra-gpu.io"}}
NOW = datetime.datetime.now(datetime.UTC)


def view(**over: Any) -> ClusterView:
    v = ClusterView(
        server_version="v1.37.2",
        resource_versions=["v1", "v1beta2"],
        v1_resources={"resourceslices", "deviceclasses", "resourceclaims", "devicetaintrules"},
        nodes=[{"metadata": {"name": "node-a", "labels": {"nvidia.com/gpu.present": "true"}}}],
        slices=node_slices("node-a"),
        classes=[copy.deepcopy(GPU_CLASS), copy.deepcopy(MIG_CLASS)],
    )
    for k, val in over.items():
        setattr(v, k, val)
    return v


SETTINGS = ClusterSettings(kubeconfig=None, driver=DRIVER)


def only(results: Any) -> Result:
    (r,) = list(results)
    return r


def test_resource_api_served_or_not() -> None:
    assert only(check_resource_api(view(), SETTINGS)).status is Status.OK
    r = only(check_resource_api(view(resource_versions=["v1beta1"]), SETTINGS))
    assert r.status is Status.FAIL and "1.34" in r.fix


def test_device_class_deleted() -> None:
    assert only(check_device_classes(view(), SETTINGS)).status is Status.OK
    r = only(check_device_classes(view(classes=[GPU_CLASS]), SETTINGS))
    assert r.status is Status.FAIL and "mig.dra-gpu.io" in r.detail and "helm upgrade" in r.fix


def test_labelled_node_without_slices_and_incomplete_pool() -> None:
    nodes = [
        {"metadata": {"name": "node-a", "labels": {"nvidia.com/gpu.present": "true"}}},
        {"metadata": {"name": "node-b", "labels": {"nvidia.com/gpu.present": "true"}}},
    ]
    results = {r.check: r for r in check_node_slices(view(nodes=nodes), SETTINGS)}
    assert results["cluster/slices/node-a"].status is Status.OK
    assert "generation 1, 1/1 slices, 8 devices" in results["cluster/slices/node-a"].detail
    assert results["cluster/slices/node-b"].status is Status.FAIL
    slices = node_slices("node-a")
    slices[0]["spec"]["pool"]["resourceSliceCount"] = 2
    r = only(check_node_slices(view(slices=slices), SETTINGS))
    assert r.status is Status.WARN and "1 of 2 slices" in r.detail


def test_no_labelled_node() -> None:
    r = only(check_node_slices(view(nodes=[{"metadata": {"name": "node-a"}}]), SETTINGS))
    assert r.check == "cluster/gpu-nodes" and r.status is Status.WARN and "kubectl label node" in r.fix


def test_selector_matching() -> None:
    labels = {"a": "1", "b": "2"}
    assert selector_matches("a=1,b==2", labels) and selector_matches("a,!c,b!=3", labels)
    assert not selector_matches("a=2", labels) and not selector_matches("c", labels)


def _rule(name: str, device: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "spec": {
            "deviceSelector": {"driver": DRIVER, "pool": "node-a", "device": device},
            "taint": {"key": "example.com/broken", "value": "xid-79", "effect": "NoSchedule"},
        },
    }


def test_taints_from_slices_and_rules() -> None:
    assert only(check_device_taints(view(), SETTINGS)).status is Status.OK
    slices = node_slices("node-a")
    first, second = (d["name"] for d in slices[0]["spec"]["devices"][:2])
    slices[0]["spec"]["devices"][0]["taints"] = [
        {"key": f"{DRIVER}/health", "value": "xid-48", "effect": "NoExecute"}
    ]
    r = only(check_device_taints(view(slices=slices, taint_rules=[_rule("bad-gpu", second)]), SETTINGS))
    assert r.status is Status.WARN
    assert f"node-a/{first} {DRIVER}/health=xid-48:NoExecute (slice)" in r.detail
    assert f"node-a/{second} example.com/broken=xid-79:NoSchedule (DeviceTaintRule bad-gpu)" in r.detail
    assert "kubectl delete devicetaintrule bad-gpu" in r.fix


def _pod(name: str, claim_name: str, node: str = "", **status: Any) -> dict[str, Any]:
    created = (NOW - datetime.timedelta(minutes=5)).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "metadata": {
            "name": name,
            "namespace": "default",
            "uid": name + "-uid",
            "creationTimestamp": created,
        },
        "spec": {"nodeName": node, "resourceClaims": [{"name": "gpus", "resourceClaimName": claim_name}]},
        "status": {"phase": "Pending", **status},
    }


def test_pending_pod_with_a_claim_nobody_can_satisfy() -> None:
    huge = claim("huge", count=16)
    del huge["kind"], huge["apiVersion"]  # as the items of a list call come
    v = view(claims=[huge], pending_pods=[_pod("p", "huge")])
    r = only(check_pending_pods(v, SETTINGS))
    assert r.check == "cluster/pending/default/p" and r.status is Status.FAIL
    assert "claim huge not allocatable" in r.detail and "16" in r.detail and "kind" not in r.detail
    assert "dra-gpu explain" in r.fix


def test_pending_pod_whose_class_was_deleted() -> None:
    c = claim("mig")
    c["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] = "mig.dra-gpu.io"
    v = view(claims=[c], pending_pods=[_pod("p", "mig")], classes=[GPU_CLASS])
    r = only(check_pending_pods(v, SETTINGS))
    assert r.status is Status.FAIL and "mig.dra-gpu.io, which does not exist" in r.detail


def test_pending_pod_blocked_by_tainted_devices() -> None:
    devices = [d["name"] for d in node_slices("node-a")[0]["spec"]["devices"]]
    v = view(
        claims=[claim("all8", count=8)],
        pending_pods=[_pod("p", "all8")],
        taint_rules=[_rule("bad-gpu", devices[3])],
    )
    r = only(check_pending_pods(v, SETTINGS))
    assert r.status is Status.FAIL and "only tainted devices" in r.detail and "toleration" in r.fix


def test_pending_pod_with_a_prepare_failure_event() -> None:
    c = claim("one")
    c["status"] = {
        "allocation": {"devices": {"results": [{"driver": DRIVER, "pool": "node-a", "device": "x"}]}}
    }
    event = {
        "reason": FAILED_PREPARE,
        "message": "failed to prepare: device node /dev/nvidia3 is missing",
        "involvedObject": {"kind": "Pod", "name": "p", "namespace": "default"},
        "lastTimestamp": NOW.isoformat(),
    }
    v = view(claims=[c], pending_pods=[_pod("p", "one", node="node-a")], prepare_events=[event])
    r = only(check_pending_pods(v, SETTINGS))
    assert r.status is Status.FAIL and "/dev/nvidia3 is missing" in r.detail and "node-a" in r.fix


def test_no_pending_pods_and_other_drivers_pods_ignored() -> None:
    other = claim("peer")
    other["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] = "gpu.example.com"
    r = only(check_pending_pods(view(claims=[other], pending_pods=[_pod("p", "peer")]), SETTINGS))
    assert r.status is Status.OK and r.check == "cluster/pending-pods"


# ---------------------------------------------------------------- webhook certificates


def _certs(tmp: Path, days: float) -> tuple[Path, Path, bytes]:
    """A CA and a 127.0.0.1 server certificate valid until now + `days` (negative: expired)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "doctor test CA")])
    start = NOW - datetime.timedelta(days=400)
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(1)
        .not_valid_before(start)
        .not_valid_after(NOW + datetime.timedelta(days=3650))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(2)
        .not_valid_before(start)
        .not_valid_after(NOW + datetime.timedelta(days=days))
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    (tmp / "tls.crt").write_bytes(cert.public_bytes(pem))
    (tmp / "tls.key").write_bytes(
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return tmp / "tls.crt", tmp / "tls.key", ca.public_bytes(pem)


def test_not_after_reads_utc_and_generalized_time(tmp_path: Path) -> None:
    for days in (-3, 30, 365 * 40):  # 40 years: after 2049, GeneralizedTime
        crt, _, _ = _certs(tmp_path, days)
        der = ssl.PEM_cert_to_DER_cert(crt.read_text())
        assert abs((not_after(der) - (NOW + datetime.timedelta(days=days))).total_seconds()) < 2


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[Any]:
    """start(days) -> (url, caBundle) of a TLS server on 127.0.0.1 with such a certificate."""
    servers: list[ssl.SSLSocket] = []

    def start(days: float) -> tuple[str, str]:
        import socket

        crt, key, ca = _certs(tmp_path, days)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(crt, key)
        raw = socket.socket()
        raw.bind(("127.0.0.1", 0))
        raw.listen(8)
        srv = ctx.wrap_socket(raw, server_side=True)
        servers.append(srv)

        def serve() -> None:
            while True:
                try:
                    conn, _ = srv.accept()
                    conn.close()
                except ssl.SSLError:
                    continue  # a client that refused the certificate
                except OSError:
                    return

        threading.Thread(target=serve, daemon=True).start()
        return f"https://127.0.0.1:{srv.getsockname()[1]}/validate", base64.b64encode(ca).decode()

    yield start
    for s in servers:
        s.close()


def _webhook_view(url: str, ca: str) -> ClusterView:
    hook = {
        "name": f"validate.{DRIVER}",
        "failurePolicy": "Fail",
        "clientConfig": {"url": url, "caBundle": ca},
    }
    return view(webhook_configs=[{"metadata": {"name": "dra-gpu-controller"}, "webhooks": [hook]}])


def test_webhook_valid_expiring_expired_and_unreachable(tls_server: Any) -> None:
    url, ca = tls_server(365)
    r = only(check_webhook(_webhook_view(url, ca), SETTINGS))
    assert r.status is Status.OK and "trusted by the caBundle" in r.detail, r.detail
    url, ca = tls_server(10)
    assert only(check_webhook(_webhook_view(url, ca), SETTINGS)).status is Status.WARN
    url, ca = tls_server(-1)
    r = only(check_webhook(_webhook_view(url, ca), SETTINGS))
    assert r.status is Status.FAIL and "expired" in r.detail and "renew" in r.fix
    r = only(check_webhook(_webhook_view("https://127.0.0.1:1/validate", ca), SETTINGS))
    assert r.status is Status.FAIL and "unreachable" in r.detail


def test_webhook_not_installed_is_a_warning() -> None:
    r = only(check_webhook(view(), SETTINGS))
    assert r.status is Status.WARN and "controller.enabled=true" in r.fix
