"""What anyone who reaches the webhook's port can do to it, bounded (docs/security.md):

- label cardinality: 2,000 reviews with distinct kinds and operations add no series;
- memory: 40 reviews with a 3 MiB kind leave neither the registry nor the process larger;
- the in-flight cap: reviews whose body never arrives hold at most max_in_flight slots, the next
  review is answered 429 with Retry-After at once, and the slots free after BODY_TIMEOUT;
- client certificates: with client_ca, a client without a certificate of that CA gets no answer,
  one whose name is not allowed gets a 403, the apiserver's certificate gets its review.
"""

from __future__ import annotations

import datetime
import http.client
import json
import socket
import ssl
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from prometheus_client.parser import text_string_to_metric_families

from dra_gpu.controller.rules import KINDS
from dra_gpu.controller.webhook import BODY_TIMEOUT, OPERATION_LABELS

from .objects import claim
from .test_webhook import Server


def review_body(kind: str, operation: str = "CREATE", obj: Any = None) -> bytes:
    return json.dumps(
        {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": "u-1",
                "kind": {"group": "resource.k8s.io", "version": "v1", "kind": kind},
                "operation": operation,
                "object": obj if obj is not None else {"metadata": {"name": "x"}},
            },
        }
    ).encode()


def review_series(server: Server) -> list[dict[str, str]]:
    status, body = server.request("/metrics")
    assert status == 200
    return [
        dict(sample.labels)
        for family in text_string_to_metric_families(body.decode())
        if family.name == "dra_gpu_admission_reviews"
        for sample in family.samples
        if sample.name == "dra_gpu_admission_reviews_total"
    ]


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    s = Server(tmp_path)
    yield s
    s.stop()


def test_distinct_kinds_and_operations_add_no_series(server: Server) -> None:
    conn = http.client.HTTPSConnection("127.0.0.1", server.port, context=server.context(), timeout=10)
    try:
        for i in range(2000):
            conn.request("POST", "/validate", review_body(f"Kind{i}", f"OP{i}"))
            resp = conn.getresponse()
            assert resp.status == 200
            assert json.loads(resp.read())["response"]["allowed"] is True
    finally:
        conn.close()
    series = review_series(server)
    assert {s["kind"] for s in series} <= {*KINDS, "other", "?"}, series
    assert {s["operation"] for s in series} <= {*OPERATION_LABELS, "other", "?"}, series
    assert len(series) <= 3, series
    assert {"kind": "other", "operation": "other", "result": "allowed"} in series


def test_large_kinds_grow_neither_registry_nor_process(server: Server) -> None:
    huge = "K" * (3 * 1024 * 1024 - 16)  # just under the longest string a review may hold
    server.request("/validate", review_body("warm-up"))  # the first connection's own allocations
    before = rss_bytes()
    for i in range(40):
        status, raw = server.request("/validate", review_body(huge + str(i)))
        assert status == 200, raw[:300]
    grown = rss_bytes() - before
    status, text = server.request("/metrics")
    assert status == 200 and len(text) < 64 * 1024, len(text)  # 40 x 3 MiB kept as labels before
    assert grown < 48 * 1024 * 1024, f"process grew by {grown / 2**20:.0f} MiB"


def stalled_review(port: int, context: ssl.SSLContext) -> ssl.SSLSocket:
    """A review whose headers announce a body that never comes: it holds a slot until BODY_TIMEOUT."""
    raw = socket.create_connection(("127.0.0.1", port), timeout=10)
    s = context.wrap_socket(raw, server_hostname="127.0.0.1")
    s.sendall(
        b"POST /validate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000\r\n\r\n{"
    )
    return s


def test_reviews_over_the_cap_get_a_fast_429(tmp_path: Path) -> None:
    server = Server(tmp_path, max_in_flight=3)
    stalled: list[ssl.SSLSocket] = []
    try:
        stalled = [stalled_review(server.port, server.context()) for _ in range(3)]
        req = urllib.request.Request(
            f"https://127.0.0.1:{server.port}/validate",
            data=review_body("ResourceClaim", obj=claim("one")),
            headers={"Content-Type": "application/json"},
        )
        deadline, status, headers, took = time.monotonic() + 10, 0, {}, 0.0
        while time.monotonic() < deadline:  # until the three stalled ones are being read
            start = time.monotonic()
            try:
                with urllib.request.urlopen(req, context=server.context(), timeout=10) as resp:
                    status = resp.status
            except urllib.error.HTTPError as exc:
                status, headers = exc.code, dict(exc.headers)
            took = time.monotonic() - start
            if status == 429:
                break
            time.sleep(0.05)
        assert status == 429, status
        assert headers.get("Retry-After") == "1"
        assert took < 0.5, took
        # The stalled ones time out (408) and free their slots: reviews are answered again.
        for s in stalled:
            s.settimeout(BODY_TIMEOUT + 5)
            assert s.recv(100).startswith(b"HTTP/1.1 408"), "stalled review not timed out"
        assert server.review(claim("one"))["allowed"] is True
        metrics = server.request("/metrics")[1].decode()
        assert "dra_gpu_admission_throttled_total 1.0" in metrics
    finally:
        for s in stalled:
            s.close()
        server.stop()


# ---------------------------------------------------------------- client certificates


def issue(
    directory: Path, name: str, cn: str, ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None
) -> tuple[Path, Path, x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A CA (ca=None) or a client certificate signed by `ca`; written as name.crt / name.key."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca[0].subject if ca else subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca is None, path_length=None), critical=True)
    )
    if ca:
        builder = builder.add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
    cert = builder.sign(ca[1] if ca else key, hashes.SHA256())
    crt, pem_key = directory / f"{name}.crt", directory / f"{name}.key"
    crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pem_key.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return crt, pem_key, cert, key


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_client_certificate_is_verified(tmp_path: Path) -> None:
    ca_crt, _, ca_cert, ca_key = issue(tmp_path, "ca", "apiserver-client-ca", None)
    apiserver = issue(tmp_path, "apiserver", "kube-apiserver", (ca_cert, ca_key))
    stranger = issue(tmp_path, "stranger", "someone-else", (ca_cert, ca_key))
    _, _, other_ca, other_key = issue(tmp_path, "other-ca", "other-ca", None)
    forged = issue(tmp_path, "forged", "kube-apiserver", (other_ca, other_key))
    metrics_port = free_port()
    server = Server(
        tmp_path,
        client_ca=str(ca_crt),
        client_names=("kube-apiserver",),
        metrics_port=metrics_port,
    )

    def post(client: tuple[Path, Path] | None) -> int:
        ctx = server.context()
        if client:
            ctx.load_cert_chain(*client)
        conn = http.client.HTTPSConnection("127.0.0.1", server.port, context=ctx, timeout=10)
        try:
            conn.request("POST", "/validate", review_body("ResourceClaim", obj=claim("one")))
            return conn.getresponse().status
        finally:
            conn.close()

    try:
        assert post(apiserver[:2]) == 200
        assert post(stranger[:2]) == 403  # a certificate of the CA, but not the apiserver's name
        for client in (None, forged[:2]):  # no certificate, or one of another CA: no answer at all
            with pytest.raises((ssl.SSLError, ConnectionResetError, BrokenPipeError)):
                post(client)
        # The probes and Prometheus use the plain-HTTP port, which needs no certificate.
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/healthz", timeout=5) as r:
            assert r.read() == b"ok\n"
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
            assert b"dra_gpu_admission_refused_clients_total 1.0" in r.read()
        with pytest.raises(urllib.error.HTTPError) as exc:  # reviews only over TLS
            urllib.request.urlopen(
                urllib.request.Request(f"http://127.0.0.1:{metrics_port}/validate", data=b"{}"), timeout=5
            )
        assert exc.value.code in (404, 405)
    finally:
        server.stop()
