"""A driver upgrade with pods running, in the real cluster: the chart's real-node DaemonSet (see
test_real_node.py) over a driver root that moves from NVIDIA's Debian 535.261.03 user space
(bookworm) to 550.163.01 (trixie), each with the simulated NVML reporting its version.

The driver root is a host directory with the 535 root bind-mounted on it (a shared mount, so the
chart's HostToContainer propagation carries later mounts into the plugin's container); the upgrade
mounts the 550 root over it: from then on the path names only 550's files, as after dpkg replaced
them in place or a driver container swapped /run/nvidia/driver. The kernel module is its version
in the simulated node's proc/driver/nvidia/version.

1. Debian's order: the packages first (the mismatch window: a new claim is refused naming both
   versions, nothing written; the running pod untouched), then the module. The plugin restarts
   itself (exit status 4), the pending claim is prepared with 550's files, the old claim's spec is
   rewritten and its restarted container gets 550's files. `dra-gpu doctor` in the plugin's pod
   at each state.
2. The GPU Operator's order (libraries and module at once), back and forth a few times: the time
   from the upgrade to the first successful prepare.

NVIDIA's libraries are loaded only inside the pods (and the plugin's container)."""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import time
from pathlib import Path

import pytest
from simnode.node import kernel_version_text
from support import container_process, exec_in, wait_for
from test_driver_userspace import DEBIAN_IMAGE, failed_prepare, glibc_images  # noqa: F401 - a fixture
from test_kubelet_plugin import CDI_DIR, DRIVER, PLUGIN_DIR, template
from test_real_node import HGX, dpkg_md5, finish, installs, slice_devices  # noqa: F401 - a fixture

pytestmark = pytest.mark.e2e

OLD, NEW = "535.261.03", "550.163.01"
CUDA = {OLD: 12020, NEW: 12040}  # what NVIDIA's libcuda of each answers to cuDriverGetVersion
SUITES = {OLD: "bookworm", NEW: "trixie"}
LIBCUDA = "usr/lib/x86_64-linux-gnu/nvidia/current/libcuda.so.{}"
# What the container sees: NVIDIA's libcuda loaded by SONAME (its version, where the loader found
# it, that file's md5) and the versioned driver files mounted into it.
SHOW_DRIVER = (
    'python3 -c \'import ctypes; c = ctypes.CDLL("libcuda.so.1"); v = ctypes.c_int(); '
    'r = c.cuDriverGetVersion(ctypes.byref(v)); print("cuDriverGetVersion", r, v.value); '
    'p = next(l.split()[-1] for l in open("/proc/self/maps") if "libcuda" in l); '
    'print("libcuda.so.1 resolved to", p); import hashlib; '
    'print("md5", hashlib.md5(open(p, "rb").read()).hexdigest())\'; '
    "ls /usr/lib/x86_64-linux-gnu/nvidia/current/ | sed 's/^/file /'; echo done; sleep 3600"
)


class UpgradableRoot:
    """A host directory whose driver files are one version's, then the other's (mounts)."""

    def __init__(self, path: Path, roots: dict[str, Path]) -> None:
        self.path, self.roots = path, roots
        path.mkdir(parents=True, exist_ok=True)
        self._mount("--bind", str(roots[OLD]), str(path))
        self._mount("--make-shared", str(path))  # the host's / is private here; kubelet's mount is rslave
        self.version = OLD

    @staticmethod
    def _mount(*args: str) -> None:
        subprocess.run(["mount", *args], check=True, capture_output=True, text=True)

    def upgrade(self) -> None:
        """550's files under the path (over 535's mount): new opens see only them."""
        self._mount("--bind", str(self.roots[NEW]), str(self.path))
        self.version = NEW

    def downgrade(self) -> None:
        """535's files again: 550's mount detached (lazily: the plugin still maps its NVML)."""
        subprocess.run(["umount", "-l", str(self.path)], check=True)
        self.version = OLD

    def remove(self) -> None:
        while subprocess.run(["mountpoint", "-q", str(self.path)]).returncode == 0:
            subprocess.run(["umount", "-l", str(self.path)], check=True)
        self.path.rmdir()  # empty once unmounted; never a recursive delete (the roots are mounted)


def set_module(dev_root: Path, version: str) -> None:
    """The loaded kernel module's version (proc/driver/nvidia/version, replaced atomically)."""
    version_file = dev_root / "proc/driver/nvidia/version"
    tmp = version_file.with_name(".version.tmp")
    tmp.write_text(kernel_version_text(version))
    tmp.replace(version_file)


@pytest.fixture(scope="module")
def upgrade(installs):  # noqa: F811 - the fixture imported above
    host_like = installs.host_like
    roots = {v: host_like.host_like_root(HGX, suite=SUITES[v]) for v in (OLD, NEW)}
    # Beside, not under, the install's base directory (removed recursively at the module's end).
    root = UpgradableRoot(installs.base.parent / "driver-upgrade-root", roots)
    node = installs.install(HGX, root=root.path, suite=SUITES[OLD])
    yield root, node
    installs.uninstall()
    root.remove()


def pod(core, namespace, name, template_name="gpus"):
    """A pod of the Debian image with a claim of the template, restarted when its container dies."""
    container = {
        "name": "main",
        "image": DEBIAN_IMAGE,
        "imagePullPolicy": "Never",
        "command": ["sh", "-c", SHOW_DRIVER],
        "resources": {"claims": [{"name": "gpus"}]},
    }
    spec = {
        "restartPolicy": "Always",
        "terminationGracePeriodSeconds": 0,
        "containers": [container],
        "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": template_name}],
    }
    core.create_namespaced_pod(
        namespace, {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}
    )


def seen(core, namespace, name, restarts=0) -> dict:
    """What the pod's container printed (once it printed it), after `restarts` restarts."""

    def check():
        p = core.read_namespaced_pod(name, namespace)
        statuses = p.status.container_statuses or []
        if not statuses or statuses[0].restart_count != restarts or not statuses[0].ready:
            return None
        log = core.read_namespaced_pod_log(name, namespace)
        return log if "done" in log else None

    log = wait_for(f"pod {name} to run (restarts {restarts})", check, timeout=150, interval=0.3)
    m = re.search(r"cuDriverGetVersion (-?\d+) (\d+)", log)
    return {
        "log": log,
        "cuda": (int(m.group(1)), int(m.group(2))) if m else None,
        "resolved": re.search(r"libcuda\.so\.1 resolved to (\S+)", log).group(1),  # type: ignore[union-attr]
        "md5": re.search(r"^md5 (\w+)$", log, re.M).group(1),  # type: ignore[union-attr]
        "files": sorted(re.findall(r"^file (libcuda\.so\.\d+\.\d+\.\d+)$", log, re.M)),
    }


def assert_driver(view: dict, root_files: dict[str, Path], version: str) -> None:
    assert view["files"] == [f"libcuda.so.{version}"], view["log"]
    want = dpkg_md5(root_files[version], "libcuda1:amd64", LIBCUDA.format(version))
    assert view["md5"] == want, view["log"]  # NVIDIA's file of that version, as Debian packaged it
    assert view["cuda"] == (0, CUDA[version]), view["log"]


def published_versions(dyn) -> set[str]:
    """The driverVersion attributes of the node's 8 GPUs, once all are published."""
    devices = wait_for("the 8 GPUs", lambda: len(slice_devices(dyn)) == 8 and slice_devices(dyn), timeout=60)
    return {d["attributes"]["driverVersion"]["version"] for d in devices.values()}


def plugin_pods(core, node) -> list:
    selector = f"app.kubernetes.io/instance={node.release}"
    return core.list_namespaced_pod(node.namespace, label_selector=selector).items


def plugin_pod(core, node):
    """The DaemonSet's pod (not one being deleted)."""
    (p,) = [p for p in plugin_pods(core, node) if p.metadata.deletion_timestamp is None]
    return p


def doctor(core, node) -> dict[str, dict]:
    """`dra-gpu doctor --only node -o json` in the plugin's pod: its rows by check."""
    from harness.processes import ctr

    cid = container_process(plugin_pod(core, node))["cid"]
    r = ctr(
        "-n", "k8s.io", "tasks", "exec", "--exec-id", "doctor-" + os.urandom(3).hex(), cid,
        "dra-gpu", "doctor", "--only", "node", "-o", "json", check=False,
    )  # fmt: skip
    return {row["check"]: row for row in json.loads(r.stdout)["checks"]}


def show(state: str, rows: dict[str, dict]) -> None:
    for check in ("node/nvml", "node/driver", "node/driver-upgrade"):
        r = rows[check]
        print(f"[upgrade] doctor, {state}: {check} {r['status']}: {r['detail']}")


def spec_files() -> set[Path]:
    return set(CDI_DIR.glob(f"k8s.{DRIVER}-claim_*.json"))


def checkpoint_uids() -> set[str]:
    return set(json.loads((PLUGIN_DIR / "checkpoint.json").read_text())["data"]["claims"])


def claim_uid(dyn, namespace, pod_name) -> str:
    claims = dyn.resources.get(api_version="resource.k8s.io/v1", kind="ResourceClaim")
    for c in claims.get(namespace=namespace).to_dict()["items"]:
        if pod_name in [o.get("name") for o in c["metadata"].get("ownerReferences") or []]:
            return c["metadata"]["uid"]
    raise AssertionError(f"no claim of pod {pod_name}")


def restarted_plugin(core, node, restarts: int):
    """The plugin's pod once its container has been restarted `restarts` times and is ready."""

    def check():
        p = plugin_pod(core, node)
        st = (p.status.container_statuses or [None])[0]
        return p if st is not None and st.restart_count == restarts and st.ready else None

    return wait_for(f"the plugin's restart #{restarts}", check, timeout=120, interval=0.2)


def fresh_plugin(core, node) -> None:
    """A new plugin pod, as on a node whose plugin has run for a while: the kubelet restarts a
    container at once the first time, then after 10 s, 20 s, ... (reset after 10 minutes up)."""
    old = plugin_pod(core, node)
    core.delete_namespaced_pod(old.metadata.name, node.namespace)

    def ready():
        pods = plugin_pods(core, node)
        return len(pods) == 1 and [
            p
            for p in pods
            if p.metadata.uid != old.metadata.uid
            and p.status.container_statuses
            and p.status.container_statuses[0].ready
        ]

    wait_for("the plugin's new pod", ready, timeout=120, interval=0.3)


def node_at_old(root, node, core, dyn) -> None:
    """The module's node as it starts: 535's files and module, a plugin pod not yet restarted,
    535 published, whichever test ran before (a test file's tests run in any order)."""
    if root.version == NEW:
        root.downgrade()
        set_module(node.dev_root, OLD)
    fresh_plugin(core, node)
    wait_for("535 published", lambda: published_versions(dyn) == {"535.261.3"}, timeout=60)


def test_upgrade_with_pods_running(upgrade, core, dyn, namespace):
    root, node = upgrade
    node_at_old(root, node, core, dyn)
    assert published_versions(dyn) == {"535.261.3"}
    show("consistent 535", rows := doctor(core, node))
    assert (
        rows["node/driver-upgrade"]["status"] == "OK"
        and f"driver {OLD}" in rows["node/driver-upgrade"]["detail"]
    )

    template(dyn, namespace, "gpus", count=1)
    pod(core, namespace, "before")
    before = seen(core, namespace, "before")
    print(f"[upgrade] pod 'before' on {OLD}:\n{before['log']}")
    assert_driver(before, root.roots, OLD)
    before_uid = claim_uid(dyn, namespace, "before")

    # 1. The packages: 550's files under the root, the 535 module still loaded.
    t_libraries = time.time()
    root.upgrade()
    pod(core, namespace, "during")
    said = failed_prepare(core, namespace, "during", "driver version mismatch")
    print(f"[upgrade] libraries {NEW}, module {OLD}: prepare refused: {said}")
    assert f"are version {NEW}" in said and f"kernel module is version {OLD}" in said, said
    assert "nothing was written" in said, said
    during_uid = claim_uid(dyn, namespace, "during")
    assert not (CDI_DIR / f"k8s.{DRIVER}-claim_{during_uid}.json").exists()
    assert during_uid not in checkpoint_uids() and before_uid in checkpoint_uids()
    old_spec = (CDI_DIR / f"k8s.{DRIVER}-claim_{before_uid}.json").read_text()
    assert LIBCUDA.format(OLD) in old_spec
    show("libraries upgraded, module old", rows := doctor(core, node))
    assert rows["node/driver-upgrade"]["status"] == "FAIL", rows["node/driver-upgrade"]
    assert NEW in rows["node/driver-upgrade"]["detail"] and OLD in rows["node/driver-upgrade"]["detail"]
    # The running container: untouched, its 535 files still mounted and loaded.
    p = core.read_namespaced_pod("before", namespace)
    assert p.status.container_statuses[0].restart_count == 0
    cid = container_process(p)["cid"]
    listing = exec_in(cid, "ls", "/usr/lib/x86_64-linux-gnu/nvidia/current/")
    assert f"libcuda.so.{OLD}" in listing and NEW not in listing, listing
    assert exec_in(cid, "md5sum", "/usr/lib/x86_64-linux-gnu/libcuda.so.1").split()[0] == before["md5"]

    # 2. The module reloaded: the plugin restarts itself on 550's NVML.
    t_module = time.time()
    set_module(node.dev_root, NEW)
    plugin = restarted_plugin(core, node, 1)
    t_plugin = time.time()
    last = plugin.status.container_statuses[0].last_state.terminated
    assert last is not None and last.exit_code == 4, last
    previous = core.read_namespaced_pod_log(plugin.metadata.name, node.namespace, previous=True)
    (line,) = [x for x in previous.splitlines() if "stopping (exit status 4)" in x]
    assert f"driver changed from {OLD} to {NEW}" in line, line
    print(f"[upgrade] the plugin's last line on {OLD}: {line}")
    during = seen(core, namespace, "during")
    t_during = time.time()
    assert_driver(during, root.roots, NEW)
    wait_for("the slices of 550", lambda: published_versions(dyn) == {"550.163.1"}, timeout=30)

    # The old claim's spec now names 550's files; its restarted container gets them.
    new_spec = (CDI_DIR / f"k8s.{DRIVER}-claim_{before_uid}.json").read_text()
    assert LIBCUDA.format(NEW) in new_spec and LIBCUDA.format(OLD) not in new_spec
    os.kill(container_process(core.read_namespaced_pod("before", namespace))["pid"], signal.SIGKILL)
    restarted = seen(core, namespace, "before", restarts=1)
    print(f"[upgrade] pod 'before' after its container restarted:\n{restarted['log']}")
    assert_driver(restarted, root.roots, NEW)
    show("upgraded", rows := doctor(core, node))
    assert rows["node/driver-upgrade"]["status"] == "OK", rows["node/driver-upgrade"]
    assert f"driver {NEW}" in rows["node/driver-upgrade"]["detail"]
    assert rows["node/driver"]["status"] == "OK", rows["node/driver"]
    print(
        f"[upgrade] Debian's order: libraries at +0.0 s, module at +{t_module - t_libraries:.1f} s; "
        f"plugin restarted and ready {t_plugin - t_module:.1f} s after the module, the pending claim's "
        f"pod running {t_during - t_module:.1f} s after it"
    )
    finish(core, dyn, namespace)  # pods and claims gone: unprepared


def test_time_from_upgrade_to_first_prepare(upgrade, core, dyn, namespace):
    """The GPU Operator's order, libraries and module together, 535 to 550: the time from the switch
    to the first claim's spec on disk (a pod created at the switch; the kubelet retries a refused
    prepare after about 10 s). Once in the gate; $DRA_GPU_E2E_UPGRADE_ROUNDS times (each about
    30 s) for a median."""
    root, node = upgrade
    template(dyn, namespace, "gpus", count=1)
    times = []
    for i in range(int(os.environ.get("DRA_GPU_E2E_UPGRADE_ROUNDS", "1"))):
        if root.version == NEW:  # back to 535 before the plugin's pod starts: its /driver-root is
            root.downgrade()  # a copy of the mount on top at its start, which later mounts stack on
            set_module(node.dev_root, OLD)
        fresh_plugin(core, node)
        target = NEW
        known = spec_files()
        t0 = time.time()
        root.upgrade()
        set_module(node.dev_root, target)
        pod(core, namespace, f"p{i}")
        spec = wait_for(
            "the claim's spec", lambda k=known: spec_files() - k or None, timeout=120, interval=0.05
        )
        times.append(time.time() - t0)
        (only,) = spec
        assert LIBCUDA.format(target) in only.read_text()
        restarted = restarted_plugin(core, node, 1)
        assert restarted.status.container_statuses[0].last_state.terminated.exit_code == 4
        finish(core, dyn, namespace)  # unprepared before the next plugin pod
    print(
        f"[upgrade] switch to first successful prepare: {', '.join(f'{t:.1f}' for t in times)} s; "
        f"p50 {statistics.median(times):.1f} s"
    )
