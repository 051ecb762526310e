"""`dra-gpu doctor` against the real cluster: with nothing broken every check is OK; then one thing
is broken at a time (and repaired) and doctor must name it and its fix.

The plugin runs as a host process on the simulated hgx-2x4 node (as in test_kubelet_plugin.py),
`dra-gpu controller` as a host process with a certificate made here, registered through a
ValidatingWebhookConfiguration whose objectSelector matches nothing else (failurePolicy Ignore),
so other tests' objects never reach it.
"""

from __future__ import annotations

import base64
import datetime
import ipaddress
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest
from support import sim_driver_root, wait_for
from test_kubelet_plugin import (
    CDI_DIR,
    DRIVER,
    KUBELET_ROOT,
    MIG_CLASS,
    PLUGIN_DIR,
    PROFILE,
    Plugin,
    ensure_device_classes,
    template,
)

pytestmark = pytest.mark.e2e

RUN = uuid.uuid4().hex[:6]
STATE = Path(os.environ.get("DRA_GPU_E2E_STATE", "/var/lib/dra-gpu-e2e"))
CONTAINERD_CONFIG = STATE / "containerd" / "config.toml"
WEBHOOK_CONFIG = f"dra-gpu-doctor-e2e-{RUN}"
RESOURCE = "resource.k8s.io/v1"


# ---------------------------------------------------------------- the webhook


def _certs(tmp: Path, days: float) -> tuple[Path, Path, bytes]:
    """A CA and a server certificate for 127.0.0.1 valid until now + `days` (negative: expired)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    start = now - datetime.timedelta(days=30)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "dra-gpu doctor e2e CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(now + datetime.timedelta(days=365))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "tls.crt").write_bytes(cert.public_bytes(pem))
    (tmp / "tls.key").write_bytes(
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    (tmp / "tls.key").chmod(0o600)
    return tmp / "tls.crt", tmp / "tls.key", ca.public_bytes(pem)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Webhook:
    """`dra-gpu controller --no-watch` on 127.0.0.1 with a certificate valid for `days`."""

    def __init__(self, tmp: Path) -> None:
        self.tmp, self.port = tmp, _free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.ca_pem = b""

    def start(self, days: float) -> None:
        cert, key, self.ca_pem = _certs(self.tmp / f"certs-{days}", days)
        log = open(self.tmp / "controller.log", "ab")  # noqa: SIM115 - the child keeps writing to it
        self.proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "dra_gpu.cli", "controller", "--cert", str(cert), "--key", str(key)),
                *("--address", "127.0.0.1", "--port", str(self.port), "--no-watch", "--driver-name", DRIVER),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        unverified = ssl._create_unverified_context()  # an expired certificate must still be served

        def up() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"controller exited {self.proc.returncode}")
            try:
                with urllib.request.urlopen(
                    f"https://127.0.0.1:{self.port}/healthz", context=unverified, timeout=2
                ):
                    return True
            except OSError:
                return False

        wait_for("the controller's /healthz", up, timeout=30)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)

    def configuration(self) -> dict[str, Any]:
        return {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingWebhookConfiguration",
            "metadata": {"name": WEBHOOK_CONFIG},
            "webhooks": [
                {
                    "name": f"validate.{DRIVER}",
                    "clientConfig": {
                        "url": f"https://127.0.0.1:{self.port}/validate",
                        "caBundle": base64.b64encode(self.ca_pem).decode(),
                    },
                    "failurePolicy": "Ignore",
                    "sideEffects": "None",
                    "admissionReviewVersions": ["v1"],
                    "timeoutSeconds": 5,
                    "rules": [
                        {
                            "apiGroups": ["resource.k8s.io"],
                            "apiVersions": ["v1"],
                            "operations": ["CREATE"],
                            "resources": ["resourceclaims"],
                            "scope": "Namespaced",
                        }
                    ],
                    # Nothing carries this label: no other test's object is sent here.
                    "objectSelector": {"matchLabels": {"dra-gpu-doctor-e2e": RUN}},
                }
            ],
        }


# ---------------------------------------------------------------- fixtures


class Doctor:
    def __init__(self, kubeconfig: str, node: str, driver_root: str) -> None:
        self.kubeconfig, self.node, self.driver_root = kubeconfig, node, driver_root

    def run(
        self, *extra: str, containerd_config: Path = CONTAINERD_CONFIG
    ) -> tuple[int, dict[str, Any], str]:
        """(exit code, {check: result}, the table) of one doctor run on this node and cluster."""
        args = [sys.executable, "-m", "dra_gpu.cli", "doctor", "--node-name", self.node]
        args += ["--profile", PROFILE, "--driver-root", self.driver_root, "--plugin-dir", str(PLUGIN_DIR)]
        args += ["--registry-dir", str(KUBELET_ROOT / "plugins_registry"), "--cdi-dir", str(CDI_DIR)]
        args += ["--containerd-config", str(containerd_config), "--kubeconfig", self.kubeconfig]
        args += ["--node-selector", f"kubernetes.io/hostname={self.node}", "--timeout", "5", *extra]
        r = subprocess.run([*args, "-o", "json"], capture_output=True, text=True, timeout=120)
        assert "Traceback" not in r.stderr, r.stderr
        doc = json.loads(r.stdout)
        assert doc["exitCode"] == r.returncode
        table = subprocess.run(args, capture_output=True, text=True, timeout=120).stdout
        return r.returncode, {c["check"]: c for c in doc["checks"]}, table

    def wait_for(self, what: str, check: str, status: str, timeout: float = 60) -> tuple[dict[str, Any], str]:
        """Run doctor until `check` has `status`; returns (all results, table)."""
        last: dict[str, Any] = {}

        def seen() -> bool:
            nonlocal last
            _, last, self.table = self.run()
            return last.get(check, {}).get("status") == status

        wait_for(what, seen, timeout=timeout, interval=1)
        return last, self.table


def _prepare_once(core, dyn, busybox_image: str) -> None:
    """A GPU pod run to its end, its claim prepared and unprepared by the plugin: the plugin writes
    its checkpoint at its first prepare, so node/prepared-claims has a file to check, as on any node
    that ran a GPU pod, whatever ran (or not) before this file."""
    from kubernetes import client

    namespace = f"doctor-e2e-{RUN}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=namespace)))
    try:
        wait_for(
            f"the service account of namespace {namespace}",
            lambda: any(
                a.metadata.name == "default" for a in core.list_namespaced_service_account(namespace).items
            ),
            timeout=30,
            interval=0.2,
        )
        template(dyn, namespace, "one", count=1)
        _pod(core, namespace, "once", "one", busybox_image)

        def finished() -> str | None:
            phase = core.read_namespaced_pod("once", namespace).status.phase
            return phase if phase in ("Succeeded", "Failed") else None

        phase = wait_for("the GPU pod to finish", finished, timeout=120, interval=0.5)
        assert phase == "Succeeded", core.read_namespaced_pod("once", namespace).status
        _delete_pod_and_claims(core, dyn, namespace, "once")

        def unprepared() -> bool:
            try:
                claims = json.loads((PLUGIN_DIR / "checkpoint.json").read_text())["data"]["claims"]
            except FileNotFoundError:
                return False
            return not any(c.get("namespace") == namespace for c in claims.values())

        wait_for("the plugin's checkpoint, the claim unprepared", unprepared, timeout=60, interval=0.5)
    finally:
        core.delete_namespace(namespace)


@pytest.fixture(scope="module")
def env(target, core, dyn, busybox_image, tmp_path_factory):
    if not target.local:
        pytest.skip("the plugin and the controller run as host processes only on the local e2e cluster")
    assert CONTAINERD_CONFIG.exists(), f"the local cluster's containerd config {CONTAINERD_CONFIG} is missing"
    tmp = tmp_path_factory.mktemp("doctor")
    node = core.list_node().items[0].metadata.name
    ensure_device_classes(dyn)
    plugin = Plugin(target.kubeconfig, node, tmp / "plugin.log")
    plugin.start()
    try:
        _prepare_once(core, dyn, busybox_image)
    except BaseException:
        plugin.stop()
        raise
    webhook = Webhook(tmp)
    webhook.start(days=365)
    configs = dyn.resources.get(
        api_version="admissionregistration.k8s.io/v1", kind="ValidatingWebhookConfiguration"
    )
    configs.create(body=webhook.configuration())
    doctor = Doctor(target.kubeconfig, node, sim_driver_root(PROFILE))
    try:
        yield {"node": node, "plugin": plugin, "webhook": webhook, "doctor": doctor, "tmp": tmp}
    finally:
        try:
            configs.delete(name=WEBHOOK_CONFIG)
        except Exception as e:
            if getattr(e, "status", None) != 404:
                raise
        webhook.stop()
        plugin.stop()
        slices = dyn.resources.get(api_version=RESOURCE, kind="ResourceSlice")
        for s in slices.get(field_selector=f"spec.driver={DRIVER}").to_dict()["items"]:
            slices.delete(name=s["metadata"]["name"])


def _all_ok(results: dict[str, Any]) -> None:
    bad = {k: v for k, v in results.items() if v["status"] != "OK"}
    assert not bad, json.dumps(bad, indent=2)


def _report(title: str, table: str) -> None:
    print(f"\n[doctor] {title}\n{table}")


# ---------------------------------------------------------------- the cases


def test_nothing_broken_every_check_ok(env):
    rc, results, table = env["doctor"].run()
    _report("nothing broken", table)
    _all_ok(results)
    assert rc == 0
    checks = ("node/device-nodes", "node/plugin-registration", "node/prepared-claims", "cluster/dra-features")
    for check in (*checks, "cluster/webhook"):
        assert check in results
    assert f"cluster/slices/{env['node']}" in results


def test_plugin_stopped(env):
    plugin, doctor = env["plugin"], env["doctor"]
    plugin.stop()
    try:
        rc, results, table = doctor.run()
        _report("plugin stopped", table)
        assert rc == 1
        reg = results["node/plugin-registration"]
        assert reg["status"] == "FAIL" and "registration socket" in reg["detail"]
        assert "start the kubelet plugin" in reg["fix"]
        assert results["node/plugin-service"]["status"] == "FAIL"
    finally:
        plugin.start()
    _, results, _ = doctor.run()
    assert results["node/plugin-registration"]["status"] == "OK"


def test_containerd_reads_another_cdi_dir(env):
    # containerd is shared by every test: its config is copied with the plugin's dir taken out.
    text = CONTAINERD_CONFIG.read_text()
    start = text.index("cdi_spec_dirs")
    end = text.index("\n", start)
    broken = env["tmp"] / "containerd-config.toml"
    broken.write_text(text[:start] + "cdi_spec_dirs = ['/etc/cdi']" + text[end:])
    rc, results, table = env["doctor"].run(containerd_config=broken)
    _report("containerd reads another CDI dir", table)
    r = results["node/containerd-cdi"]
    assert rc == 1 and r["status"] == "FAIL"
    assert f"not from {CDI_DIR}" in r["detail"] and "cdi_spec_dirs" in r["fix"]


def test_device_class_deleted(env, dyn):
    classes = dyn.resources.get(api_version=RESOURCE, kind="DeviceClass")
    classes.delete(name=MIG_CLASS)
    try:
        rc, results, table = env["doctor"].run()
        _report("DeviceClass deleted", table)
        r = results["cluster/device-classes"]
        assert rc == 1 and r["status"] == "FAIL" and MIG_CLASS in r["detail"] and "helm upgrade" in r["fix"]
    finally:
        ensure_device_classes(dyn)
    _, results, _ = env["doctor"].run()
    assert results["cluster/device-classes"]["status"] == "OK"


def _pod(core, namespace: str, name: str, template_name: str, busybox_image: str) -> None:
    core.create_namespaced_pod(
        namespace,
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name},
            "spec": {
                "restartPolicy": "Never",
                "terminationGracePeriodSeconds": 0,
                "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": template_name}],
                "containers": [
                    {
                        "name": "main",
                        "image": busybox_image,
                        "imagePullPolicy": "Never",
                        "command": ["true"],
                        "resources": {"claims": [{"name": "gpus"}]},
                    }
                ],
            },
        },
    )


def _delete_pod_and_claims(core, dyn, namespace: str, pod: str) -> None:
    """The pod and its claim gone, so the next cases (and files) find every GPU free."""
    try:
        core.delete_namespaced_pod(pod, namespace, grace_period_seconds=0)
    except Exception as e:
        if getattr(e, "status", None) != 404:
            raise
    claims = dyn.resources.get(api_version=RESOURCE, kind="ResourceClaim")
    wait_for(
        f"the claims of {namespace}/{pod} to be deleted",
        lambda: not claims.get(namespace=namespace).to_dict()["items"],
        timeout=60,
        interval=0.5,
    )


def test_claim_nobody_can_satisfy(env, core, dyn, namespace, busybox_image):
    template(dyn, namespace, "sixteen", count=16)
    _pod(core, namespace, "greedy", "sixteen", busybox_image)
    check = f"cluster/pending/{namespace}/greedy"
    try:
        results, table = env["doctor"].wait_for("doctor to see the Pending pod", check, "FAIL")
    finally:
        _delete_pod_and_claims(core, dyn, namespace, "greedy")
    _report("a claim nobody can satisfy", table)
    r = results[check]
    assert (
        "not allocatable" in r["detail"] and "needs 16 GPUs" in r["detail"] and "dra-gpu explain" in r["fix"]
    )


def test_tainted_device(env, core, dyn, namespace, busybox_image):
    # The local cluster serves it (DRADeviceTaintRules is on, `env` runs only there): not found fails.
    rules = dyn.resources.get(api_version=RESOURCE, kind="DeviceTaintRule")
    slices = dyn.resources.get(api_version=RESOURCE, kind="ResourceSlice")
    items = slices.get(field_selector=f"spec.driver={DRIVER}").to_dict()["items"]
    device = items[0]["spec"]["devices"][3]["name"]
    name = f"doctor-e2e-{RUN}"
    rules.create(
        body={
            "apiVersion": RESOURCE,
            "kind": "DeviceTaintRule",
            "metadata": {"name": name},
            "spec": {
                "deviceSelector": {"driver": DRIVER, "pool": env["node"], "device": device},
                "taint": {"key": f"{DRIVER}/doctor-e2e", "value": "xid-79", "effect": "NoSchedule"},
            },
        }
    )
    try:
        template(dyn, namespace, "all-eight", count=8)
        _pod(core, namespace, "all8", "all-eight", busybox_image)
        check = f"cluster/pending/{namespace}/all8"
        results, table = env["doctor"].wait_for("doctor to see the pod blocked by the taint", check, "FAIL")
        _report("a tainted device", table)
        taints = results["cluster/device-taints"]
        assert taints["status"] == "WARN"
        assert (
            f"{env['node']}/{device} {DRIVER}/doctor-e2e=xid-79:NoSchedule (DeviceTaintRule {name})"
            in (taints["detail"])
        )
        assert f"kubectl delete devicetaintrule {name}" in taints["fix"]
        assert "only tainted devices" in results[check]["detail"] and "toleration" in results[check]["fix"]
    finally:
        rules.delete(name=name)
        _delete_pod_and_claims(core, dyn, namespace, "all8")


def test_missing_device_node(env):
    plugin, doctor = env["plugin"], env["doctor"]
    node_path = PLUGIN_DIR / "simulated-root" / "dev" / "nvidia3"
    node_path.unlink()
    rc, results, table = doctor.run()
    _report("a missing device node", table)
    r = results["node/device-nodes"]
    assert rc == 1 and r["status"] == "FAIL" and "/dev/nvidia3 missing" in r["detail"]
    assert "restart the kubelet plugin" in r["fix"]
    # The fix works: the plugin makes the simulated nodes again at start.
    plugin.stop()
    plugin.start()
    _, results, _ = doctor.run()
    assert results["node/device-nodes"]["status"] == "OK"


def test_mps_daemons_changed_limits_missing_and_orphan(env, core, dyn, namespace, busybox_image):
    from test_driver_userspace import gpu_pod
    from test_sharing import MPS_ROOT, ask, daemons, mps_config

    plugin, doctor = env["plugin"], env["doctor"]
    before = set(daemons())
    template(dyn, namespace, "mps", config=mps_config(30))
    gpu_pod(core, namespace, "mps", busybox_image, "sleep 3600", template="mps")  # prepared while it runs
    orphan = MPS_ROOT / f"orphan-{RUN}"
    try:
        pipe = wait_for("the claim's daemon", lambda: next(iter(set(daemons()) - before), None), timeout=120)
        daemon_id = pipe.parent.name
        results, _ = doctor.wait_for("doctor to see the daemon", "node/mps-daemons", "OK")
        assert "1 MPS daemons" in results["node/mps-daemons"]["detail"], results["node/mps-daemons"]

        # The plugin stopped first: its sweep (every 2 s here) would set the limits back before
        # doctor looks (and start a killed daemon again).
        plugin.stop()
        ask(pipe, "set_default_active_thread_percentage 90")  # what a root client of a 535 daemon can do
        rc, results, table = doctor.run()
        _report("an MPS daemon's limits changed", table)
        r = results["node/mps-daemons"]
        assert rc == 1 and r["status"] == "FAIL", r
        assert (
            f"daemon {daemon_id}: get_default_active_thread_percentage answered '90.0', expected 30"
            in r["detail"]
        )
        assert "sets the limits again" in r["fix"]
        ask(pipe, "set_default_active_thread_percentage 30")

        os.kill(daemons()[pipe], signal.SIGKILL)
        rc, results, table = doctor.run()
        _report("an MPS daemon died", table)
        r = results["node/mps-daemons"]
        assert (
            rc == 1 and r["status"] == "FAIL" and f"its MPS daemon {daemon_id} is not running" in r["detail"]
        ), r

        # A daemon no claim records (the simulated driver's control program: safe on the host).
        binary = Path(sim_driver_root(PROFILE)) / "usr" / "bin" / "nvidia-cuda-mps-control"
        (orphan / "pipe").mkdir(parents=True)
        (orphan / "log").mkdir()
        env_vars = {
            "CUDA_MPS_PIPE_DIRECTORY": str(orphan / "pipe"),
            "CUDA_MPS_LOG_DIRECTORY": str(orphan / "log"),
        }
        subprocess.run([str(binary), "-d"], env=env_vars, check=True, timeout=10)
        rc, results, table = doctor.run()
        _report("an orphan MPS daemon (and the dead one)", table)
        r = results["node/mps-daemons"]
        assert rc == 1 and f"orphan daemon {orphan.name} (pid " in r["detail"], r
        assert "restart the plugin" in r["fix"]

        # The fix: the plugin's start stops the orphan and starts the claim's daemon again.
        plugin.start()
        results, table = doctor.wait_for("the daemons repaired", "node/mps-daemons", "OK", timeout=60)
        _report("MPS daemons repaired", table)
        assert not orphan.exists()
    finally:
        if plugin.proc is None or plugin.proc.poll() is not None:  # failed while it was stopped
            plugin.start()
        _delete_pod_and_claims(core, dyn, namespace, "mps")
        orphan_pid = daemons().get(orphan / "pipe")
        if orphan_pid is not None:  # the test failed before the plugin's restart stopped it
            os.kill(orphan_pid, signal.SIGKILL)
        shutil.rmtree(orphan, ignore_errors=True)
    wait_for(
        "doctor to see no MPS daemon after the claim",
        lambda: "none running" in doctor.run()[1]["node/mps-daemons"]["detail"],
        timeout=60,
        interval=1,
    )


def test_webhook_certificate_expired(env, dyn):
    webhook, doctor = env["webhook"], env["doctor"]
    configs = dyn.resources.get(
        api_version="admissionregistration.k8s.io/v1", kind="ValidatingWebhookConfiguration"
    )
    webhook.stop()
    webhook.start(days=-1)
    configs.patch(body=webhook.configuration(), content_type="application/merge-patch+json")
    try:
        rc, results, table = doctor.run()
        _report("the webhook's certificate expired", table)
        r = results["cluster/webhook"]
        assert rc == 1 and r["status"] == "FAIL" and "expired" in r["detail"] and "renew" in r["fix"]
    finally:
        webhook.stop()
        webhook.start(days=365)
        configs.patch(body=webhook.configuration(), content_type="application/merge-patch+json")
    _, results, _ = doctor.run()
    assert results["cluster/webhook"]["status"] == "OK"


def test_everything_repaired_every_check_ok(env):
    # The earlier tests' namespaces (and their Pending pods) are deleted in the background.
    def all_ok() -> bool:
        rc, results, _ = env["doctor"].run()
        return rc == 0 and all(v["status"] == "OK" for v in results.values())

    wait_for("every check OK after the repairs", all_ok, timeout=90, interval=2)
    t0 = time.time()
    rc, results, _ = env["doctor"].run()
    _all_ok(results)
    assert rc == 0
    print(f"\n[doctor] {len(results)} checks after the repairs, all OK; one run {time.time() - t0:.1f} s")
