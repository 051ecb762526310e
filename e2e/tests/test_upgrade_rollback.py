"""Upgrade and rollback under load with real Helm: the previous release (0.1.0: the chart and the
image built from the commit its tag names) installed with `helm install`, pods running on claims of
each kind, `helm upgrade` to this tree's chart and image, then `helm rollback <release> 1`.

The install is test_real_node.py's (the chart's real-node DaemonSet over the trixie host-like root
of a profile: NVIDIA's real 550 user space, the simulated NVML); Helm applies the same
DaemonSet changes through a post-renderer (real_node_post_renderer.py: the simulated kernel's
directories, host network and the apiserver's address). Helm stores the post-rendered manifest, so
the rollback restores exactly what 0.1.0 ran.

The claim kinds: on the dgx-a100-mig profile (GPUs 0-2 in MIG mode with instances made at boot,
3-7 whole) a whole GPU, a static MIG device (3g.40gb) and an MPS GPU (25 % of the threads); dynamic
MIG on the dgx-h100-mig profile (kubeletPlugin.dynamicMig=true), the second test; memory shares
(kubeletPlugin.memoryShares=true makes every whole GPU shareable: an install of its own), the
third. Left out: time-slicing (its prepare runs NVIDIA's real `nvidia-smi compute-policy
--set-timeslice`, which here finds no kernel driver and exits 9, "couldn't communicate with the
NVIDIA driver"; time-slicing is covered on the simulated profile: test_sharing.py,
test_rolling_update.py, test_reboot.py).

The rollout: this chart's default strategy is maxSurge 1 / maxUnavailable 0, but here the plugin
uses the host's network (the e2e cluster has no kube-proxy) and two plugin pods on the node cannot
both bind the HTTP port (docs/operations.md "Rolling updates"), so the upgrade sets
`kubeletPlugin.updateStrategy` to `{type: RollingUpdate, rollingUpdate: {maxUnavailable: 1,
maxSurge: 0}}`: the old pod stops, then the new one starts. The rollback restores 0.1.0's own
strategy (maxUnavailable 100 %), the same order.

What must hold after each of the two rollouts: every earlier pod Running, never restarted, seeing
the same devices (its GPU nodes and DRA_GPU_VISIBLE_DEVICES, read again in the container) with the
same allocation; no device allocated to two claims; the pods created while the rollout runs get
devices of their own (below); the MPS tenant's new client gets the claim's limit from a daemon.
MPS daemons: 0.1.0 runs each as a process of its own container (it dies with the plugin), this
version as a pod of its own; after the upgrade the new plugin restarts the claim's daemon as a pod
("MPS daemons of a prepared claim re-adopted ... restarted=1"), and after the rollback the 0.1.0
plugin re-adopts that daemon (it answers on the claim's pipe: "... re-adopted ... restarted=0")
and, at the claim's unprepare, stops it and removes its directory, whereupon the daemon pod's
supervisor ends and the pod ends. 0.1.0 never deletes a pod (it made none): the ended pod object
stays, owned by the Node, until this version starts again on the node (it deletes daemon pods no
claim record names, dra_gpu/plugin/mps_pods.py) or an operator deletes it
(`kubectl delete pod -l app.kubernetes.io/component=mps-control-daemon`); the test deletes it
after checking it ended. At the end nothing is left: no daemon pod, process, mount or directory.

During each rollout two GPU pods are created: one (a whole GPU) once the old plugin pod is
terminating, one (a 1g.10gb MIG device) once it is gone; the second's claim must be prepared by the
version rolled to."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import uuid
from pathlib import Path

import pytest
import yaml
from simnode.profiles import load_profile
from simnode.state import read_state
from support import ROOT, container_process, exec_in, helm_binary, wait_for
from test_driver_userspace import DEBIAN_IMAGE, glibc_images, gpu_pod  # noqa: F401 - a fixture
from test_dynamic_mig import profile_is
from test_kubelet_plugin import MIG_CLASS, PLUGIN_DIR, our_slices, template
from test_real_mps import MPS_ROOT, daemon_pods, daemons, mps_config, mps_mounts, mps_processes
from test_real_node import LABEL, MIG, finish
from test_sharing import memory_template, share_of

pytestmark = pytest.mark.e2e

PREVIOUS = "0.1.0"
PREVIOUS_TAG = f"v{PREVIOUS}-release"  # its image's tag here: this tree's files still say 0.1.0
POST_RENDERER = Path(__file__).with_name("real_node_post_renderer.py")
NEW_CHART = ROOT / "deploy" / "helm" / "dra-gpu"
PLUGIN_PODS = "app.kubernetes.io/component=kubelet-plugin"
ONE_AT_A_TIME = {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1, "maxSurge": 0}}
A100_MIG = "dgx-a100-mig"
KINDS = {  # pod (and template) -> the template's request
    "whole": {},
    "mig": {"device_class": MIG_CLASS, "selectors": [profile_is("3g.40gb")]},
    "mps": {"config": mps_config(25)},
}
SHOW = "ls /dev/nvidia[0-9]* | sort; env | grep ^DRA_GPU_VISIBLE_DEVICES= | sort"
ASK_MPS = "echo get_default_active_thread_percentage | nvidia-cuda-mps-control"
SHOW_MIG = f"{SHOW}; ls /dev/nvidia-caps 2>/dev/null | sort"


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout


def previous_commit() -> str:
    """The commit of tag v0.1.0, or (a clone without tags) the one CHANGELOG.md's entry names."""
    r = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", f"v{PREVIOUS}^{{commit}}"], capture_output=True, text=True
    )
    if r.returncode == 0:
        return r.stdout.strip()
    entry = (ROOT / "CHANGELOG.md").read_text().split(f"## [{PREVIOUS}]", 1)[1].split("\n## ", 1)[0]
    short = re.search(r"commit ([0-9a-f]{7,40})", entry)
    assert short, f"CHANGELOG.md's {PREVIOUS} entry names no commit"
    return git("rev-parse", f"{short.group(1)}^{{commit}}").strip()


def retag(src: Path, dst: Path, name: str) -> None:
    """Copy an OCI archive, naming its image `name` (index.json's ref.name, which containerd uses)."""
    with tarfile.open(src) as tin, tarfile.open(dst, "w") as tout:
        for m in tin.getmembers():
            if m.name == "index.json":
                index = json.load(tin.extractfile(m))
                for manifest in index["manifests"]:
                    manifest.setdefault("annotations", {})["org.opencontainers.image.ref.name"] = name
                data = json.dumps(index).encode()
                m.size = len(data)
                tout.addfile(m, io.BytesIO(data))
            else:
                tout.addfile(m, tin.extractfile(m) if m.isfile() else None)


def previous_image(commit: str) -> tuple[str, ...]:
    """The previous release's image, built by its own e2e/node/image_build.sh from a worktree of the
    commit, as localhost/dra-gpu:v0.1.0-release, cached as CACHE/images/dra-gpu-release-<commit>.tar
    (a second run imports it without building). The build gets a cache directory of its own
    (DRA_GPU_CACHE, which 0.1.0's script honours) sharing only the buildah store and the base
    rootfs tarballs: this tree's archive and its cache key are never touched."""
    from harness.components import CACHE, import_dra_gpu_image

    images = Path(CACHE) / "images"
    stem = f"dra-gpu-release-{commit[:12]}"
    archive, meta = images / f"{stem}.tar", images / f"{stem}.json"
    name = f"localhost/dra-gpu:{PREVIOUS_TAG}"
    t0 = time.time()
    built = False
    if not (archive.exists() and meta.exists()):
        tmp = Path(tempfile.mkdtemp(prefix="dra-gpu-release-"))
        tree, cache = tmp / "tree", tmp / "cache"
        try:
            git("worktree", "add", "--detach", str(tree), commit)
            (cache / "images").mkdir(parents=True)
            (cache / "buildah").symlink_to(Path(CACHE) / "buildah")
            (cache / "images" / "dra-gpu-base").symlink_to(images / "dra-gpu-base")
            env = {**os.environ, "DRA_GPU_CACHE": str(cache), "PYTHON": sys.executable}
            r = subprocess.run(
                ["bash", str(tree / "e2e" / "node" / "image_build.sh")],
                capture_output=True,
                text=True,
                env=env,
            )
            if r.returncode != 0:
                pytest.fail(f"{PREVIOUS}'s image_build.sh failed:\n{r.stderr[-4000:]}")
            retag(cache / "images" / "dra-gpu.tar", Path(f"{archive}.tmp"), name)
            os.replace(f"{archive}.tmp", archive)
            built_meta = json.loads((cache / "images" / "dra-gpu.json").read_text())
            meta.write_text(json.dumps({**built_meta, "name": name, "commit": commit}))
            built = True
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], capture_output=True
            )
            subprocess.run(["git", "-C", str(ROOT), "worktree", "prune"], capture_output=True)
            shutil.rmtree(tmp, ignore_errors=True)
    assert import_dra_gpu_image(stem) == name
    print(
        f"\n[upgrade] {name} (commit {commit[:7]}): {'built' if built else 'cached'}, "
        f"imported in {time.time() - t0:.1f} s"
    )
    return ("image.repository=localhost/dra-gpu", f"image.tag={PREVIOUS_TAG}", "image.pullPolicy=Never")


def previous_chart(commit: str, tmp_path: Path) -> Path:
    """The previous release's chart, as its commit has it."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", commit, "deploy/helm/dra-gpu"], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(tmp_path)], input=archive, check=True)
    return tmp_path / "deploy" / "helm" / "dra-gpu"


class Release:
    """One Helm release of the chart's real-node DaemonSet, installed, upgraded, rolled back."""

    def __init__(self, target, core, dyn, dev_root: Path, root: Path):
        self.target, self.core, self.dyn = target, core, dyn
        self.dev_root, self.root = dev_root, root
        self.name = "up-" + uuid.uuid4().hex[:6]
        self.namespace = "upgrade-" + uuid.uuid4().hex[:6]
        port = os.environ.get("DRA_GPU_E2E_APISERVER_PORT", "6443")
        self.post = ["--post-renderer", sys.executable]
        for arg in (str(POST_RENDERER), str(dev_root), port):
            self.post += ["--post-renderer-args", arg]

    def helm(self, *args: str) -> str:
        cmd = [helm_binary(), "--kubeconfig", self.target.kubeconfig, "-n", self.namespace, *args]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
        if r.returncode != 0:
            pytest.fail(f"helm {' '.join(args[:2])} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
        return r.stdout

    def values(self, image: tuple[str, ...], *more: str) -> list[str]:
        sets = [
            "image.registry=registry.example.com/gpu",
            *image,
            f"kubeletPlugin.nvidiaDriverRoot={self.root}",
            "controller.enabled=false",
            "kubeletPlugin.health.holdDownSeconds=3600",
            *more,
        ]
        return [a for s in sets for a in ("--set", s)]

    def adopt_cluster_objects(self, chart: Path, sets: list[str]) -> list[str]:
        """Cluster-scoped objects of the chart (DeviceClasses, the PriorityClass) that an earlier
        test applied without Helm: labelled and annotated for this release, which Helm then takes
        over instead of refusing the install."""
        from kubernetes.client.exceptions import ApiException

        out = subprocess.run(
            [helm_binary(), "template", self.name, str(chart), "-n", self.namespace, *sets],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        adopted = []
        for o in (o for o in yaml.safe_load_all(out) if o):
            api = self.dyn.resources.get(api_version=o["apiVersion"], kind=o["kind"])
            if api.namespaced:
                continue
            try:
                api.get(name=o["metadata"]["name"])
            except ApiException:
                continue
            api.patch(
                name=o["metadata"]["name"],
                body={
                    "metadata": {
                        "labels": {"app.kubernetes.io/managed-by": "Helm"},
                        "annotations": {
                            "meta.helm.sh/release-name": self.name,
                            "meta.helm.sh/release-namespace": self.namespace,
                        },
                    }
                },
                content_type="application/merge-patch+json",
            )
            adopted.append(f"{o['kind']}/{o['metadata']['name']}")
        return adopted

    def plugin_pods(self) -> list:
        return self.core.list_namespaced_pod(self.namespace, label_selector=PLUGIN_PODS).items

    def ready_plugin(self, image_tag: str, before: set[str]):
        """The plugin pod of `image_tag`, Ready, once it is the only one and none of `before` is left."""

        def done():
            pods = self.plugin_pods()
            if len(pods) != 1 or pods[0].metadata.uid in before:
                return None
            p = pods[0]
            ok = p.spec.containers[0].image.endswith(f":{image_tag}") and any(
                c.type == "Ready" and c.status == "True" for c in p.status.conditions or []
            )
            return p if ok else None

        return wait_for(f"the plugin of {image_tag} Ready", done, timeout=180, interval=0.5)

    def log(self, pod) -> str:
        return self.core.read_namespaced_pod_log(pod.metadata.name, self.namespace) or ""

    def uninstall(self) -> None:
        """`helm uninstall --wait` (whatever its outcome: a test's clean-up), until no plugin pod is left."""
        cmd = [helm_binary(), "--kubeconfig", self.target.kubeconfig, "-n", self.namespace]
        subprocess.run([*cmd, "uninstall", self.name, "--wait"], capture_output=True, timeout=120)
        wait_for("the plugin pods to go", lambda: not self.plugin_pods(), timeout=90)

    def open(self, node: str) -> None:
        """The release's namespace made and the node labelled for the real-node DaemonSet; no taint
        book of an earlier install."""
        from kubernetes import client

        self.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=self.namespace)))
        (PLUGIN_DIR / "health-taints.json").unlink(missing_ok=True)
        self.core.patch_node(node, {"metadata": {"labels": {LABEL: "true"}}})

    def delete_daemon_pods(self) -> list[tuple[str, str]]:
        """Delete every MPS daemon pod (ended ones as 0.1.0's operator would) and wait until they
        are gone; (name, phase) of those that were still Running."""
        from kubernetes.client.exceptions import ApiException

        pods = daemon_pods(self.core)
        running = [(p.metadata.name, p.status.phase) for p in pods if p.status.phase == "Running"]
        for p in pods:
            with contextlib.suppress(ApiException):
                self.core.delete_namespaced_pod(p.metadata.name, p.metadata.namespace, grace_period_seconds=0)
        wait_for("the daemon pods deleted", lambda: not daemon_pods(self.core), timeout=30, interval=0.5)
        return running

    def clear(self, node: str) -> None:
        """The release's namespace, the node's label and the driver's slices and taint book gone."""
        from kubernetes.client.exceptions import ApiException

        self.core.delete_namespace(self.namespace, grace_period_seconds=0)
        self.core.patch_node(node, {"metadata": {"labels": {LABEL: None}}})
        api, items = our_slices(self.dyn)
        for s in items:
            with contextlib.suppress(ApiException):
                api.delete(name=s["metadata"]["name"])
        (PLUGIN_DIR / "health-taints.json").unlink(missing_ok=True)


def allocations(dyn, namespace) -> dict[str, list[tuple[str, str, str]]]:
    """Claim name -> its allocated (pool, device, share ID or "") triples: a share of a device is
    allocated once, the device to several claims."""
    claims = dyn.resources.get(api_version="resource.k8s.io/v1", kind="ResourceClaim")
    out = {}
    for c in claims.get(namespace=namespace).to_dict()["items"]:
        alloc = (c.get("status") or {}).get("allocation")
        if alloc:
            out[c["metadata"]["name"]] = sorted(
                (r["pool"], r["device"], r.get("shareID") or "") for r in alloc["devices"]["results"]
            )
    return out


def claim_of(dyn, namespace, pod: str) -> str:
    claims = dyn.resources.get(api_version="resource.k8s.io/v1", kind="ResourceClaim")
    for c in claims.get(namespace=namespace).to_dict()["items"]:
        if pod in [o.get("name") for o in c["metadata"].get("ownerReferences") or []]:
            return c["metadata"]["name"]
    raise AssertionError(f"no claim of pod {pod}")


def running(core, namespace, name, timeout=120):
    def check():
        p = core.read_namespaced_pod(name, namespace)
        if p.status.phase != "Running":
            return None
        return p if "done" in (core.read_namespaced_pod_log(name, namespace) or "") else None

    return wait_for(f"pod {name} to run", check, timeout=timeout, interval=0.3)


def seen(core, namespace, name) -> str:
    """What the pod's container sees now: its GPU nodes and DRA_GPU_VISIBLE_DEVICES."""
    return exec_in(container_process(core.read_namespaced_pod(name, namespace))["cid"], "sh", "-c", SHOW_MIG)


def no_device_twice(allocs: dict[str, list[tuple[str, str, str]]]) -> None:
    held = [d for devices in allocs.values() for d in devices]
    assert len(held) == len(set(held)), f"a device allocated twice: {allocs}"


@pytest.fixture
def node_root(image, glibc_images):  # noqa: F811 - the fixture imported above
    """A function making the host-like root (NVIDIA's trixie user space) and kernel files of a
    profile: (root, dev_root)."""
    base = Path(os.environ.get("DRA_GPU_E2E_STATE", "/var/lib/dra-gpu-e2e")) / "upgrade-rollback"
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    from real_userspace import e2e_script
    from simnode.node import make_kernel_files

    host_like = e2e_script("host_like_root")

    def make(profile: str) -> tuple[Path, Path]:
        root = host_like.host_like_root(profile, suite="trixie")
        make_kernel_files(host_like.node_profile(profile, "trixie"), base / profile)
        return root, base / profile

    yield make
    shutil.rmtree(base, ignore_errors=True)


def test_upgrade_from_the_previous_release_and_rollback_under_load(
    target, image, node_root, core, dyn, namespace, tmp_path
):

    times: dict[str, float] = {}
    commit = previous_commit()
    t0 = time.time()
    old_image = previous_image(commit)
    times["previous image"] = time.time() - t0
    old_chart = previous_chart(commit, tmp_path)

    root, dev_root = node_root(A100_MIG)
    rel = Release(target, core, dyn, dev_root, root)
    node = core.list_node().items[0].metadata.name
    rel.open(node)
    pods: dict[str, str] = {}  # pod -> what it saw
    try:
        # 1. 0.1.0, installed by Helm; one pod per claim kind.
        t0 = time.time()
        old_values = rel.values(old_image)
        adopted = rel.adopt_cluster_objects(old_chart, old_values)
        rel.helm("install", rel.name, str(old_chart), *old_values, *rel.post)
        old_plugin = rel.ready_plugin(PREVIOUS_TAG, set())
        times["install 0.1.0"] = time.time() - t0
        t0 = time.time()
        template(dyn, namespace, "one-g", device_class=MIG_CLASS, selectors=[profile_is("1g.10gb")])
        for kind, request in KINDS.items():
            template(dyn, namespace, kind, **request)
            gpu_pod(core, namespace, kind, DEBIAN_IMAGE, f"{SHOW}; echo done; sleep 3600", template=kind)
        for kind in KINDS:
            running(core, namespace, kind)
            pods[kind] = seen(core, namespace, kind)
            assert "/dev/nvidia" in pods[kind], (kind, pods[kind])
        times["pods running on 0.1.0"] = time.time() - t0
        assert (
            exec_in(container_process(core.read_namespaced_pod("mps", namespace))["cid"], "sh", "-c", ASK_MPS)
            == "25.0"
        )
        mps_claim = claim_of(dyn, namespace, "mps")
        old_daemons = daemons()
        assert len(old_daemons) == 1 and not daemon_pods(core), (old_daemons, daemon_pods(core))
        allocs = allocations(dyn, namespace)
        no_device_twice(allocs)
        uids = {k: core.read_namespaced_pod(k, namespace).metadata.uid for k in KINDS}
        print(
            f"[upgrade] 0.1.0: adopted {adopted}; allocations {allocs}; MPS daemon (a process) {old_daemons}"
        )

        def unchanged(event: str, names) -> None:
            for name in names:
                p = core.read_namespaced_pod(name, namespace)
                (status,) = p.status.container_statuses
                assert p.status.phase == "Running" and status.restart_count == 0, (event, name, p.status)
                assert p.metadata.uid == uids[name], (event, name)
                assert seen(core, namespace, name) == pods[name], (event, name, seen(core, namespace, name))
            now = allocations(dyn, namespace)
            no_device_twice(now)
            for claim, devices in allocs.items():
                assert now.get(claim) == devices, (event, claim, now.get(claim), devices)
            tenant = container_process(core.read_namespaced_pod("mps", namespace))["cid"]
            assert exec_in(tenant, "sh", "-c", ASK_MPS) == "25.0", event  # a new client, the claim's limit

        def during_rollout(prefix: str, started: float, old_uid: str) -> list[str]:
            """Two GPU pods made while the rollout runs: `<prefix>-stopping` once the old plugin
            pod is terminating, `<prefix>-gone` once it is gone (the new one not Ready yet, or just);
            both must run, each on a device no other claim holds."""

            def old_plugin():
                return [p for p in rel.plugin_pods() if p.metadata.uid == old_uid]

            made = []
            for name, when, check, tmpl in (
                (
                    f"{prefix}-stopping",
                    "stopping",
                    lambda: not old_plugin() or old_plugin()[0].metadata.deletion_timestamp,
                    "whole",
                ),
                (f"{prefix}-gone", "gone", lambda: not old_plugin(), "one-g"),
            ):
                wait_for(f"the old plugin {when}", check, timeout=60, interval=0.1)
                times[f"{name}: created after"] = time.time() - started
                gpu_pod(core, namespace, name, DEBIAN_IMAGE, f"{SHOW}; echo done; sleep 3600", template=tmpl)
                made.append(name)
            for name in made:
                p = running(core, namespace, name, timeout=180)
                times[f"{name}: running after"] = time.time() - started
                pods[name] = seen(core, namespace, name)
                uids[name] = p.metadata.uid
                now = allocations(dyn, namespace)
                no_device_twice(now)
                claim = claim_of(dyn, namespace, name)
                assert now[claim] and claim not in allocs, (claim, now)
                allocs[claim] = now[claim]
            return made

        def prepared_by(names: list[str], log: str, new: str, old: str) -> dict[str, str]:
            """Which version prepared each pod's claim (its 'claim prepared' line in the new log)."""
            return {
                n: new if f"claim prepared claim={namespace}/{claim_of(dyn, namespace, n)} " in log else old
                for n in names
            }

        # 2. helm upgrade to this tree's chart and image, GPU pods created while it rolls.
        t0 = time.time()
        rel.helm(
            "upgrade",
            rel.name,
            str(NEW_CHART),
            *rel.values(image, "kubeletPlugin.mps.shmSize=64Mi"),
            "--set-json",
            f"kubeletPlugin.updateStrategy={json.dumps(ONE_AT_A_TIME)}",
            *rel.post,
        )
        made_up = during_rollout("upgrade", t0, old_plugin.metadata.uid)
        new_plugin = rel.ready_plugin(image[1].split("=", 1)[1], {old_plugin.metadata.uid})
        times["upgrade: helm upgrade to the new plugin Ready"] = time.time() - t0
        unchanged("upgraded", [*KINDS, *made_up])
        new_log = rel.log(new_plugin)
        by = prepared_by(made_up, new_log, "current", "0.1.0 (stopping)")
        print(f"[upgrade] claims made during the upgrade prepared by: {by}")
        assert by["upgrade-gone"] == "current", by
        adopted_line = [line for line in new_log.splitlines() if "re-adopted" in line]
        print(f"[upgrade] the current plugin on 0.1.0's state: {adopted_line}")
        assert any(
            f"claim={namespace}/{mps_claim} " in line and "restarted=1" in line for line in adopted_line
        ), new_log[-4000:]
        up_daemons = daemons()
        (dpod,) = daemon_pods(core)
        assert len(up_daemons) == 1 and dpod.status.phase == "Running", (up_daemons, dpod.status)
        assert dpod.metadata.labels["dra-gpu.io/mps-daemon"] in up_daemons, (dpod.metadata.labels, up_daemons)
        print(f"[upgrade] MPS daemon now pod {dpod.metadata.name}, pid {up_daemons} (was {old_daemons})")

        # 3. helm rollback to revision 1 (0.1.0), GPU pods created while it rolls.
        t0 = time.time()
        rel.helm("rollback", rel.name, "1")
        made_back = during_rollout("rollback", t0, new_plugin.metadata.uid)
        back_plugin = rel.ready_plugin(PREVIOUS_TAG, {new_plugin.metadata.uid})
        times["rollback: helm rollback to the 0.1.0 plugin Ready"] = time.time() - t0
        unchanged("rolled back", [*KINDS, *made_up, *made_back])
        back_log = rel.log(back_plugin)
        by = prepared_by(made_back, back_log, "0.1.0", "current (stopping)")
        print(f"[upgrade] claims made during the rollback prepared by: {by}")
        assert by["rollback-gone"] == "0.1.0", by
        lines = [line for line in back_log.splitlines() if "re-adopted" in line or "MPS daemon" in line]
        print(f"[upgrade] 0.1.0 on the current plugin's state: {lines}")
        assert any(f"claim={namespace}/{mps_claim} " in line and "re-adopted" in line for line in lines), (
            back_log[-4000:]
        )
        (dpod_after,) = daemon_pods(core)
        assert dpod_after.metadata.uid == dpod.metadata.uid and dpod_after.status.phase == "Running"

        # 4. Everything deleted: the claims unprepared by 0.1.0, then the release uninstalled.
        t0 = time.time()
        finish(core, dyn, namespace)
        wait_for(
            "no MPS daemon, process, mount or directory",
            lambda: (
                not daemons() and not mps_processes() and not mps_mounts() and not any(MPS_ROOT.glob("*"))
            ),
            timeout=60,
            interval=0.5,
        )
        times["claims unprepared by 0.1.0, the daemon gone"] = time.time() - t0
        # The daemon pod's supervisor saw its directory go and ended the daemon: the pod ends, but
        # 0.1.0 knows nothing of pods and never deletes it (owned by the Node, it stays, ended);
        # this version deletes such pods at its start, 0.1.0's operator deletes them by label.
        ended = wait_for(
            "the daemon pod to end",
            lambda: [p for p in daemon_pods(core) if p.status.phase in ("Succeeded", "Failed")],
            timeout=30,
            interval=0.5,
        )
        times["the daemon pod ended"] = time.time() - t0
        tail = core.read_namespaced_pod_log(ended[0].metadata.name, rel.namespace).splitlines()[-3:]
        print(
            f"[upgrade] daemon pod after 0.1.0 unprepared the MPS claim: "
            f"{[(p.metadata.name, p.status.phase) for p in ended]}; its log ends {tail}"
        )
    finally:
        t0 = time.time()
        finish(core, dyn, namespace)
        rel.uninstall()
        leftover = rel.delete_daemon_pods()  # ended ones are 0.1.0's; a running one is a failure
        rel.clear(node)
        times["uninstall"] = time.time() - t0
        print("[upgrade] timings: " + "; ".join(f"{k} {v:.1f} s" for k, v in times.items()))
    assert not daemons() and not mps_processes() and not mps_mounts(), (daemons(), mps_mounts())
    assert not leftover, f"MPS daemon pods still running after the uninstall: {leftover}"
    assert not daemon_pods(core)
    assert not MPS_ROOT.exists() or not any(MPS_ROOT.iterdir()), sorted(os.listdir(MPS_ROOT))


def roll_both_ways(
    rel, image, namespace, scratch: Path, values, kept: dict[str, str], rolled: str, check
) -> None:
    """0.1.0 installed with `values`, a pod per `kept` entry (pod -> its template) running; `helm
    upgrade` to this tree (one plugin pod at a time), then `helm rollback` to 0.1.0. During each
    rollout, once the old plugin pod is gone, a pod named after the step on template `rolled`.
    After each: every kept pod Running, never restarted, seeing what it saw (SHOW_MIG); the new
    pod's claim prepared by the version rolled to; no device allocated twice; `check(step, pods)`
    for the kind's own state (pods: pod -> what it sees). The release stays for the caller."""
    core, dyn = rel.core, rel.dyn
    commit = previous_commit()
    old_image, old_chart = previous_image(commit), previous_chart(commit, scratch)
    old_values = rel.values(old_image, *values)
    rel.adopt_cluster_objects(old_chart, old_values)
    rel.helm("install", rel.name, str(old_chart), *old_values, *rel.post)
    plugin = rel.ready_plugin(PREVIOUS_TAG, set())
    probe = f"{SHOW_MIG}; echo done; sleep 3600"
    for pod, tmpl in kept.items():
        gpu_pod(core, namespace, pod, DEBIAN_IMAGE, probe, template=tmpl)
    uids = {pod: running(core, namespace, pod).metadata.uid for pod in kept}
    seen_first = {pod: seen(core, namespace, pod) for pod in kept}
    check("install", dict(seen_first))
    new_tag = image[1].split("=", 1)[1]
    for step, tag, version in (("upgrade", new_tag, "current"), ("rollback", PREVIOUS_TAG, "0.1.0")):
        t0 = time.time()
        if step == "upgrade":
            strategy = f"kubeletPlugin.updateStrategy={json.dumps(ONE_AT_A_TIME)}"
            rel.helm(
                "upgrade",
                rel.name,
                str(NEW_CHART),
                *rel.values(image, *values),
                "--set-json",
                strategy,
                *rel.post,
            )
        else:
            rel.helm("rollback", rel.name, "1")
        old_uid = plugin.metadata.uid
        wait_for(
            "the old plugin pod gone",
            lambda old_uid=old_uid: all(p.metadata.uid != old_uid for p in rel.plugin_pods()),
            timeout=90,
        )
        gpu_pod(core, namespace, step, DEBIAN_IMAGE, probe, template=rolled)
        plugin = rel.ready_plugin(tag, {old_uid})
        running(core, namespace, step, timeout=180)
        took = time.time() - t0
        for pod in kept:
            p = core.read_namespaced_pod(pod, namespace)
            (status,) = p.status.container_statuses
            assert p.metadata.uid == uids[pod] and p.status.phase == "Running", (step, pod, p.status)
            assert status.restart_count == 0, (step, pod, p.status)
            assert seen(core, namespace, pod) == seen_first[pod], (step, pod, seen(core, namespace, pod))
        no_device_twice(allocations(dyn, namespace))
        log = rel.log(plugin)
        assert f"claim prepared claim={namespace}/{claim_of(dyn, namespace, step)} " in log, log[-3000:]
        check(step, {pod: seen(core, namespace, pod) for pod in [*kept, step]})
        print(
            f"[upgrade] {step} to {version} in {took:.1f} s: kept pods unchanged, "
            f"pod {step} prepared by {version}"
        )


@pytest.fixture
def release(target, core, dyn, namespace, node_root):
    """A function making a Release over a profile's host-like root, its namespace made and the node
    labelled; afterwards the test's pods deleted, the release uninstalled, ended MPS daemon pods
    deleted (0.1.0 never deletes one), everything of the release gone."""
    node = core.list_node().items[0].metadata.name
    made: list[Release] = []

    def make(profile: str) -> Release:
        root, dev_root = node_root(profile)
        rel = Release(target, core, dyn, dev_root, root)
        rel.open(node)
        made.append(rel)
        return rel

    yield make
    for rel in made:
        finish(core, dyn, namespace)
        rel.uninstall()
        rel.delete_daemon_pods()
        rel.clear(node)


def test_dynamic_mig_instances_kept_through_an_upgrade_and_a_rollback(
    image, release, core, dyn, namespace, tmp_path
):
    """Dynamic MIG (the dgx-h100-mig profile, kubeletPlugin.dynamicMig=true): a pod on a MIG
    instance that 0.1.0 made keeps that instance (the same MIG UUID, the same capability nodes)
    through both rollouts, each version taking the other's records of it; each rollout's pod gets
    an instance of its own from the version rolled to; at the end 0.1.0 destroys every instance,
    its own and the current version's."""
    rel = release(MIG)
    profile = load_profile(MIG)

    def instances() -> dict[str, str]:
        """MIG UUID -> its GPU, profile and placement, as the simulated kernel keeps them."""
        return {
            i["uuid"]: f"{gpu} {i['profile']}@{i['placement']}"
            for gpu, made in read_state(rel.dev_root / "dev", profile).instances.items()
            for i in made
            if i.get("uuid")
        }

    known: dict[str, str] = {}

    def check(step: str, pods: dict[str, str]) -> None:
        now = instances()
        if step == "install":
            ((uuid_, where),) = now.items()
            assert f"DRA_GPU_VISIBLE_DEVICES={uuid_}" in pods["mig"], pods
            print(f"\n[upgrade-mig] 0.1.0 made {where} ({uuid_}) for pod mig")
        else:
            assert {u: now.get(u) for u in known} == known, (step, known, now)  # none made again
            (mine,) = [u for u in now if u not in known]
            assert f"DRA_GPU_VISIBLE_DEVICES={mine}" in pods[step], (step, pods[step])
            print(f"[upgrade-mig] {step}: pod mig kept its instance; pod {step} got {now[mine]}")
        known.update(now)

    template(dyn, namespace, "two-g", device_class=MIG_CLASS, selectors=[profile_is("2g.20gb")])
    template(dyn, namespace, "one-g", device_class=MIG_CLASS, selectors=[profile_is("1g.10gb")])
    values = ["kubeletPlugin.dynamicMig=true"]
    roll_both_ways(rel, image, namespace, tmp_path, values, {"mig": "two-g"}, "one-g", check)
    finish(core, dyn, namespace)
    wait_for("every instance destroyed by 0.1.0", lambda: not instances(), timeout=60, interval=0.5)


def test_memory_shares_kept_through_an_upgrade_and_a_rollback(image, release, core, dyn, namespace, tmp_path):
    """Memory shares (the dgx-a100-mig profile's whole GPUs, kubeletPlugin.memoryShares=true): two
    40Gi shares of one GPU, each with its own MPS daemon (NVIDIA's), keep running through both
    rollouts, each one's container reaching a daemon afresh; each rollout's pod gets a share and a
    daemon of its own. 0.1.0's daemons die with its plugin pod and the current version starts them
    again as pods; the rollback's 0.1.0 keeps those. (NVIDIA's daemon without a GPU cannot resolve a
    UUID and answers a pinned-memory limit empty: the limit itself is read back on the simulated
    profile, test_sharing.py and test_reboot.py.)"""
    rel = release(A100_MIG)
    memory_template(dyn, namespace, "forty", "40Gi")
    shares: dict[str, tuple] = {}
    claims = dyn.resources.get(api_version="resource.k8s.io/v1", kind="ResourceClaim")

    def check(step: str, pods: dict[str, str]) -> None:
        for pod in pods:
            share = share_of(dyn, namespace, pod)
            assert shares.setdefault(pod, share) == share, (step, pod, share, shares[pod])
            tenant = container_process(core.read_namespaced_pod(pod, namespace))["cid"]
            answer = exec_in(tenant, "sh", "-c", ASK_MPS)
            assert answer.replace(".", "", 1).isdigit(), (step, pod, answer)  # a daemon answers
        assert len({s[1] for s in shares.values()}) == len(shares), shares  # a share each
        running = daemons()
        uids = [claims.get(namespace=namespace, name=claim_of(dyn, namespace, p)).metadata.uid for p in pods]
        assert all(any(d.startswith(u) for d in running) for u in uids), (step, uids, running)
        where = {
            "install": "processes of 0.1.0's plugin pod",
            "upgrade": "pods of their own",
            "rollback": "the kept ones' pods kept; the new share's a process of 0.1.0's pod",
        }[step]
        if step != "install":
            assert len(daemon_pods(core)) >= len(pods), (step, daemon_pods(core))
        print(f"[upgrade-shares] {step}: {len(pods)} shares, each with its daemon ({where}); {shares}")

    values = ["kubeletPlugin.memoryShares=true"]  # both charts know it
    roll_both_ways(rel, image, namespace, tmp_path, values, {"a": "forty", "b": "forty"}, "forty", check)
    assert shares["a"][0] == shares["b"][0]  # two shares of one GPU
    finish(core, dyn, namespace)
    wait_for("no MPS daemon left", lambda: not daemons() and not mps_processes(), timeout=60, interval=0.5)
