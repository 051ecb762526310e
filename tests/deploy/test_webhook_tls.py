"""The chart's generated webhook certificate works: `dra-gpu controller`, started with the args
the Deployment gives it and the Secret's tls.crt/tls.key, answers HTTPS that a client verifying
with the webhook's caBundle accepts for the Service's DNS name, and admits an AdmissionReview of
the chart's own DeviceClass."""

from __future__ import annotations

import base64
import json
import socket
import ssl
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from .conftest import Render, one


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def https(port: int, host: str, ca: str, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
    ctx = ssl.create_default_context(cadata=ca)
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        ctx.wrap_socket(raw, server_hostname=host) as s,
    ):
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode()
        s.sendall(head + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, data.split(b"\r\n\r\n", 1)[1]


def test_generated_certificate_serves_the_webhook(render: Render, tmp_path: Path) -> None:
    objs = render()
    secret = one(objs, "Secret")["data"]
    (tmp_path / "tls.crt").write_bytes(base64.b64decode(secret["tls.crt"]))
    (tmp_path / "tls.key").write_bytes(base64.b64decode(secret["tls.key"]))
    ca = base64.b64decode(
        one(objs, "ValidatingWebhookConfiguration")["webhooks"][0]["clientConfig"]["caBundle"]
    ).decode()
    svc = one(objs, "Service", "controller")["metadata"]["name"]
    host = f"{svc}.dra-gpu.svc"
    args = one(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    args = [a.replace("/tls/", f"{tmp_path}/") for a in args]
    port = free_port()
    args = [a if not a.startswith("--port=") else f"--port={port}" for a in args]
    args = [a if not a.startswith("--metrics-port=") else f"--metrics-port={free_port()}" for a in args]
    proc = subprocess.Popen(
        [sys.executable, "-m", "dra_gpu.cli", *args, "--address=127.0.0.1", "--no-watch"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline, status = time.time() + 30, 0
        while time.time() < deadline:
            if proc.poll() is not None:
                out = proc.stdout.read().decode() if proc.stdout else ""
                pytest.fail(f"controller exited {proc.returncode}:\n{out}")
            try:
                status, _ = https(port, host, ca, "GET", "/healthz")
                break
            except (ConnectionRefusedError, ConnectionResetError):
                time.sleep(0.2)
        assert status == 200
        gpu_class = next(
            o for o in objs if o["kind"] == "DeviceClass" and o["metadata"]["name"] == "gpu.dra-gpu.io"
        )
        review: dict[str, Any] = {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": str(uuid.uuid4()),
                "operation": "CREATE",
                "kind": {"group": "resource.k8s.io", "version": "v1", "kind": "DeviceClass"},
                "resource": {"group": "resource.k8s.io", "version": "v1", "resource": "deviceclasses"},
                "name": "gpu.dra-gpu.io",
                "object": gpu_class,
            },
        }
        path = one(objs, "ValidatingWebhookConfiguration")["webhooks"][0]["clientConfig"]["service"]["path"]
        status, body = https(port, host, ca, "POST", path, json.dumps(review).encode())
        assert status == 200, body
        assert json.loads(body)["response"]["allowed"] is True, body
        # A client that checks the name refuses another host name.
        with pytest.raises(ssl.SSLCertVerificationError):
            https(port, "other.example.org", ca, "GET", "/healthz")
    finally:
        proc.terminate()
        proc.wait(timeout=10)
