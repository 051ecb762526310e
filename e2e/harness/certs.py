"""The cluster's CA, certificates and kubeconfigs, made with openssl under $STATE/pki.

They are made once and kept across `up`s (remove the state dir to make new ones).
"""

import os
import shutil

from .config import APISERVER_PORT, NODE_NAME, PKI, SERVICE_CIDR
from .processes import run, write


def openssl(*args: str) -> None:
    run(["openssl", *args], capture_output=True)


def _pki(name: str) -> str:
    return os.path.join(PKI, name)


def make_pki(ip: str) -> None:
    """A CA, a certificate and key for each component (for the node's address `ip` too), and the
    service-account key pair. Nothing is done when a complete set exists."""
    if os.path.exists(_pki(".complete")):
        return
    shutil.rmtree(PKI, ignore_errors=True)
    os.makedirs(PKI, mode=0o700)
    p = _pki
    openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "3650",
        "-keyout",
        p("ca.key"),
        "-out",
        p("ca.crt"),
        "-subj",
        "/CN=dra-gpu-e2e-ca",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
    )
    svc_ip = SERVICE_CIDR.split("/")[0].rsplit(".", 1)[0] + ".1"
    # name: (subject, extended key usage, subject alternative names)
    certs = {
        "apiserver": (
            "/CN=kube-apiserver",
            "serverAuth",
            "DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,"
            "DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,"
            f"DNS:{NODE_NAME},IP:127.0.0.1,IP:{ip},IP:{svc_ip}",
        ),
        "admin": ("/O=system:masters/CN=kubernetes-admin", "clientAuth", None),
        "kubelet-client": ("/O=system:nodes/CN=system:node:" + NODE_NAME, "clientAuth", None),
        "kubelet": ("/CN=" + NODE_NAME, "serverAuth", f"DNS:{NODE_NAME},DNS:localhost,IP:127.0.0.1,IP:{ip}"),
        "controller-manager": ("/CN=system:kube-controller-manager", "clientAuth", None),
        "scheduler": ("/CN=system:kube-scheduler", "clientAuth", None),
    }
    for name, (subj, usage, san) in certs.items():
        openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            p(name + ".key"),
            "-out",
            p(name + ".csr"),
            "-subj",
            subj,
        )
        ext = "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
        ext += f"extendedKeyUsage={usage}\n"
        if san:
            ext += f"subjectAltName={san}\n"
        write(p(name + ".ext"), ext)
        openssl(
            "x509",
            "-req",
            "-in",
            p(name + ".csr"),
            "-CA",
            p("ca.crt"),
            "-CAkey",
            p("ca.key"),
            "-CAcreateserial",
            "-days",
            "3650",
            "-out",
            p(name + ".crt"),
            "-extfile",
            p(name + ".ext"),
        )
    openssl("genrsa", "-out", p("sa.key"), "2048")
    openssl("rsa", "-in", p("sa.key"), "-pubout", "-out", p("sa.pub"))
    open(p(".complete"), "w").close()


def kubeconfig(path: str, user: str) -> None:
    """A kubeconfig for the apiserver on 127.0.0.1 with `user`'s client certificate."""
    server = f"https://127.0.0.1:{APISERVER_PORT}"
    ca, crt, key = _pki("ca.crt"), _pki(user + ".crt"), _pki(user + ".key")
    write(
        path,
        f"""apiVersion: v1
kind: Config
clusters:
- name: e2e
  cluster: {{certificate-authority: {ca}, server: '{server}'}}
users:
- name: {user}
  user: {{client-certificate: {crt}, client-key: {key}}}
contexts:
- name: e2e
  context: {{cluster: e2e, user: {user}}}
current-context: e2e
""",
        0o600,
    )
