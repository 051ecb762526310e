"""The main job on the built-in default: a real cluster, dra-gpu's plugin on the simulated `hgx-2x4`
node, and a pod asking for "4 NVLink-connected GPUs". Prints which GPUs it got and what the
container saw. Run through `scripts/demo` (which builds what is needed first).

The cluster is brought up if it is not running, and down again at the end unless it was already
running or DRA_GPU_DEMO_KEEP=1.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml
from kubernetes import client, config, dynamic

HERE = Path(__file__).resolve().parent
CLUSTER = HERE / "cluster"
DRIVER = "gpu.dra-gpu.io"
PROFILE = os.environ.get("PROFILE", "hgx-2x4")
# A plain Debian image with no NVIDIA files: the driver's user space comes from the claim.
IMAGE = os.environ.get("E2E_DEBIAN_IMAGE", "localhost/dra-gpu-e2e/debian:1")
CACHE = Path(os.environ.get("DRA_GPU_CACHE", Path.home() / ".cache" / "dra-gpu"))
# What a CUDA program's loader does first: find libcuda.so.1 (the path it resolved is printed).
PROBE = (
    "echo devices:; ls -l /dev/nvidia*; echo; env | grep -e ^NVIDIA -e ^DRA_GPU; echo; "
    'python3 -c \'import ctypes; ctypes.CDLL("libcuda.so.1"); print("libcuda.so.1 resolved to", '
    'next(l.split()[-1] for l in open("/proc/self/maps") if "libcuda" in l))\'; '
    "echo; echo '$ nvidia-smi -L'; nvidia-smi -L"
)

MANIFESTS = f"""
apiVersion: resource.k8s.io/v1
kind: DeviceClass
metadata: {{name: {DRIVER}}}
spec:
  selectors:
  - cel: {{expression: "device.driver == '{DRIVER}' && device.attributes['{DRIVER}'].type == 'gpu'"}}
---
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {{name: four-nvlink-gpus, namespace: dra-gpu-demo}}
spec:
  spec:
    devices:
      requests:
      - name: gpus
        exactly: {{deviceClassName: {DRIVER}, count: 4}}
      constraints:
      - matchAttribute: {DRIVER}/nvlinkDomain
---
apiVersion: v1
kind: Pod
metadata: {{name: nvlink-demo, namespace: dra-gpu-demo}}
spec:
  restartPolicy: Never
  terminationGracePeriodSeconds: 0
  resourceClaims: [{{name: gpus, resourceClaimTemplateName: four-nvlink-gpus}}]
  containers:
  - name: main
    image: {IMAGE}
    imagePullPolicy: Never
    command: {json.dumps(["sh", "-c", PROBE])}
    resources: {{claims: [{{name: gpus}}]}}
"""


def say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def cluster(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(CLUSTER), *args], text=True, capture_output=True, check=check)


def apply(dyn: dynamic.DynamicClient, doc: dict) -> None:
    api = dyn.resources.get(api_version=doc["apiVersion"], kind=doc["kind"])
    ns = doc["metadata"].get("namespace")
    try:
        api.create(body=doc, namespace=ns)
    except Exception as exc:
        if getattr(exc, "status", None) != 409:
            raise


def make_namespace(core: client.CoreV1Api, name: str) -> None:
    """The namespace, made afresh when the last run's is still being deleted (objects created in a
    terminating namespace are refused)."""
    deadline = time.time() + 90
    while True:
        try:
            core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
            return
        except client.ApiException as exc:
            if exc.status != 409:
                raise
        try:
            if core.read_namespace(name).status.phase != "Terminating":
                return  # there, and not going away
        except client.ApiException as exc:
            if exc.status != 404:  # 404: its deletion ended between the create and the read
                raise
            continue
        if time.time() > deadline:
            raise SystemExit(f"namespace {name} still terminating after 90 s")
        time.sleep(0.5)


def why_it_cannot_fit(dyn: dynamic.DynamicClient, template: dict) -> str | None:
    """`dra-gpu explain`'s reason why the template's claim cannot be allocated on the cluster's
    published devices now (None: it can), so the user learns it at once, not after the wait."""
    from dra_gpu.controller.commands import explain_inputs
    from dra_gpu.controller.inputs import Inputs

    def items(kind: str, **kw: str) -> list[dict]:
        api = dyn.resources.get(api_version="resource.k8s.io/v1", kind=kind)
        return list(api.get(**kw).to_dict()["items"])

    meta = template["metadata"]
    claim = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
        "spec": template["spec"]["spec"],
    }
    allocated = [c for c in items("ResourceClaim") if (c.get("status") or {}).get("allocation")]
    inputs = Inputs(
        slices=items("ResourceSlice", field_selector=f"spec.driver={DRIVER}"),
        classes=items("DeviceClass"),
        claims=[*allocated, claim],
    )
    (mine,) = [c for c in explain_inputs(inputs, DRIVER)["claims"] if c["name"] == meta["name"]]
    return None if mine["allocatable"] else str(mine["reason"])


def main() -> int:
    started = cluster("status", check=False).returncode != 0
    if started:
        say(
            "bringing up the e2e cluster (etcd, kube-apiserver, scheduler, controller-manager, "
            "containerd, kubelet)"
        )
        subprocess.run([sys.executable, str(CLUSTER), "up"], check=True)
    env = dict(line[len("export ") :].split("=", 1) for line in cluster("env").stdout.splitlines())
    kubeconfig = env["KUBECONFIG"].strip('"')
    state = Path(env["DRA_GPU_E2E_STATE"].strip('"'))
    config.load_kube_config(kubeconfig)
    api = client.ApiClient()
    core, dyn = client.CoreV1Api(api), dynamic.DynamicClient(api)
    node = core.list_node().items[0].metadata.name
    say("simulated driver installation of the node and the Debian image (built once, cached)")
    driver_root = subprocess.run(
        [
            sys.executable,
            str(HERE / "node" / "simdriver" / "build.py"),
            "--profile",
            PROFILE,
            "--cache",
            str(CACHE),
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()[-1]
    path = env["PATH"].strip('"').replace("$PATH", os.environ["PATH"])
    images = [sys.executable, str(HERE / "node" / "images.py"), str(CACHE / "images"), "--debian"]
    address = env["CONTAINERD_ADDRESS"].strip('"')
    subprocess.run([*images, "--import-to", address], check=True, env={**os.environ, "PATH": path})
    # Slices an earlier run's plugin left (another profile's GPUs) would be explained and allocated
    # until the new plugin replaces them: the node's slices are the new plugin's only.
    slices = dyn.resources.get(api_version="resource.k8s.io/v1", kind="ResourceSlice")
    for old in slices.get(field_selector=f"spec.driver={DRIVER},spec.nodeName={node}").to_dict()["items"]:
        slices.delete(name=old["metadata"]["name"])
    log = open(state / "logs" / "dra-gpu-plugin.log", "ab")  # noqa: SIM115 - the child writes it
    plugin = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dra_gpu.cli",
            "kubelet-plugin",
            "--node-name",
            node,
            "--profile",
            PROFILE,
            "--driver-root",
            driver_root,
            "--kubeconfig",
            kubeconfig,
            "--http-address",
            "",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        say(f"dra-gpu kubelet plugin started on node {node} (simulated {PROFILE}); log {log.name}")
        deadline = time.time() + 30
        while not slices.get(field_selector=f"spec.driver={DRIVER}").to_dict()["items"]:
            if time.time() > deadline or plugin.poll() is not None:
                raise SystemExit("the plugin did not publish its ResourceSlices; see " + log.name)
            time.sleep(0.2)
        make_namespace(core, "dra-gpu-demo")
        # Pods can be created only once the service-account controller made "default".
        deadline = time.time() + 30
        while not any(
            sa.metadata.name == "default" for sa in core.list_namespaced_service_account("dra-gpu-demo").items
        ):
            if time.time() > deadline:
                raise SystemExit("namespace dra-gpu-demo got no default service account in 30 s")
            time.sleep(0.2)
        docs = list(yaml.safe_load_all(MANIFESTS))
        (template,) = [d for d in docs if d["kind"] == "ResourceClaimTemplate"]
        for doc in docs:
            apply(dyn, doc)
        why = why_it_cannot_fit(dyn, template)
        if why is not None:
            say(f"pod nvlink-demo asks for 4 NVLink-connected GPUs; node {node} cannot give them: {why}")
            say("(dra-gpu explain; the scheduler leaves the pod Pending: 'cannot allocate all claims')")
            core.delete_namespace("dra-gpu-demo")
            return 1
        say("pod nvlink-demo asks for 4 NVLink-connected GPUs; waiting for it")
        deadline = time.time() + 120
        while (phase := core.read_namespaced_pod("nvlink-demo", "dra-gpu-demo").status.phase) not in (
            "Succeeded",
            "Failed",
        ):
            if time.time() > deadline:
                events = core.list_namespaced_event(
                    "dra-gpu-demo", field_selector="involvedObject.name=nvlink-demo"
                ).items
                why = "\n".join(f"    {e.reason}: {e.message}" for e in events[-5:])
                raise SystemExit(f"pod still {phase} after 120 s; its last events:\n{why}")
            time.sleep(0.5)
        output = core.read_namespaced_pod_log("nvlink-demo", "dra-gpu-demo")
        devices = {
            d["attributes"]["uuid"]["string"]: d
            for s in slices.get(field_selector=f"spec.driver={DRIVER}").to_dict()["items"]
            for d in s["spec"]["devices"]
        }
        visible = next(x for x in output.splitlines() if x.startswith("DRA_GPU_VISIBLE_DEVICES="))
        say(f"pod {phase}; the scheduler allocated:")
        for uuid in visible.split("=", 1)[1].split(","):
            a = {k: next(iter(v.values())) for k, v in devices[uuid]["attributes"].items()}
            print(
                f"    {devices[uuid]['name']}  GPU {a['index']}  {a['productName']}  "
                f"nvlinkDomain {a['nvlinkDomain']}"
            )
        say("what the container saw:")
        print("    " + output.strip().replace("\n", "\n    "))
        core.delete_namespace("dra-gpu-demo")
        return 0 if phase == "Succeeded" else 1
    finally:
        plugin.send_signal(signal.SIGTERM)
        plugin.wait(timeout=20)
        if started and os.environ.get("DRA_GPU_DEMO_KEEP") != "1":
            say("bringing the cluster down (DRA_GPU_DEMO_KEEP=1 keeps it)")
            subprocess.run([sys.executable, str(CLUSTER), "down"], check=False)


if __name__ == "__main__":
    sys.exit(main())
