"""The controller (issue 5) against the real cluster: `dra-gpu controller` as a host process, its
admission webhook registered with the real kube-apiserver (see controller_support.py for the
test's drivers and classes).
"""

from __future__ import annotations

import base64
import datetime
import ipaddress
import json
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from controller_support import (
    GPU_CLASS,
    HGX,
    RESOURCE,
    RUN,
    WEBHOOK_LABEL,
    device_class,
    ignore_404,
    k8s_library_claims,
    make_claim,
    request,
    status_of,
)
from support import wait_for

pytestmark = pytest.mark.e2e


def _make_certs(tmp: Path) -> tuple[Path, Path, bytes]:
    """A self-signed CA and a server certificate for 127.0.0.1 signed by it."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "dra-gpu e2e webhook CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False
        )
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    ca_pem = ca.public_bytes(pem)
    (tmp / "tls.crt").write_bytes(cert.public_bytes(pem))
    (tmp / "tls.key").write_bytes(
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    (tmp / "tls.key").chmod(0o600)
    (tmp / "ca.crt").write_bytes(ca_pem)
    return tmp / "tls.crt", tmp / "tls.key", ca_pem


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Controller:
    """`dra-gpu controller` as a host process, watching the cluster with the admin kubeconfig."""

    def __init__(self, kubeconfig: str, tmp: Path, driver: str = HGX, extra: tuple[str, ...] = ()) -> None:
        self.cert, self.key, self.ca_pem = _make_certs(tmp)
        self.port = _free_port()
        self.log_path = tmp / "controller.log"
        log = open(self.log_path, "wb")  # noqa: SIM115 - the child keeps writing to it
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dra_gpu.cli",
                "controller",
                "--cert",
                str(self.cert),
                "--key",
                str(self.key),
                "--address",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--kubeconfig",
                kubeconfig,
                "--driver-name",
                driver,
                *extra,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        self.ssl = ssl.create_default_context(cadata=self.ca_pem.decode())

    def get(self, path: str) -> str:
        with urllib.request.urlopen(f"https://127.0.0.1:{self.port}{path}", context=self.ssl, timeout=3) as r:
            return r.read().decode()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"controller exited {self.proc.returncode}:\n{self.log()[-3000:]}")
        try:
            self.get("/healthz")
        except OSError:
            return False
        # Served over TLS with our CA; and the cluster view is listed (slices, classes, claims).
        return all(f"event=listed resource={r} " in self.log() for r in ("slices", "classes", "claims"))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)


def _webhook_config(name: str, ctl: Controller, namespace: str) -> dict[str, Any]:
    common = {
        "clientConfig": {
            "url": f"https://127.0.0.1:{ctl.port}/validate",
            "caBundle": base64.b64encode(ctl.ca_pem).decode(),
        },
        "failurePolicy": "Fail",
        "sideEffects": "None",
        "admissionReviewVersions": ["v1"],
        "timeoutSeconds": 10,
    }
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": name},
        "webhooks": [
            {
                **common,
                "name": "claims.e2e.dra-gpu.io",
                "rules": [
                    {
                        "apiGroups": ["resource.k8s.io"],
                        "apiVersions": ["v1"],
                        "operations": ["CREATE", "UPDATE"],
                        "resources": ["resourceclaims", "resourceclaimtemplates"],
                        "scope": "Namespaced",
                    }
                ],
                # Only the test's namespace: other developers' claims never reach this webhook.
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
            },
            # DeviceClasses are cluster-scoped, where a namespaceSelector matches everything: an
            # objectSelector on a per-run label keeps other developers' classes out.
            {
                **common,
                "name": "classes.e2e.dra-gpu.io",
                "rules": [
                    {
                        "apiGroups": ["resource.k8s.io"],
                        "apiVersions": ["v1"],
                        "operations": ["CREATE", "UPDATE"],
                        "resources": ["deviceclasses"],
                        "scope": "Cluster",
                    }
                ],
                "objectSelector": {"matchLabels": {WEBHOOK_LABEL: RUN}},
            },
        ],
    }


def _denied(fn, *args, **kwargs) -> str:
    """The apiserver's message when `fn` is refused; fails when it is accepted."""
    try:
        fn(*args, **kwargs)
    except Exception as exc:
        if status_of(exc) is None:
            raise
        body = getattr(exc, "body", None) or str(exc)
        try:
            return str(json.loads(body).get("message"))
        except (ValueError, AttributeError):
            return str(body)
    raise AssertionError("accepted, expected a denial")


def test_webhook_in_the_apiserver(target, core, dyn, namespace, published, tmp_path):
    if not target.local:
        pytest.skip("the controller runs as a host process; the apiserver must reach 127.0.0.1")
    claims_api = dyn.resources.get(api_version=RESOURCE, kind="ResourceClaim")
    templates_api = dyn.resources.get(api_version=RESOURCE, kind="ResourceClaimTemplate")
    classes_api = dyn.resources.get(api_version=RESOURCE, kind="DeviceClass")
    hooks_api = dyn.resources.get(
        api_version="admissionregistration.k8s.io/v1", kind="ValidatingWebhookConfiguration"
    )
    h = f'device.attributes["{HGX}"]'
    typo = make_claim(
        "typo", [request("gpus", GPU_CLASS, 1, [f'{h}.prodcutName == "NVIDIA H100 80GB HBM3"'])]
    )
    sixteen = make_claim(
        "sixteen", [request("gpus", GPU_CLASS, 16)], [{"matchAttribute": f"{HGX}/nvlinkDomain"}]
    )
    good = make_claim("good", [request("gpus", GPU_CLASS, 4)], [{"matchAttribute": f"{HGX}/nvlinkDomain"}])
    bad_class = device_class(f"fid-typo-{RUN}", HGX, "gpu")
    bad_class["metadata"]["labels"] = {WEBHOOK_LABEL: RUN}
    bad_class["spec"]["selectors"].append({"cel": {"expression": f"{h}.indx == 0"}})
    hook_name = f"dra-gpu-e2e-{RUN}"
    other_ns = f"e2e-other-{RUN}"

    t0 = time.time()
    ctl = Controller(target.kubeconfig, tmp_path)
    try:
        wait_for("the controller to serve and list the cluster", ctl.ready, timeout=60, interval=0.2)
        t_ready = time.time() - t0
        hooks_api.create(body=_webhook_config(hook_name, ctl, namespace))
        try:
            # The apiserver picks the configuration up asynchronously: retry until it denies.
            def typo_denied():
                try:
                    claims_api.create(body=typo, namespace=namespace)
                except Exception as exc:
                    if status_of(exc) is None:
                        raise
                    return json.loads(exc.body)["message"]
                claims_api.delete(name="typo", namespace=namespace)
                return None

            msg = wait_for("the webhook to deny the CEL typo", typo_denied, timeout=30, interval=0.5)
            assert 'admission webhook "claims.e2e.dra-gpu.io" denied the request' in msg, msg
            assert "unknown attribute" in msg and "'productName'" in msg, msg
            assert "spec.devices.requests[0].exactly.selectors[0].cel.expression" in msg, msg

            msg = _denied(claims_api.create, body=sixteen, namespace=namespace)
            assert "can never be satisfied" in msg, msg

            tmpl = {
                "apiVersion": RESOURCE,
                "kind": "ResourceClaimTemplate",
                "metadata": {"name": "typo-template"},
                "spec": {"spec": typo["spec"]},
            }
            msg = _denied(templates_api.create, body=tmpl, namespace=namespace)
            assert "spec.spec.devices.requests[0]" in msg and "'productName'" in msg, msg

            msg = _denied(classes_api.create, body=bad_class)
            assert 'admission webhook "classes.e2e.dra-gpu.io" denied' in msg and "'index'" in msg, msg

            created = claims_api.create(body=good, namespace=namespace).to_dict()
            assert created["metadata"]["name"] == "good"
            # Valid for Kubernetes, not modelled by the validator: admitted (with a warning).
            lib = k8s_library_claims()[0]
            assert claims_api.create(body=lib, namespace=namespace).metadata.name == lib["metadata"]["name"]

            # UPDATE goes through the webhook too: a spec change is refused (the apiserver would
            # refuse it anyway, the spec being immutable; the webhook must not crash on it).
            metrics = ctl.get("/metrics")
            assert (
                'dra_gpu_admission_reviews_total{kind="ResourceClaim",operation="CREATE",'
                'result="denied"}' in metrics
            ), metrics

            # Scoping: the same invalid claim elsewhere never reaches our webhook.
            core.create_namespace({"metadata": {"name": other_ns}})
            try:
                wait_for(
                    "the default service account",
                    lambda: any(
                        sa.metadata.name == "default"
                        for sa in core.list_namespaced_service_account(other_ns).items
                    ),
                    timeout=30,
                )
                claims_api.create(body=typo, namespace=other_ns)
            finally:
                ignore_404(core.delete_namespace, other_ns, grace_period_seconds=0)
            print(
                f"\n[controller] ready in {t_ready:.1f} s; denied: CEL typo, 16 NVLink GPUs, template, "
                "class; admitted: 4 NVLink GPUs, a find() selector; other namespace untouched",
                file=sys.stderr,
            )
        finally:
            ignore_404(hooks_api.delete, name=hook_name)
            ignore_404(classes_api.delete, name=bad_class["metadata"]["name"])
    finally:
        ctl.stop()
    assert "Traceback" not in ctl.log(), ctl.log()[-3000:]
