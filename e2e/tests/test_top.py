"""`dra-gpu top` in the real cluster: an A100 node (dgx-a100-mig, whole GPUs published as memory
shares) with pods holding a 4-NVLink claim, a MIG claim and two memory shares, and one GPU tainted
by a DeviceTaintRule. `dra-gpu top -o json` must name exactly the claims' devices, pods and memory
the apiserver holds and exactly the one taint; its terminal rendering (captured) shows them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest
from support import ROOT, wait_for
from test_kubelet_plugin import CDI_DIR, DRIVER, MIG_CLASS, PROFILE, claim_pod, our_slices, plugin, template  # noqa: F401
from test_sharing import memory_template

pytestmark = pytest.mark.e2e

TAINT_KEY = "example.com/top-e2e"
VENV_BIN = os.path.dirname(sys.executable)  # where the package's console scripts are installed


@pytest.fixture
def a100_shares(plugin, dyn):  # noqa: F811 - the fixture imported above
    """The plugin restarted as an A100 node whose whole GPUs are published as memory shares (one
    plugin per node: switched back afterwards)."""
    plugin.stop()
    plugin.profile, plugin.extra_args = "dgx-a100-mig", ["--memory-shares"]
    try:
        plugin.start()
        wait_for(
            "shareable GPUs and MIG devices",
            lambda: any(
                d.get("allowMultipleAllocations") for s in our_slices(dyn)[1] for d in s["spec"]["devices"]
            ),
            timeout=30,
        )
        yield plugin
    finally:
        plugin.stop()
        plugin.profile, plugin.extra_args = PROFILE, []
        plugin.start()


def top(target, *args: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "dra_gpu.cli", "top", "--kubeconfig", target.kubeconfig, *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def kubectl_binary() -> str:
    """The cluster's own kubectl (e2e/cluster builds it), as its harness names it."""
    sys.path.insert(0, str(ROOT / "e2e"))
    from harness.config import BIN_K8S

    return os.path.join(BIN_K8S, "kubectl")


def claims_of(dyn, namespace):
    api = dyn.resources.get(api_version="resource.k8s.io/v1", kind="ResourceClaim")
    return api.get(namespace=namespace).to_dict()["items"]


def expected_holdings(claims):
    """(device, claim, pods, memory of a share or None) of every allocation result, as stored."""
    out = set()
    for c in claims:
        status = c.get("status") or {}
        pods = tuple(r["name"] for r in status.get("reservedFor") or [] if r.get("resource") == "pods")
        for r in status["allocation"]["devices"]["results"]:
            memory = (r.get("consumedCapacity") or {}).get("memory") if r.get("shareID") else None
            out.add((r["device"], c["metadata"]["name"], pods, memory))
    return out


def quantity_bytes(text: str | None) -> int | None:
    from dra_gpu.kube.values import parse_quantity

    return None if text is None else int(parse_quantity(text))


def shown_holdings(doc, namespace):
    """The same facts as `dra-gpu top -o json` shows them (a whole GPU's holders; a MIG GPU's
    used instances)."""
    out = set()
    for node in doc["nodes"]:
        for domain in node["domains"]:
            for gpu in domain["gpus"]:
                held = [(gpu["name"], h) for h in gpu["holders"]]
                held += [
                    (i["device"], h) for i in (gpu.get("mig") or {}).get("used", []) for h in i["holders"]
                ]
                for device, h in held:
                    assert h["namespace"] == namespace
                    pods = tuple(p["name"] for p in h["pods"])
                    out.add((device, h["claim"], pods, h.get("memory")))
    return out


def test_top_shows_exactly_the_claims_shares_mig_and_taints(
    a100_shares, target, core, dyn, namespace, busybox_image
):
    node = core.list_node().items[0].metadata.name
    template(dyn, namespace, "four-nvlink", count=4, nvlink=True)
    template(
        dyn,
        namespace,
        "mig",
        device_class=MIG_CLASS,
        selectors=[f"device.attributes['{DRIVER}'].profile == '3g.40gb'"],
    )
    memory_template(dyn, namespace, "twenty", "20Gi")
    pods = {"trainer": "four-nvlink", "mig": "mig", "share-a": "twenty", "share-b": "twenty"}
    for pod, tmpl in pods.items():
        claim_pod(core, namespace, pod, {"resource_claim_template_name": tmpl}, "sleep 3600", busybox_image)
    for pod in pods:
        wait_for(
            f"pod {pod} running",
            lambda pod=pod: core.read_namespaced_pod(pod, namespace).status.phase == "Running",
            timeout=120,
        )
    claims = claims_of(dyn, namespace)
    # A pod no node can serve: top says why from explain, while the scheduler leaves it Pending.
    template(dyn, namespace, "eight-nvlink", count=8, nvlink=True)
    claim_pod(
        core, namespace, "too-big", {"resource_claim_template_name": "eight-nvlink"}, "true", busybox_image
    )
    pods["too-big"] = "eight-nvlink"
    wait_for(
        "the pod's claim to be made from its template",
        lambda: core.read_namespaced_pod("too-big", namespace).status.resource_claim_statuses,
        timeout=60,
    )
    trainer = next(c for c in claims if c["status"]["reservedFor"][0]["name"] == "trainer")
    tainted = trainer["status"]["allocation"]["devices"]["results"][0]["device"]
    rules = dyn.resources.get(api_version="resource.k8s.io/v1", kind="DeviceTaintRule")
    rule_name = f"top-{uuid.uuid4().hex[:6]}"
    rules.create(
        body={
            "apiVersion": "resource.k8s.io/v1",
            "kind": "DeviceTaintRule",
            "metadata": {"name": rule_name},
            "spec": {
                "deviceSelector": {"driver": DRIVER, "pool": node, "device": tainted},
                "taint": {"key": TAINT_KEY, "value": "maintenance", "effect": "NoSchedule"},
            },
        }
    )
    try:
        doc = json.loads(top(target, "-o", "json", "--node", node, "-n", namespace))
        expected = {(d, c, p, quantity_bytes(m)) for d, c, p, m in expected_holdings(claims)}
        assert shown_holdings(doc, namespace) == expected
        assert len(expected) == 7  # 4 NVLink GPUs, 1 MIG device, 2 shares
        gpus = {g["name"]: g for n in doc["nodes"] for d in n["domains"] for g in d["gpus"]}
        shares = [g for g in gpus.values() if g["state"] == "shared" and len(g["holders"]) == 2]
        (shared,) = shares  # both 20Gi shares on the one GPU the 4-GPU claim left
        assert shared["freeMemory"] == shared["memory"] - 2 * 20 * 2**30
        (mig,) = [g for g in gpus.values() if g["state"] == "mig" and g["mig"]["used"]]
        assert [u["profile"] for u in mig["mig"]["used"]] == ["3g.40gb"]

        whole = json.loads(top(target, "-o", "json", "--node", node))
        taints = {
            g["name"]: g["taints"]
            for n in whole["nodes"]
            for d in n["domains"]
            for g in d["gpus"]
            if g["tainted"]
        }
        assert taints == {
            tainted: [
                {
                    "key": TAINT_KEY,
                    "value": "maintenance",
                    "effect": "NoSchedule",
                    "source": f"DeviceTaintRule {rule_name}",
                }
            ]
        }
        assert whole["nodes"][0]["totals"]["tainted"] == 1

        # kubectl runs the installed `kubectl-dra_gpu` for `kubectl dra-gpu` (its plugin convention).
        via_kubectl = subprocess.run(
            [kubectl_binary(), "dra-gpu", "top", "-o", "json", "--node", node],
            env={**os.environ, "KUBECONFIG": target.kubeconfig, "PATH": f"{VENV_BIN}:{os.environ['PATH']}"},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert via_kubectl.returncode == 0, via_kubectl.stderr
        assert json.loads(via_kubectl.stdout)["nodes"] == whole["nodes"]

        screen = top(target, "--node", node)
        print(f"\n[e2e] dra-gpu top --node {node}:\n{screen}")
        lines = screen.splitlines()
        assert max(len(line) for line in lines) <= 80 and "\x1b[" not in screen  # not a terminal
        for _device, claim, pods_of, _memory in expected:
            owner = f"{namespace}/{pods_of[0]} (claim {claim})"
            assert any(owner in line for line in lines), (owner, screen)
        assert any(f"tainted {TAINT_KEY}=maintenance:NoSchedule (rule {rule_name})" in line for line in lines)
        assert any(line.strip().startswith(f"20Gi {namespace}/share-a") for line in lines), screen
        assert any(line.strip().startswith(f"3g.40gb  {namespace}/mig") for line in lines), screen

        mine = json.loads(top(target, "-o", "json", "-n", namespace))
        (pending,) = mine["pending"]
        assert (pending["pod"], pending["fits"]) == ("too-big", False), pending
        # 8 GPUs asked of a node whose whole GPUs are 5 (the others are in MIG mode).
        assert "request 'gpus'" in pending["reason"] and "5 devices" in pending["reason"], pending
        assert core.read_namespaced_pod("too-big", namespace).status.phase == "Pending"
        screen = top(target, "-n", namespace)
        print(f"\n[e2e] dra-gpu top -n {namespace}:\n{screen}")
        tail = screen[screen.index("pending pods") :]
        assert f"{namespace}/too-big (claim " in tail and "cannot fit: " in tail, screen
    finally:
        rules.delete(name=rule_name)
        for pod in pods:
            core.delete_namespaced_pod(pod, namespace, grace_period_seconds=0)
        # Unprepared before the fixture restarts the plugin (a force-deleted pod's object goes at
        # once; the kubelet unprepares its claims after): no claim's CDI spec is left behind.
        specs = [
            CDI_DIR / f"k8s.{DRIVER}-claim_{c['metadata']['uid']}.json" for c in claims if c.get("status")
        ]
        wait_for("the claims to be unprepared", lambda: not any(p.exists() for p in specs), timeout=90)
