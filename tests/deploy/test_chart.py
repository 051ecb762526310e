"""The Helm chart rendered by the real Helm: objects, wiring, least-privilege RBAC, the node-scoped
slice policy, TLS, DeviceClasses; and that the chart's settings are ones the CLI reads."""

from __future__ import annotations

import base64
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from .conftest import CHART, ROOT, TEST_REGISTRY, Render, by_kind, one

REGISTRY = ("--set", f"image.registry={TEST_REGISTRY}")  # the chart has none of its own

DRIVER = "gpu.dra-gpu.io"
NAMESPACED = {
    "ServiceAccount",
    "Role",
    "RoleBinding",
    "Secret",
    "Service",
    "DaemonSet",
    "Deployment",
    "PodDisruptionBudget",
    "Certificate",
    "Issuer",
    "NetworkPolicy",
}


def container(obj: dict[str, Any]) -> dict[str, Any]:
    containers = obj["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def env_of(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def test_lint(helm: str) -> None:
    r = subprocess.run(
        [helm, "lint", str(CHART), "--kube-version", "1.37.2", "--strict", *REGISTRY],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_helm_knows_its_kubernetes_version(helm: str) -> None:
    """deploy/build-helm.sh links in the Kubernetes version (as upstream's Makefile does), so
    `helm template` without --kube-version accepts the chart's kubeVersion >= 1.34."""
    r = subprocess.run([helm, "template", "x", str(CHART), *REGISTRY], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_default_render_kinds(render: Render) -> None:
    objs = render()
    kinds = sorted(o["kind"] for o in objs)
    assert kinds == sorted(
        [
            "ServiceAccount",
            "ServiceAccount",
            "ClusterRole",
            "ClusterRole",
            "ClusterRoleBinding",
            "ClusterRoleBinding",
            "Role",  # the plugin's MPS daemon pods, in its namespace
            "RoleBinding",
            "DaemonSet",
            "Deployment",
            "Service",
            "Service",  # the plugin's metrics port
            "PodDisruptionBudget",
            "Secret",
            "ValidatingWebhookConfiguration",
            "ValidatingAdmissionPolicy",
            "ValidatingAdmissionPolicyBinding",
            "ValidatingAdmissionPolicy",
            "ValidatingAdmissionPolicyBinding",
            "DeviceClass",
            "DeviceClass",
            "NetworkPolicy",
            "NetworkPolicy",
            "PriorityClass",
        ]
    )
    for o in objs:
        if o["kind"] in NAMESPACED:
            assert o["metadata"]["namespace"] == "dra-gpu", o["metadata"]["name"]
        else:
            assert "namespace" not in o["metadata"], o["metadata"]["name"]
        assert o["metadata"]["labels"]["app.kubernetes.io/instance"] == "dra-gpu"


def test_release_name_and_namespace_flow_everywhere(render: Render) -> None:
    objs = render(namespace="gpu-system", release="acme")
    vap = one(objs, "ValidatingAdmissionPolicy", "slices")
    sa = one(objs, "ServiceAccount", "kubelet-plugin")
    user = f"system:serviceaccount:gpu-system:{sa['metadata']['name']}"
    assert user in vap["spec"]["matchConditions"][0]["expression"]
    ds = one(objs, "DaemonSet")
    assert ds["spec"]["template"]["spec"]["serviceAccountName"] == sa["metadata"]["name"]
    crb = one(objs, "ClusterRoleBinding", "kubelet-plugin")
    assert crb["subjects"] == [
        {"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": "gpu-system"}
    ]


# ---------------------------------------------------------------- kubelet plugin DaemonSet


def test_daemonset_host_paths_env_and_probes(render: Render) -> None:
    objs = render()
    ds = one(objs, "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    c = container(ds)
    assert c["args"] == ["kubelet-plugin", "-v=0"]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    host = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    # Identical paths inside and outside the container.
    for name in ("plugins", "plugins-registry", "cdi", "dev"):
        assert mounts[name] == host[name], name
    assert host["plugins"] == "/var/lib/kubelet/plugins"
    assert host["plugins-registry"] == "/var/lib/kubelet/plugins_registry"
    assert host["cdi"] == "/var/run/cdi"
    assert host["dev"] == "/dev"
    env = env_of(c)
    assert env["NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert env["DRIVER_NAME"] == DRIVER
    assert env["DRA_GPU_PLUGIN_DIR"] == f"/var/lib/kubelet/plugins/{DRIVER}"
    assert env["DRA_GPU_REGISTRY_DIR"] == "/var/lib/kubelet/plugins_registry"
    assert env["DRA_GPU_CDI_DIR"] == "/var/run/cdi"
    assert "DRA_GPU_PROFILE" not in env
    # The health endpoint listens where the kubelet's probe reaches it: the pod IP, probe's port.
    assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["DRA_GPU_HTTP_ADDRESS"] == "$(POD_IP):51516"
    port = {p["name"]: p["containerPort"] for p in c["ports"]}
    probes = {"livenessProbe": "/healthz", "startupProbe": "/healthz", "readinessProbe": "/readyz"}
    for probe, path in probes.items():
        assert c[probe]["httpGet"]["path"] == path
        assert port[c[probe]["httpGet"]["port"]] == 51516
    assert {"key": "nvidia.com/gpu", "operator": "Exists"} in pod["tolerations"]  # any value and effect
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    # The chart's own class: system-node-critical is refused outside kube-system on many clusters.
    priority = one(objs, "PriorityClass")
    assert pod["priorityClassName"] == priority["metadata"]["name"] == "dra-gpu-node-critical"
    assert priority["value"] == 1_000_000_000 and not priority["globalDefault"]
    assert "hostNetwork" not in pod and "hostPID" not in pod


def test_daemonset_privileged_only_for_real_gpus(render: Render) -> None:
    real = container(one(render(), "DaemonSet"))
    assert real["securityContext"]["privileged"] is True
    sim_ds = one(render("simulatedProfile=dgx-a100-mig"), "DaemonSet")
    sim = container(sim_ds)
    sc = sim["securityContext"]
    assert sc["privileged"] is False and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["MKNOD"]}
    assert env_of(sim)["DRA_GPU_PROFILE"] == "dgx-a100-mig"
    mounts = {m["mountPath"]: m for m in sim["volumeMounts"]}
    assert "/dev" not in mounts
    # The (simulated) driver installation is read-only to the plugin.
    assert mounts["/driver-root"]["readOnly"] is True


def test_daemonset_driver_root_and_cdi_hook(render: Render) -> None:
    ds = one(render("kubeletPlugin.nvidiaDriverRoot=/run/nvidia/driver"), "DaemonSet")
    env = env_of(container(ds))
    host = {
        v["name"]: v["hostPath"]["path"] for v in ds["spec"]["template"]["spec"]["volumes"] if "hostPath" in v
    }
    # The parent is mounted, so that the driver container's (re)mount of /run/nvidia/driver is a
    # mount inside the volume, which reaches the running pod.
    assert host["driver-root"] == "/run/nvidia"
    # Found under /driver-root in the pod, named by its host path in the specs the runtime reads.
    assert env["NVIDIA_DRIVER_ROOT"] == "/driver-root/driver"
    assert env["NVIDIA_HOST_DRIVER_ROOT"] == "/run/nvidia/driver"
    for root, parent, in_pod in (("/", "/", "/driver-root"), ("/opt/nvidia/", "/opt", "/driver-root/nvidia")):
        ds = one(render(f"kubeletPlugin.nvidiaDriverRoot={root}"), "DaemonSet")
        volumes = {v["name"]: v for v in ds["spec"]["template"]["spec"]["volumes"]}
        assert volumes["driver-root"]["hostPath"]["path"] == parent, root
        assert env_of(container(ds))["NVIDIA_DRIVER_ROOT"] == in_pod, root
    assert "NVIDIA_CDI_HOOK_PATH" not in env
    hooked_ds = one(render("kubeletPlugin.cdiHookPath=/usr/bin/nvidia-cdi-hook"), "DaemonSet")
    assert env_of(container(hooked_ds))["NVIDIA_CDI_HOOK_PATH"] == "/usr/bin/nvidia-cdi-hook"
    # The plugin runs the program at start (its version and hooks): mounted, read-only, same path.
    hook_mount = {m["mountPath"]: m for m in container(hooked_ds)["volumeMounts"]}["/usr/bin/nvidia-cdi-hook"]
    assert hook_mount["readOnly"] is True
    hook_volume = {v["name"]: v for v in hooked_ds["spec"]["template"]["spec"]["volumes"]}[hook_mount["name"]]
    assert hook_volume["hostPath"] == {"path": "/usr/bin/nvidia-cdi-hook", "type": "File"}
    assert "/usr/bin/nvidia-cdi-hook" not in {m["mountPath"] for m in container(ds)["volumeMounts"]}
    assert "DRA_GPU_DYNAMIC_MIG" not in env
    objs = render("kubeletPlugin.dynamicMig=true")
    assert env_of(container(one(objs, "DaemonSet")))["DRA_GPU_DYNAMIC_MIG"] == "true"
    # Its binding conditions: watch the claims, write their device status.
    rules = [r for o in objs if o["kind"] == "ClusterRole" for r in o["rules"]]
    assert any("resourceclaims" in r["resources"] and "watch" in r["verbs"] for r in rules)
    assert any("resourceclaims/status" in r["resources"] and "patch" in r["verbs"] for r in rules)
    text = (CHART / "templates" / "kubeletplugin-daemonset.yaml").read_text()
    assert re.search(r"# Privileged: .*\n", text), "privileged mode must say why in a comment"


def test_driver_root_mount_sees_a_driver_mounted_after_the_plugin_started(render: Render) -> None:
    """The GPU Operator's driver container mounts /run/nvidia/driver after the plugin may have
    started: only HostToContainer propagation shows the plugin that mount."""
    for sets in ((), ("kubeletPlugin.nvidiaDriverRoot=/run/nvidia/driver",), ("simulatedProfile=hgx-2x4",)):
        mounts = {m["mountPath"]: m for m in container(one(render(*sets), "DaemonSet"))["volumeMounts"]}
        assert mounts["/driver-root"].get("mountPropagation") == "HostToContainer", sets
        assert mounts["/driver-root"]["readOnly"] is True


def test_no_container_gets_the_driver_root_on_its_loader_path(render: Render) -> None:
    """With driver root / (or /run/nvidia/driver) the driver's library directory holds the host's
    libc.so.6: on LD_LIBRARY_PATH it would stop the image's Python from starting."""
    for sets in ((), ("kubeletPlugin.nvidiaDriverRoot=/run/nvidia/driver",), ("simulatedProfile=hgx-2x4",)):
        for obj in render(*sets):
            if obj["kind"] not in ("DaemonSet", "Deployment"):
                continue
            pod = obj["spec"]["template"]["spec"]
            for c in pod["containers"] + pod.get("initContainers", []):
                env = env_of(c)
                for name in ("LD_LIBRARY_PATH", "LD_PRELOAD"):
                    assert name not in env, (obj["metadata"]["name"], c["name"], name, env[name])


def test_kubelet_root_dir_is_configurable(render: Render) -> None:
    ds = one(render("kubeletPlugin.kubeletRootDir=/data/kubelet/"), "DaemonSet")
    env = env_of(container(ds))
    assert env["DRA_GPU_PLUGIN_DIR"] == f"/data/kubelet/plugins/{DRIVER}"
    host = {v["hostPath"]["path"] for v in ds["spec"]["template"]["spec"]["volumes"] if "hostPath" in v}
    assert {"/data/kubelet/plugins", "/data/kubelet/plugins_registry"} <= host


def test_chart_env_names_are_read_by_the_cli(render: Render) -> None:
    """Every DRA_GPU_*/driver env var the chart sets is one `dra-gpu kubelet-plugin` reads."""
    cli = (ROOT / "dra_gpu" / "cli.py").read_text()
    cli += (ROOT / "dra_gpu" / "health" / "command.py").read_text()  # the health flags
    cli += (ROOT / "dra_gpu" / "node" / "flags.py").read_text()  # the node's names and paths
    env = env_of(container(one(render("simulatedProfile=hgx-2x4"), "DaemonSet")))
    for name in env:
        if name.startswith(("DRA_GPU_", "NVIDIA_DRIVER", "NVIDIA_HOST", "NVIDIA_CDI")) or name in (
            "NODE_NAME",
            "DRIVER_NAME",
        ):
            assert f'"{name}"' in cli, f"{name} is set by the chart but not read by dra_gpu/cli.py"


# ---------------------------------------------------------------- controller (webhook)


def test_controller_deployment_pdb_service_webhook(render: Render) -> None:
    objs = render()
    dep = one(objs, "Deployment")
    assert dep["spec"]["replicas"] == 2
    c = container(dep)
    assert c["args"][0] == "controller"
    assert "--cert=/tls/tls.crt" in c["args"] and "--key=/tls/tls.key" in c["args"]
    assert "--port=8443" in c["args"]
    # The probes use the plain-HTTP port: with clientAuth the https port wants a client certificate.
    assert "--metrics-port=8080" in c["args"] and "--max-in-flight=16" in c["args"]
    assert {"name": "metrics", "containerPort": 8080} in c["ports"]
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    pod = dep["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    # Read-only root, but the review workers' fork server needs a writable /tmp.
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    tmp = next(v for v in pod["volumes"] if v["name"] == "tmp")
    assert "emptyDir" in tmp and {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    pdb = one(objs, "PodDisruptionBudget")
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    svc = one(objs, "Service", "controller")
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    vwc = one(objs, "ValidatingWebhookConfiguration")
    (hook,) = vwc["webhooks"]
    assert hook["failurePolicy"] == "Ignore"
    assert hook["sideEffects"] == "None"
    assert hook["clientConfig"]["service"] == {
        "name": svc["metadata"]["name"],
        "namespace": "dra-gpu",
        "path": "/validate",
        "port": 443,
    }
    resources = sorted(r for rule in hook["rules"] for r in rule["resources"])
    assert resources == ["deviceclasses", "resourceclaims", "resourceclaimtemplates"]
    assert all(rule["operations"] == ["CREATE", "UPDATE"] for rule in hook["rules"])


def test_controller_args_parse_with_the_cli(render: Render) -> None:
    from dra_gpu import cli

    args = container(one(render(), "Deployment"))["args"]
    parsed = cli._parser().parse_args(args)
    assert parsed.command == "controller"
    assert (parsed.metrics_port, parsed.max_in_flight, parsed.client_ca) == (8080, 16, None)


CA_PEM = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----"


def test_client_certificate_verification(render: Render, helm: str, tmp_path: Path) -> None:
    from dra_gpu import cli

    values = tmp_path / "values.yaml"
    values.write_text(
        yaml.safe_dump(
            {
                "controller": {
                    "clientAuth": {"enabled": True, "caCert": CA_PEM, "allowedNames": ["kube-apiserver"]}
                }
            }
        )
    )
    objs = render_values(helm, values)
    dep = one(objs, "Deployment")
    c = container(dep)
    parsed = cli._parser().parse_args(c["args"])
    assert parsed.client_ca == "/client-ca/ca.crt" and parsed.client_name == ["kube-apiserver"]
    cm = one(objs, "ConfigMap", "client-ca")
    assert cm["data"]["ca.crt"].strip() == CA_PEM
    assert {"name": "client-ca", "mountPath": "/client-ca", "readOnly": True} in c["volumeMounts"]
    vol = next(v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "client-ca")
    assert vol["configMap"]["name"] == cm["metadata"]["name"]
    annotations = dep["spec"]["template"]["metadata"]["annotations"]
    assert re.fullmatch(r"[0-9a-f]{64}", annotations["checksum/client-ca"])  # a new CA rolls the pods
    # Without the CA the chart refuses to render rather than serve without verification.
    said = refused(helm, "controller.clientAuth.enabled=true")
    assert "controller.clientAuth.caCert (PEM) is needed" in said


def refused(helm: str, *sets: str) -> str:
    """What `helm template` says when it refuses to render the chart with `sets` (it must refuse)."""
    args = [a for s in sets for a in ("--set", s)]
    r = subprocess.run(
        [helm, "template", "x", str(CHART), "--kube-version", "1.37.2", *REGISTRY, *args],
        capture_output=True,
        text=True,
    )
    assert r.returncode != 0, r.stdout[:2000]
    return r.stderr


def render_values(helm: str, values: Path) -> list[dict[str, Any]]:
    r = subprocess.run(
        [
            helm,
            "template",
            "dra-gpu",
            str(CHART),
            "-n",
            "dra-gpu",
            "--kube-version",
            "1.37.2",
            "-f",
            str(values),
            *REGISTRY,
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def ports(policy: dict[str, Any]) -> list[int]:
    return sorted(p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"])


def test_network_policies_are_on_by_default(render: Render) -> None:
    """The default install: the plain-HTTP ports (/metrics, /healthz, /readyz on the pod IP) admit
    only the monitoring namespace's pods, the webhook port any source (no apiserver CIDRs given);
    every port a container opens is named, so nothing else reaches the pods (the kubelet's probes
    come from the node, which NetworkPolicy admits)."""
    objs = render()
    controller = one(objs, "NetworkPolicy", "controller")
    plugin = one(objs, "NetworkPolicy", "kubelet-plugin")
    dep, ds = one(objs, "Deployment"), one(objs, "DaemonSet")
    dep_labels = dep["spec"]["template"]["metadata"]["labels"]
    ds_labels = ds["spec"]["template"]["metadata"]["labels"]
    assert controller["spec"]["podSelector"]["matchLabels"].items() <= dep_labels.items()
    assert plugin["spec"]["podSelector"]["matchLabels"].items() <= ds_labels.items()
    assert not plugin["spec"]["podSelector"]["matchLabels"].items() <= dep_labels.items()
    assert controller["spec"]["policyTypes"] == plugin["spec"]["policyTypes"] == ["Ingress"]
    assert ports(controller) == sorted(p["containerPort"] for p in container(dep)["ports"]) == [8080, 8443]
    assert ports(plugin) == [p["containerPort"] for p in container(ds)["ports"]] == [51516]
    monitoring = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    assert controller["spec"]["ingress"] == [
        {"ports": [{"protocol": "TCP", "port": 8443}]},
        {"from": [monitoring], "ports": [{"protocol": "TCP", "port": 8080}]},
    ]
    assert plugin["spec"]["ingress"] == [
        {"from": [monitoring], "ports": [{"protocol": "TCP", "port": 51516}]}
    ]


def test_network_policy_values(render: Render) -> None:
    """An operator narrows the webhook to the apiserver's addresses, names the scrapers, moves the
    ports, or turns the policies off."""
    objs = render(
        "networkPolicy.apiserverCIDRs={10.0.0.10/32,10.0.0.11/32}",
        r"networkPolicy.metricsNamespaceSelector.matchLabels.kubernetes\.io/metadata\.name=observability",
        r"networkPolicy.metricsPodSelector.matchLabels.app\.kubernetes\.io/name=prometheus",
        "controller.metricsPort=9090",
        "kubeletPlugin.httpPort=9400",
    )
    scraper = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "observability"}},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
    }
    assert one(objs, "NetworkPolicy", "controller")["spec"]["ingress"] == [
        {
            "ports": [{"protocol": "TCP", "port": 8443}],
            "from": [{"ipBlock": {"cidr": "10.0.0.10/32"}}, {"ipBlock": {"cidr": "10.0.0.11/32"}}],
        },
        {"from": [scraper], "ports": [{"protocol": "TCP", "port": 9090}]},
    ]
    assert one(objs, "NetworkPolicy", "kubelet-plugin")["spec"]["ingress"] == [
        {"from": [scraper], "ports": [{"protocol": "TCP", "port": 9400}]}
    ]
    assert not by_kind(render("networkPolicy.enabled=false"), "NetworkPolicy")
    only_plugin = render("controller.enabled=false")
    assert [p["metadata"]["name"] for p in by_kind(only_plugin, "NetworkPolicy")] == [
        "dra-gpu-kubelet-plugin"
    ]


def test_self_signed_tls_secret_matches_the_webhook(render: Render) -> None:
    objs = render()
    secret = one(objs, "Secret")
    assert secret["type"] == "kubernetes.io/tls"
    data = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    assert "BEGIN CERTIFICATE" in data["tls.crt"] and "PRIVATE KEY" in data["tls.key"]
    hook = one(objs, "ValidatingWebhookConfiguration")["webhooks"][0]
    assert hook["clientConfig"]["caBundle"] == secret["data"]["ca.crt"]
    dep = one(objs, "Deployment")
    vol = dep["spec"]["template"]["spec"]["volumes"][0]
    assert vol["secret"]["secretName"] == secret["metadata"]["name"]
    if shutil.which("openssl"):
        svc = one(objs, "Service", "controller")["metadata"]["name"]
        r = subprocess.run(
            ["openssl", "x509", "-noout", "-text"],
            input=data["tls.crt"],
            capture_output=True,
            text=True,
            check=True,
        )
        assert f"DNS:{svc}.dra-gpu.svc" in r.stdout


def test_cert_manager_tls(render: Render) -> None:
    objs = render("controller.tls.certManager.enabled=true")
    assert not by_kind(objs, "Secret")
    cert = one(objs, "Certificate")
    issuer = one(objs, "Issuer")
    assert cert["spec"]["issuerRef"] == {"kind": "Issuer", "name": issuer["metadata"]["name"]}
    svc = one(objs, "Service", "controller")["metadata"]["name"]
    assert f"{svc}.dra-gpu.svc" in cert["spec"]["dnsNames"]
    vwc = one(objs, "ValidatingWebhookConfiguration")
    assert (
        vwc["metadata"]["annotations"]["cert-manager.io/inject-ca-from"]
        == f"dra-gpu/{cert['metadata']['name']}"
    )
    assert "caBundle" not in vwc["webhooks"][0]["clientConfig"]
    dep = one(objs, "Deployment")
    assert dep["spec"]["template"]["spec"]["volumes"][0]["secret"]["secretName"] == cert["spec"]["secretName"]
    # With an existing issuer, no Issuer is made.
    objs = render(
        "controller.tls.certManager.enabled=true",
        "controller.tls.certManager.issuerRef.kind=ClusterIssuer",
        "controller.tls.certManager.issuerRef.name=my-ca",
    )
    assert not by_kind(objs, "Issuer")
    assert one(objs, "Certificate")["spec"]["issuerRef"] == {"kind": "ClusterIssuer", "name": "my-ca"}


def test_existing_tls_secret(render: Render) -> None:
    objs = render("controller.tls.existingSecret=my-tls", "controller.tls.caBundle=Q0E=")
    assert not by_kind(objs, "Secret") and not by_kind(objs, "Certificate")
    dep = one(objs, "Deployment")
    assert dep["spec"]["template"]["spec"]["volumes"][0]["secret"]["secretName"] == "my-tls"
    assert one(objs, "ValidatingWebhookConfiguration")["webhooks"][0]["clientConfig"]["caBundle"] == "Q0E="


def test_components_can_be_disabled(render: Render) -> None:
    objs = render("controller.enabled=false")
    assert not by_kind(objs, "Deployment") and not by_kind(objs, "ValidatingWebhookConfiguration")
    objs = render("kubeletPlugin.enabled=false")
    assert not by_kind(objs, "DaemonSet") and not by_kind(objs, "ValidatingAdmissionPolicy")


# ---------------------------------------------------------------- RBAC


def rules_of(objs: list[dict[str, Any]], part: str) -> set[tuple[str, str, str, str]]:
    role = one(objs, "ClusterRole", part)
    out = set()
    for r in role["rules"]:
        for g in r["apiGroups"]:
            for res in r["resources"]:
                for v in r["verbs"]:
                    out.add((g, res, v, ",".join(r.get("resourceNames", []))))
    return out


def test_rbac_is_least_privilege(render: Render) -> None:
    objs = render()
    slice_verbs = ("get", "list", "watch", "create", "update", "patch", "delete")
    assert rules_of(objs, "kubelet-plugin") == {
        *(("resource.k8s.io", "resourceslices", v, "") for v in slice_verbs),
        ("resource.k8s.io", "resourceclaims", "get", ""),
        # a corrupt checkpoint is rebuilt from the claims allocated to the node
        ("resource.k8s.io", "resourceclaims", "list", ""),
        # prepare reads its claim from a watch of the claims (kubeletPlugin.claimWatch)
        ("resource.k8s.io", "resourceclaims", "watch", ""),
        # status.devices of the claims it prepared: patch (server-side apply), or update where the
        # apiserver refuses patches (a claim whose allocation holds an opaque config).
        ("resource.k8s.io", "resourceclaims/status", "patch", ""),
        ("resource.k8s.io", "resourceclaims/status", "update", ""),
        ("resource.k8s.io", "resourceclaims/driver", "associated-node:patch", DRIVER),
        ("resource.k8s.io", "resourceclaims/driver", "associated-node:update", DRIVER),
        ("", "nodes", "get", ""),
        # a Warning Event on an object left out of the view (dra_gpu.kube.bounds)
        ("events.k8s.io", "events", "create", ""),
    }
    assert rules_of(objs, "controller") == {
        ("resource.k8s.io", res, v, "")
        for res in ("resourceslices", "deviceclasses", "resourceclaims")
        for v in ("get", "list", "watch")
    } | {("events.k8s.io", "events", "create", "")}
    for role in by_kind(objs, "ClusterRole"):
        for r in role["rules"]:
            assert "*" not in r["verbs"] + r["resources"] + r["apiGroups"], role["metadata"]["name"]
    # The one namespaced grant: the plugin's MPS daemon pods, in the release's namespace only.
    (role,) = by_kind(objs, "Role")
    assert role["metadata"]["namespace"] == "dra-gpu", role["metadata"]
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "create", "delete"]}
    ]
    (binding,) = by_kind(objs, "RoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert [s["name"] for s in binding["subjects"]] == [role["metadata"]["name"]]


def plugin_args_with(env: dict[str, str], name: str) -> Any:
    """`kubelet-plugin`'s flags as the plugin parses them with the DaemonSet's variable `name`."""
    from dra_gpu.cli import _parser

    os.environ[name] = env[name]
    try:
        return _parser().parse_args(["kubelet-plugin"])
    finally:
        del os.environ[name]


def test_claim_watch_can_be_turned_off(render: Render) -> None:
    objs = render("kubeletPlugin.claimWatch=false")
    assert ("resource.k8s.io", "resourceclaims", "watch", "") not in rules_of(objs, "kubelet-plugin")
    env = env_of(container(one(objs, "DaemonSet")))
    assert env["DRA_GPU_CLAIM_WATCH"] == "false"
    assert plugin_args_with(env, "DRA_GPU_CLAIM_WATCH").claim_watch is False
    # Dynamic MIG watches the claims whatever the value says.
    mig = render("kubeletPlugin.claimWatch=false", "kubeletPlugin.dynamicMig=true")
    assert ("resource.k8s.io", "resourceclaims", "watch", "") in rules_of(mig, "kubelet-plugin")


@pytest.mark.parametrize(
    ("sets", "value"),
    [
        ((), "auto"),
        (("kubeletPlugin.deviceMetadata=on",), "on"),
        (("kubeletPlugin.deviceMetadata=off",), "off"),
        (("kubeletPlugin.deviceMetadata=false",), "off"),  # an unquoted off in a values file
        (("kubeletPlugin.deviceMetadata=true",), "on"),
    ],
)
def test_device_metadata_reaches_the_plugin(render: Render, sets: tuple[str, ...], value: str) -> None:
    env = env_of(container(one(render(*sets), "DaemonSet")))
    assert env["DRA_GPU_DEVICE_METADATA"] == value
    assert plugin_args_with(env, "DRA_GPU_DEVICE_METADATA").device_metadata == value


def test_claim_status_writes_can_be_turned_off(render: Render) -> None:
    objs = render("kubeletPlugin.claimStatusWrites=false")
    rules = rules_of(objs, "kubelet-plugin")
    assert not any(r[1].startswith(("resourceclaims/status", "resourceclaims/driver")) for r in rules)
    assert env_of(container(one(objs, "DaemonSet")))["DRA_GPU_CLAIM_STATUS"] == "off"


# ---------------------------------------------------------------- node-scoped slice policy


def test_validating_admission_policy(render: Render) -> None:
    objs = render()
    vap = one(objs, "ValidatingAdmissionPolicy", "slices")
    binding = one(objs, "ValidatingAdmissionPolicyBinding", "slices")
    assert binding["spec"] == {"policyName": vap["metadata"]["name"], "validationActions": ["Deny"]}
    spec = vap["spec"]
    assert spec["failurePolicy"] == "Fail"
    (rule,) = spec["matchConstraints"]["resourceRules"]
    assert rule["resources"] == ["resourceslices"]
    assert set(rule["operations"]) == {"CREATE", "UPDATE", "DELETE"}
    variables = {v["name"]: v["expression"] for v in spec["variables"]}
    assert "authentication.kubernetes.io/node-name" in variables["userNodeName"]
    assert "spec.?pool.?name" in variables["objectPool"] and "spec.?driver" in variables["objectDriver"]
    checks = [v["expression"] for v in spec["validations"]]
    assert any("variables.objectPool == variables.userNodeName" in e for e in checks)
    assert any(f'variables.objectDriver == "{DRIVER}"' in e for e in checks)
    assert "render()" not in str(spec)  # nothing left unrendered
    left = render("kubeletPlugin.nodeScopedSlicesPolicy=false")
    assert [p["metadata"]["name"] for p in by_kind(left, "ValidatingAdmissionPolicy")] == [
        "dra-gpu-node-scoped-claim-status"
    ]


def test_claim_status_policy(render: Render) -> None:
    vap = one(render(), "ValidatingAdmissionPolicy", "claim-status")
    binding = one(render(), "ValidatingAdmissionPolicyBinding", "claim-status")
    assert binding["spec"] == {"policyName": vap["metadata"]["name"], "validationActions": ["Deny"]}
    spec = vap["spec"]
    assert spec["failurePolicy"] == "Fail"
    (rule,) = spec["matchConstraints"]["resourceRules"]
    assert rule["resources"] == ["resourceclaims/status"] and rule["operations"] == ["UPDATE"]
    assert "system:serviceaccount:dra-gpu:dra-gpu-kubelet-plugin" in spec["matchConditions"][0]["expression"]
    variables = {v["name"]: v["expression"] for v in spec["variables"]}
    assert f'd.driver == "{DRIVER}" && d.pool == variables.userNodeName' in variables["foreignNew"]
    # No policy where the plugin writes no claim status, or when turned off.
    for sets in (
        ("kubeletPlugin.claimStatusWrites=false",),
        ("kubeletPlugin.nodeScopedClaimStatusPolicy=false",),
    ):
        assert not [
            p
            for p in by_kind(render(*sets), "ValidatingAdmissionPolicy")
            if "claim-status" in p["metadata"]["name"]
        ]


# ---------------------------------------------------------------- DeviceClasses


def test_device_classes(render: Render) -> None:
    classes = {c["metadata"]["name"]: c["spec"] for c in by_kind(render(), "DeviceClass")}
    assert set(classes) == {"gpu.dra-gpu.io", "mig.dra-gpu.io"}
    assert classes["gpu.dra-gpu.io"]["extendedResourceName"] == "nvidia.com/gpu"
    assert "extendedResourceName" not in classes["mig.dra-gpu.io"]
    gpu_cel = classes["gpu.dra-gpu.io"]["selectors"][0]["cel"]["expression"]
    mig_cel = classes["mig.dra-gpu.io"]["selectors"][0]["cel"]["expression"]
    assert gpu_cel == "device.driver == 'gpu.dra-gpu.io' && device.attributes['gpu.dra-gpu.io'].type == 'gpu'"
    assert mig_cel == "device.driver == 'gpu.dra-gpu.io' && device.attributes['gpu.dra-gpu.io'].type == 'mig'"
    other = {c["metadata"]["name"] for c in by_kind(render("driverName=gpu.example.org"), "DeviceClass")}
    assert other == {"gpu.example.org", "mig.example.org"}
    plain = by_kind(render("deviceClasses.gpu.extendedResourceName="), "DeviceClass")
    assert all("extendedResourceName" not in c["spec"] for c in plain)


def test_values_are_documented() -> None:
    """Every leaf key of values.yaml has a comment on it or on a parent key."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    undocumented = []
    for i, line in enumerate(lines):
        m = re.match(r"^( *)([A-Za-z][\w.]*):", line)
        if not m:
            continue
        indent = len(m.group(1))
        j, documented = i - 1, False
        while j >= 0 and lines[j].strip().startswith("#"):
            documented = True
            j -= 1
        k = i - 1
        while not documented and k >= 0:  # a documented parent covers its children
            pm = re.match(r"^( *)[A-Za-z][\w.]*:", lines[k])
            if pm and len(pm.group(1)) < indent:
                documented = k > 0 and lines[k - 1].strip().startswith("#")
                indent = len(pm.group(1))
                if indent == 0:
                    break
            k -= 1
        if not documented:
            undocumented.append(m.group(2))
    allowed = {
        "kubeletPlugin",
        "controller",
        "image",
        "deviceClasses",
        "serviceAccount",
        "tls",
        "enabled",
        "resources",
        "requests",
        "limits",
        "podAnnotations",
        "nodeSelector",
        "tolerations",
        "affinity",
        "extraEnv",
        "priorityClassName",
        "pullPolicy",
        "replicas",
        "port",
        "timeoutSeconds",
        "minAvailable",
        "rollingUpdate",
        "type",
        "maxUnavailable",
        "fullnameOverride",
        "existingSecret",
        "gpu",
        "mig",
    }
    assert set(undocumented) <= allowed, sorted(set(undocumented) - allowed)


def test_chart_files_name_no_local_paths() -> None:
    """Nothing in the chart may point into this checkout or the builder's home directory."""
    local = [str(ROOT.resolve()), str(Path.home())]
    for p in [*CHART.rglob("*"), *(ROOT / "deploy").glob("*")]:
        if p.is_file():
            text = p.read_text(errors="replace")
            assert not any(f"{d}/" in text for d in local), p


def test_memory_shares_value_reaches_the_plugin(render: Render) -> None:
    from dra_gpu.cli import _parser

    off = env_of(container(one(render(), "DaemonSet")))
    on = env_of(container(one(render("kubeletPlugin.memoryShares=true"), "DaemonSet")))
    assert off["DRA_GPU_MEMORY_SHARES"] == "false" and on["DRA_GPU_MEMORY_SHARES"] == "true"
    for value, want in (("true", True), ("false", False)):
        os.environ["DRA_GPU_MEMORY_SHARES"] = value
        try:
            args = _parser().parse_args(["kubelet-plugin"])
        finally:
            del os.environ["DRA_GPU_MEMORY_SHARES"]
        assert args.memory_shares is want


def test_mig_profiles_reach_the_plugin_and_limit_what_it_publishes(render: Render) -> None:
    """The chart's migProfiles become the plugin's --mig-profiles, and the node publishes only
    those profiles' placements, with every GPU's counter set whole."""
    from simnode.fake import discover_node

    from dra_gpu.node.settings import NodeSettings
    from dra_gpu.node.slices import build_slices

    assert "DRA_GPU_MIG_PROFILES" not in env_of(
        container(one(render("kubeletPlugin.dynamicMig=true"), "DaemonSet"))
    )
    objs = render("kubeletPlugin.dynamicMig=true", "kubeletPlugin.migProfiles={1g.10gb,7g.80gb}")
    env = env_of(container(one(objs, "DaemonSet")))
    assert env["DRA_GPU_MIG_PROFILES"] == "1g.10gb,7g.80gb"
    node = NodeSettings.from_args(plugin_args_with(env, "DRA_GPU_MIG_PROFILES"))
    assert node.mig_profiles == ("1g.10gb", "7g.80gb")

    inventory = discover_node("n", "dgx-h100-mig", dynamic_mig=True)
    every = build_slices(inventory)
    some = build_slices(inventory, mig_profiles=node.mig_profiles)

    def profiles(slices: list[dict[str, Any]]) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in slices:
            for d in s["spec"].get("devices") or []:
                name = d["attributes"]["profile"]["string"]
                out[name] = out.get(name, 0) + 1
        return out

    def counters(slices: list[dict[str, Any]]) -> list[Any]:
        return [c for s in slices for c in s["spec"].get("sharedCounters") or []]

    assert sum(profiles(every).values()) == 8 * 18
    assert profiles(some) == {"1g.10gb": 8 * 7, "7g.80gb": 8}
    assert counters(some) == counters(every)


def test_a_mig_profile_list_with_a_bad_name_is_refused() -> None:
    from dra_gpu.cli import _parser

    with pytest.raises(SystemExit):
        _parser().parse_args(["kubelet-plugin", "--mig-profiles", "1g.10gb,1g.10gb;rm"])


def test_metrics_ports_in_services_and_monitors_that_label_the_node(render: Render) -> None:
    objs = render()
    plugin_svc = one(objs, "Service", "kubelet-plugin-metrics")
    assert plugin_svc["spec"]["clusterIP"] == "None"  # one endpoint a node
    ds = one(objs, "DaemonSet")
    ports = {p["name"]: p["containerPort"] for p in container(ds)["ports"]}
    assert plugin_svc["spec"]["ports"] == [{"name": "http", "port": ports["http"], "targetPort": "http"}]
    assert ds["spec"]["template"]["metadata"]["labels"].items() >= plugin_svc["spec"]["selector"].items()
    controller_ports = {
        p["name"]
        for s in by_kind(objs, "Service")
        for p in s["spec"]["ports"]
        if "controller" in s["metadata"]["name"]
    }
    assert "metrics" in controller_ports
    assert not by_kind(objs, "PodMonitor") and not by_kind(objs, "ServiceMonitor")

    objs = render(
        "metrics.podMonitor.enabled=true",
        "metrics.serviceMonitor.enabled=true",
        "prometheusRule.enabled=true",
    )
    for kind, key in (("PodMonitor", "podMetricsEndpoints"), ("ServiceMonitor", "endpoints")):
        monitor = one(objs, kind)
        assert [e["port"] for e in monitor["spec"][key]] == ["http", "metrics"]
        for e in monitor["spec"][key]:
            assert {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node"} in e[
                "relabelings"
            ]
    alerts = [r["alert"] for g in one(objs, "PrometheusRule")["spec"]["groups"] for r in g["rules"]]
    assert "DraGpuWebhookDown" in alerts


def test_a_priority_class_of_the_operators_choice(render: Render) -> None:
    objs = render("kubeletPlugin.priorityClassName=system-node-critical", namespace="kube-system")
    assert not by_kind(objs, "PriorityClass")
    assert one(objs, "DaemonSet")["spec"]["template"]["spec"]["priorityClassName"] == "system-node-critical"


def test_no_webhook_down_alert_without_a_monitor_that_scrapes_it(render: Render) -> None:
    """Without this chart's monitor nothing says the webhook is scraped: the absence alert would
    fire for ever on a healthy install."""
    rule = one(render("prometheusRule.enabled=true"), "PrometheusRule")
    alerts = [r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]]
    assert "DraGpuWebhookDown" not in alerts and "DraGpuWebhookFailing" in alerts


@pytest.mark.parametrize(
    ("setting", "said"),
    [
        ("logFormat=xml", "at '/logFormat': value must be one of 'text', 'json'"),
        (
            "kubeletPlugin.httpPortt=51516",
            "at '/kubeletPlugin': additional properties 'httpPortt' not allowed",
        ),
        ("controller.failurePolicy=Sometimes", "at '/controller/failurePolicy': value must be one of"),
        ("kubeletPlugin.httpPort=70000", "at '/kubeletPlugin/httpPort': maximum"),
        ("kubeletPlugin.deviceMetadata=maybe", "at '/kubeletPlugin/deviceMetadata': value must be one of"),
    ],
)
def test_values_are_checked_against_the_schema(helm: str, setting: str, said: str) -> None:
    """values.schema.json: a typo or a value out of range is refused by Helm, naming the value,
    before anything reaches the cluster."""
    r = subprocess.run(
        [helm, "template", "dra-gpu", str(CHART), *REGISTRY, "--set", setting], capture_output=True, text=True
    )
    assert r.returncode != 0 and said in r.stderr, r.stderr


def test_the_plugin_waits_for_the_driver_in_an_init_container(render: Render) -> None:
    pod = one(render("kubeletPlugin.nvidiaDriverRoot=/run/nvidia/driver"), "DaemonSet")["spec"]["template"][
        "spec"
    ]
    (init,) = pod["initContainers"]
    plugin = container({"spec": {"template": {"spec": pod}}})
    assert init["args"] == ["wait-for-driver"] and init["image"] == plugin["image"]
    assert {"name": "NVIDIA_DRIVER_ROOT", "value": "/driver-root/driver"} in init["env"]
    assert env_of(plugin)["NVIDIA_DRIVER_ROOT"] == "/driver-root/driver"  # the same directory
    mount = next(m for m in init["volumeMounts"] if m["name"] == "driver-root")
    assert mount["readOnly"] and mount["mountPropagation"] == "HostToContainer"
    # A simulated node's driver is made by the plugin itself (driver root /): nothing to wait for;
    # one given as a driver root (the e2e's) is waited for as a real one.
    sim = one(render("simulatedProfile=hgx-2x4"), "DaemonSet")["spec"]["template"]["spec"]
    assert "initContainers" not in sim
    given = render("simulatedProfile=hgx-2x4", "kubeletPlugin.nvidiaDriverRoot=/opt/sim")
    assert (
        one(given, "DaemonSet")["spec"]["template"]["spec"]["initContainers"][0]["name"] == "wait-for-driver"
    )


def test_without_plugin_and_controller_only_the_classes_are_rendered(render: Render) -> None:
    """The classes alone, for a cluster that runs the driver's parts otherwise (the e2e installs
    them so): no plugin Service, PriorityClass or anything else of a part that is off."""
    kinds = [o["kind"] for o in render("controller.enabled=false", "kubeletPlugin.enabled=false")]
    assert kinds == ["DeviceClass", "DeviceClass"]


@pytest.mark.parametrize(
    ("sets", "waits"),
    [
        ((), True),  # the chart's maxSurge 1: the new pod registers before the old one stops
        (
            (
                'kubeletPlugin.updateStrategy={"type":"RollingUpdate","rollingUpdate":{"maxSurge":null,"maxUnavailable":"100%"}}',
            ),
            False,
        ),
        (
            (
                'kubeletPlugin.updateStrategy={"type":"RollingUpdate","rollingUpdate":{"maxSurge":0,"maxUnavailable":1}}',
            ),
            False,
        ),
        (
            (
                'kubeletPlugin.updateStrategy={"type":"RollingUpdate","rollingUpdate":{"maxSurge":"25%","maxUnavailable":0}}',
            ),
            True,
        ),
        (('kubeletPlugin.updateStrategy={"type":"OnDelete"}',), False),
    ],
)
def test_a_stopping_plugin_waits_for_a_successor_only_when_one_can_start_beside_it(
    helm: str, sets: tuple[str, ...], waits: bool
) -> None:
    cmd = [helm, "template", "dra-gpu", str(CHART), "--kube-version", "1.37.2", *REGISTRY]
    for s in sets:
        cmd += ["--set-json", s]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    objs = [d for d in yaml.safe_load_all(r.stdout) if d]
    ds = one(objs, "DaemonSet")
    env = env_of(container(ds))
    assert ("DRA_GPU_SUCCESSOR_WAIT" not in env) is waits, env
    strategy = ds["spec"]["updateStrategy"]
    assert strategy["type"] != "OnDelete" or "rollingUpdate" not in strategy, strategy  # the API refuses it
    if not waits:
        assert plugin_args_with(env, "DRA_GPU_SUCCESSOR_WAIT").successor_wait == 0.0
