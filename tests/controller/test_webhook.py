"""The admission webhook over real HTTPS on 127.0.0.1, with a self-signed certificate made here."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import json
import logging
import socket
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from dra_gpu.common.log_format import V
from dra_gpu.controller.webhook import WebhookConfig, serve

from .objects import GPU_CLASS, NVLINK, allocated, claim, device_names, node_slices


async def serve_tls(runner: web.AppRunner, cert: Path, key: Path) -> int:
    """Serve `runner`'s app over TLS with `cert` on 127.0.0.1 (a free port, returned)."""
    await runner.setup()
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert, key)
    await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=tls).start()
    return int(runner.addresses[0][1])


def make_cert(directory: Path, cn: str) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(__import__("ipaddress").ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        # Its own CA too: a client that verifies it (a kubeconfig's certificate-authority) trusts it.
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "tls.crt", directory / "tls.key"
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert_path, key_path


class Server:
    def __init__(self, tmp: Path, **overrides: Any) -> None:
        self.tmp = tmp
        self.cert, self.key = make_cert(tmp, "webhook-one")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        slices = node_slices()
        busy = allocated("busy", "node-a", [device_names(slices)[0], device_names(slices)[4]])
        cluster = tmp / "cluster.yaml"
        cluster.write_text(yaml.safe_dump_all([*slices, GPU_CLASS, busy]))
        self.config = WebhookConfig(
            cert=str(self.cert),
            key=str(self.key),
            address="127.0.0.1",
            port=self.port,
            driver="gpu.dra-gpu.io",
            watch=False,
            files=(str(cluster),),
        )
        self.config = dataclasses.replace(self.config, **overrides)
        self.loop = asyncio.new_event_loop()
        self.ready = asyncio.Event()
        self.task = self.loop.create_task(serve(self.config, self.ready, reload_interval=0.1))
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.ready.is_set():
            assert time.monotonic() < deadline, "webhook did not start"
            assert not self.task.done(), self.task
            time.sleep(0.05)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        with contextlib.suppress(asyncio.CancelledError):
            self.loop.run_until_complete(self.task)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.task.cancel)
        self.thread.join(10)

    def context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.cert))
        return ctx

    def request(self, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        req = urllib.request.Request(
            f"https://127.0.0.1:{self.port}{path}", data=body, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, context=self.context(), timeout=10) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def review(self, obj: Any, operation: str = "CREATE", old: Any = None) -> dict[str, Any]:
        kind = obj.get("kind", "ResourceClaim") if isinstance(obj, dict) else "ResourceClaim"
        body = {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": "8b2f-test",
                "kind": {"group": "resource.k8s.io", "version": "v1", "kind": kind},
                "operation": operation,
                "object": obj,
                "oldObject": old,
            },
        }
        status, raw = self.request("/validate", json.dumps(body).encode())
        assert status == 200, raw
        review = json.loads(raw)
        assert review["apiVersion"] == "admission.k8s.io/v1" and review["response"]["uid"] == "8b2f-test"
        response: dict[str, Any] = review["response"]
        return response


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    s = Server(tmp_path)
    yield s
    s.stop()


def test_admits_valid_and_denies_invalid(server: Server) -> None:
    ok = server.review(claim("two", 2, constraints=NVLINK))
    assert ok["allowed"] is True and "warnings" not in ok
    bad = server.review(claim("sixteen", 16, constraints=NVLINK))
    assert bad["allowed"] is False and bad["status"]["code"] == 403
    assert "largest NVLink domain: 4 GPUs (node-a)" in bad["status"]["message"]
    typo = server.review(claim("typo", selectors=['device.attributes["gpu.dra-gpu.io"].prodName == "x"']))
    assert not typo["allowed"] and "did you mean 'productName'?" in typo["status"]["message"]


def test_denials_are_logged_at_info_and_allowed_reviews_at_v5(
    server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    """Each allowed review is a per-request line: -v=5, not even -v=4 (debug)."""
    for threshold, want in ((V(5), {"two": "V5", "sixteen": "INFO"}), (logging.DEBUG, {"sixteen": "INFO"})):
        caplog.clear()
        with caplog.at_level(threshold, logger="dra_gpu.controller.webhook"):
            server.review(claim("two", 2, constraints=NVLINK))
            server.review(claim("sixteen", 16, constraints=NVLINK))
        levels = {
            r.getMessage().split("name=")[1].split()[0]: r.levelname
            for r in caplog.records
            if "event=admission" in r.getMessage()
        }
        assert levels == want


def test_warns_when_temporarily_unsatisfiable(server: Server) -> None:
    r = server.review(claim("four", 4, constraints=NVLINK))
    assert r["allowed"] is True
    assert any("cannot be allocated right now" in w for w in r["warnings"])


def test_update_that_keeps_the_spec_is_allowed(server: Server) -> None:
    c = claim("sixteen", 16, constraints=NVLINK)
    assert server.review(c, "UPDATE", old=c)["allowed"] is True
    assert server.review(c, "DELETE")["allowed"] is True


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b"[]",
        b'{"apiVersion": "v1"}',
        json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}).encode(),
        json.dumps(
            {
                "apiVersion": "admission.k8s.io/v1",
                "kind": "AdmissionReview",
                "request": {"uid": "u", "object": "x"},
            }
        ).encode(),
        b"[" * 100000 + b"]" * 100000,
    ],
)
def test_malformed_review_is_400(server: Server, body: bytes) -> None:
    status, _ = server.request("/validate", body)
    assert status == 400
    assert server.request("/healthz")[0] == 200  # still serving


def test_a_claim_too_deep_to_decode_is_denied_by_its_uid(server: Server) -> None:
    """The apiserver stores a claim nested 1,500 levels (its decoder allows 10,000); the review of
    its creation is denied with the reason, not answered 400 (which `failurePolicy` would decide)."""
    parameters = '{"n":' * 1500 + "1" + "}" * 1500
    body = (
        '{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{"uid":"deep-1",'
        '"kind":{"group":"resource.k8s.io","version":"v1","kind":"ResourceClaim"},"operation":"CREATE",'
        '"object":{"apiVersion":"resource.k8s.io/v1","kind":"ResourceClaim","metadata":{"name":"p"},'
        '"spec":{"devices":{"config":[{"opaque":{"driver":"gpu.dra-gpu.io","parameters":'
        + parameters
        + "}}]}}}}}"
    )
    status, answer = server.request("/validate", body.encode())
    assert status == 200, answer
    response = json.loads(answer)["response"]
    assert response["uid"] == "deep-1" and response["allowed"] is False
    assert "nested more than 64 levels deep" in response["status"]["message"]
    metrics = server.request("/metrics")[1].decode()
    assert (
        'dra_gpu_admission_reviews_total{kind="ResourceClaim",operation="?",result="denied"} 1.0' in metrics
    )


def test_healthz_and_metrics(server: Server) -> None:
    server.review(claim("one"))
    server.request("/validate", b"junk")
    status, body = server.request("/metrics")
    text = body.decode()
    assert status == 200
    assert (
        'dra_gpu_admission_reviews_total{kind="ResourceClaim",operation="CREATE",result="allowed"} 1.0'
        in text
    )
    assert 'result="malformed"} 1.0' in text
    assert "dra_gpu_webhook_watched_devices 8.0" in text
    assert 'dra_gpu_build_info{component="controller"' in text and "process_cpu_seconds_total " in text
    assert server.request("/healthz") == (200, b"ok\n")


def test_certificate_is_reloaded(server: Server) -> None:
    def served_cn() -> str:
        pem = ssl.get_server_certificate(("127.0.0.1", server.port))
        cert = x509.load_pem_x509_certificate(pem.encode())
        return str(cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value)

    assert served_cn() == "webhook-one"
    make_cert(server.tmp, "webhook-two")
    deadline = time.monotonic() + 10
    while served_cn() != "webhook-two":
        assert time.monotonic() < deadline, "certificate not reloaded"
        time.sleep(0.1)
    assert server.review(claim("one"))["allowed"] is True  # verified against the new cert


def test_the_certificate_reload_series_exist_from_the_start_at_zero() -> None:
    """DraGpuWebhookFailing's increase() over cert reload errors sees the first one."""
    from dra_gpu.controller.webhook import Metrics

    registry = Metrics().registry
    for result in ("ok", "error"):
        assert registry.get_sample_value("dra_gpu_cert_reloads_total", {"result": result}) == 0.0
