"""How each program of the cluster is configured and started, and when it counts as ready.

Each `start_*` writes the program's configuration under the state dir, starts it as a host
process (see processes.start) and waits until it answers (at most $DRA_GPU_E2E_TIMEOUT seconds).
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
from collections.abc import Sequence

from .config import (
    ADMIN_KUBECONFIG,
    APISERVER_PORT,
    BIN_CTRD,
    BIN_ETCD,
    BIN_K8S,
    BIN_KUBELET,
    BRIDGE,
    BUSYBOX_IMAGE,
    CACHE,
    CDI_DIRS,
    CNI_BIN,
    CTRD_SOCK,
    E2E_DIR,
    ETCD_PORT,
    KUBELET_ROOT,
    NODE_NAME,
    PAUSE_IMAGE,
    PEER_CDI_DIR,
    PKI,
    PLUGIN_NAME,
    POD_CIDR,
    RUNTIME_CONFIG,
    SCHEDULER_PORT,
    SERVICE_CIDR,
    STATE,
    feature_gates,
)
from .processes import (
    Fail,
    ctr,
    http_ok,
    https_ok,
    kubectl,
    log_tail,
    logfile,
    run,
    say,
    start,
    wait_for,
    write,
)


def node_ip() -> str:
    """$DRA_GPU_E2E_NODE_IP, else the source address of the default route."""
    ip = os.environ.get("DRA_GPU_E2E_NODE_IP")
    if ip:
        return ip
    try:
        out = run(["ip", "-4", "route", "get", "1.1.1.1"], capture_output=True, text=True).stdout
        return str(out.split(" src ")[1].split()[0])
    except Exception:
        pass
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("192.0.2.1", 9))  # no packet is sent for a UDP connect
        return str(s.getsockname()[0])
    finally:
        s.close()


def gates_flag(binary: str) -> list[str]:
    """--feature-gates for `binary`, or nothing (the release's defaults)."""
    gates = feature_gates(binary)
    return ["--feature-gates", gates] if gates else []


def binaries_present() -> bool:
    need = [
        os.path.join(BIN_K8S, b)
        for b in ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet", "kubectl")
    ]
    need += [os.path.join(BIN_ETCD, "etcd"), os.path.join(BIN_CTRD, "containerd")]
    return all(os.access(b, os.X_OK) for b in need)


def _pki(name: str) -> str:
    return os.path.join(PKI, name)


def start_etcd() -> None:
    url = f"http://127.0.0.1:{ETCD_PORT}"
    peer = f"http://127.0.0.1:{ETCD_PORT + 1}"
    start(
        "etcd",
        [
            os.path.join(BIN_ETCD, "etcd"),
            "--name",
            "e2e",
            "--data-dir",
            os.path.join(STATE, "etcd"),
            "--listen-client-urls",
            url,
            "--advertise-client-urls",
            url,
            "--listen-peer-urls",
            peer,
            "--initial-advertise-peer-urls",
            peer,
            "--initial-cluster",
            "e2e=" + peer,
            "--listen-metrics-urls",
            f"http://127.0.0.1:{ETCD_PORT + 2}",
            "--unsafe-no-fsync",
            "--log-level",
            "warn",
        ],
    )
    wait_for("etcd", lambda: http_ok(url + "/health"))


def start_apiserver(ip: str) -> None:
    p = _pki
    argv = [
        os.path.join(BIN_K8S, "kube-apiserver"),
        "--etcd-servers",
        f"http://127.0.0.1:{ETCD_PORT}",
        "--bind-address",
        "127.0.0.1",
        "--secure-port",
        str(APISERVER_PORT),
        "--advertise-address",
        ip,
        "--client-ca-file",
        p("ca.crt"),
        "--tls-cert-file",
        p("apiserver.crt"),
        "--tls-private-key-file",
        p("apiserver.key"),
        "--kubelet-client-certificate",
        p("admin.crt"),
        "--kubelet-client-key",
        p("admin.key"),
        "--kubelet-preferred-address-types",
        "InternalIP,Hostname",
        "--service-account-issuer",
        "https://kubernetes.default.svc.cluster.local",
        "--service-account-key-file",
        p("sa.pub"),
        "--service-account-signing-key-file",
        p("sa.key"),
        "--service-cluster-ip-range",
        SERVICE_CIDR,
        "--authorization-mode",
        "Node,RBAC",
        "--allow-privileged=true",
        "--enable-priority-and-fairness=false",
        "--profiling=false",
        *gates_flag(os.path.join(BIN_K8S, "kube-apiserver")),
        "--v=1",
    ]
    if RUNTIME_CONFIG:
        argv += ["--runtime-config", RUNTIME_CONFIG]
    start("kube-apiserver", argv)
    wait_for("kube-apiserver", lambda: https_ok(f"https://127.0.0.1:{APISERVER_PORT}/readyz", "admin"))


def start_controller_manager() -> None:
    p = _pki
    kc = os.path.join(STATE, "controller-manager.kubeconfig")
    start(
        "kube-controller-manager",
        [
            os.path.join(BIN_K8S, "kube-controller-manager"),
            "--kubeconfig",
            kc,
            "--authentication-kubeconfig",
            kc,
            "--authorization-kubeconfig",
            kc,
            "--bind-address",
            "127.0.0.1",
            "--leader-elect=false",
            "--service-account-private-key-file",
            p("sa.key"),
            "--root-ca-file",
            p("ca.crt"),
            "--cluster-signing-cert-file",
            p("ca.crt"),
            "--cluster-signing-key-file",
            p("ca.key"),
            "--use-service-account-credentials=true",
            "--controllers",
            "*",
            *gates_flag(os.path.join(BIN_K8S, "kube-controller-manager")),
            "--v=1",
        ],
    )
    wait_for("kube-controller-manager", lambda: https_ok("https://127.0.0.1:10257/healthz"))


def start_scheduler(extra: Sequence[str] = ()) -> None:
    """`extra`: more flags (the scale benchmark's client QPS)."""
    kc = os.path.join(STATE, "scheduler.kubeconfig")
    start(
        "kube-scheduler",
        [
            os.path.join(BIN_K8S, "kube-scheduler"),
            "--kubeconfig",
            kc,
            "--authentication-kubeconfig",
            kc,
            "--authorization-kubeconfig",
            kc,
            "--bind-address",
            "127.0.0.1",
            "--secure-port",
            str(SCHEDULER_PORT),
            "--leader-elect=false",
            *gates_flag(os.path.join(BIN_K8S, "kube-scheduler")),
            "--v=1",
            *extra,
        ],
    )
    wait_for("kube-scheduler", lambda: https_ok(f"https://127.0.0.1:{SCHEDULER_PORT}/healthz"))


def write_cni() -> None:
    """A bridge + host-local + loopback conflist: pods get an address on $BRIDGE, no masquerading."""
    conf = {
        "cniVersion": "1.0.0",
        "name": "dra-gpu-e2e",
        "plugins": [
            {
                "type": "bridge",
                "bridge": BRIDGE,
                "isGateway": True,
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": POD_CIDR}]],
                    "dataDir": os.path.join(STATE, "cni", "ipam"),
                    "routes": [{"dst": "0.0.0.0/0"}],
                },
            },
            {"type": "loopback"},
        ],
    }
    write(os.path.join(STATE, "cni", "net.d", "10-dra-gpu-e2e.conflist"), json.dumps(conf, indent=1))


def has_cap(bit: int) -> bool:
    """Whether this process has capability number `bit` in its effective set."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> bit & 1)
    return False


def _toml_list(xs: list[str]) -> str:
    return "[" + ", ".join(f"'{x}'" for x in xs) + "]"


def root_propagation() -> str:
    """The propagation of this mount namespace's `/`: "shared", "slave" or "private"."""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if fields[4] != "/":
                continue
            tags = fields[6 : fields.index("-")]
            if any(t.startswith("shared:") for t in tags):
                return "shared"
            return "slave" if any(t.startswith("master:") for t in tags) else "private"
    return "private"


def share_root_mount() -> None:
    """Make `/` a shared mount, as systemd does on every host and kind does in its nodes: the
    chart mounts the driver root with mountPropagation HostToContainer, which containerd refuses
    for a path on a private mount ("... is not a shared or slave mount"). A machine (a container)
    whose `/` is private gets `mount --make-rshared /` in its own mount namespace."""
    if root_propagation() != "private":
        return
    r = subprocess.run(["mount", "--make-rshared", "/"], capture_output=True, text=True)
    if r.returncode != 0:
        raise Fail(f"mount --make-rshared / failed (HostToContainer mounts need it): {r.stderr.strip()}")


def start_containerd() -> None:
    share_root_mount()
    d = os.path.join(STATE, "containerd")
    cfg = os.path.join(d, "config.toml")
    runc = os.environ.get("DRA_GPU_E2E_RUNC", shutil.which("runc") or "/usr/sbin/runc")
    # CAP_SYS_RESOURCE is capability 24.
    restrict_oom = os.environ.get("DRA_GPU_E2E_RESTRICT_OOM_SCORE_ADJ") == "1" or not has_cap(24)
    write(
        cfg,
        f"""version = 3
root = '{d}/root'
state = '{d}/state'
disabled_plugins = ['io.containerd.snapshotter.v1.btrfs', 'io.containerd.snapshotter.v1.zfs',
                    'io.containerd.snapshotter.v1.devmapper', 'io.containerd.snapshotter.v1.blockfile',
                    'io.containerd.tracing.processor.v1.otlp', 'io.containerd.internal.v1.tracing']

[grpc]
  address = '{CTRD_SOCK}'

[ttrpc]
  address = '{CTRD_SOCK}.ttrpc'

[debug]
  address = '{d}/debug.sock'

[plugins.'io.containerd.cri.v1.runtime']
  enable_cdi = true
  cdi_spec_dirs = {_toml_list(CDI_DIRS)}
  netns_mounts_under_state_dir = true
  # Without CAP_SYS_RESOURCE (as in our VMs) runc cannot lower oom_score_adj (pause asks -998):
  # keep every container at or above containerd's own value.
  restrict_oom_score_adj = {"true" if restrict_oom else "false"}
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = 'runc'
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = 'io.containerd.runc.v2'
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        BinaryName = '{runc}'
        SystemdCgroup = false
        Root = '{d}/runc'
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ['{CNI_BIN}']
    conf_dir = '{STATE}/cni/net.d'

[plugins.'io.containerd.cri.v1.images']
  snapshotter = 'overlayfs'
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = '{PAUSE_IMAGE}'

[plugins.'io.containerd.grpc.v1.cri']
  [plugins.'io.containerd.grpc.v1.cri'.x509_key_pair_streaming]
    tls_cert_file = ''

[plugins.'io.containerd.internal.v1.opt']
  path = '{d}/opt'
""",
    )
    for cdi in CDI_DIRS:
        os.makedirs(cdi, exist_ok=True)
    start("containerd", [os.path.join(BIN_CTRD, "containerd"), "--config", cfg])
    wait_for("containerd", lambda: ctr("version").returncode == 0)


def import_images() -> None:
    """The pause and busybox images of e2e/node/images.py (built once, cached) into containerd, and
    the dra-gpu image of e2e/node/image_build.sh when it has been built."""
    imgdir = os.path.join(CACHE, "images")
    run([sys.executable, os.path.join(E2E_DIR, "node", "images.py"), imgdir])
    have = ctr("-n", "k8s.io", "images", "ls", "-q").stdout.split()
    for tar, name in (("pause.tar", PAUSE_IMAGE), ("busybox.tar", BUSYBOX_IMAGE)):
        if name in have:
            continue
        r = ctr("-n", "k8s.io", "images", "import", os.path.join(imgdir, tar), check=False)
        if r.returncode != 0:
            raise Fail(f"importing {tar} into containerd failed: {r.stderr.strip()}")
    ctr("-n", "k8s.io", "images", "label", PAUSE_IMAGE, "io.cri-containerd.pinned=pinned", check=False)
    import_dra_gpu_image()
    import_dra_gpu_image("dra-gpu-simnode")


def import_dra_gpu_image(image: str = "dra-gpu") -> str | None:
    """An image written by e2e/node/image_build.sh (CACHE/images/<image>.tar: `dra-gpu`, the driver's
    image of deploy/Dockerfile, or `dra-gpu-simnode`, the driver's plus the simulator) into
    containerd when containerd lacks it or holds another build under its name. Returns the image's
    name, or None when it has not been built."""
    imgdir = os.path.join(CACHE, "images")
    archive, meta = os.path.join(imgdir, f"{image}.tar"), os.path.join(imgdir, f"{image}.json")
    if not (os.path.exists(archive) and os.path.exists(meta)):
        return None
    with open(meta) as f:
        name = str(json.load(f)["name"])
    with tarfile.open(archive) as tf:
        index = tf.extractfile("index.json")
        if index is None:
            raise Fail(f"{archive}: no index.json")
        digest = str(json.load(index)["manifests"][0]["digest"])
    listed = ctr("-n", "k8s.io", "images", "ls").stdout.splitlines()[1:]
    if any(line.split()[:3:2] == [name, digest] for line in listed):
        return name
    r = ctr("-n", "k8s.io", "images", "import", archive, check=False)
    if r.returncode != 0:
        raise Fail(f"importing {archive} into containerd failed: {r.stderr.strip()}")
    return name


def start_kubelet(ip: str) -> None:
    kd = os.path.join(STATE, "kubelet")
    cfg = os.path.join(kd, "config.yaml")
    kubelet = os.path.join(BIN_KUBELET, "kubelet")
    gates = "\n".join("  {}: {}".format(*g.split("=")) for g in feature_gates(kubelet).split(",") if g)
    write(
        cfg,
        f"""apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
cgroupDriver: cgroupfs
containerRuntimeEndpoint: unix://{CTRD_SOCK}
imageServiceEndpoint: unix://{CTRD_SOCK}
address: {ip}
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
authentication:
  anonymous: {{enabled: false}}
  webhook: {{enabled: true}}
  x509: {{clientCAFile: {PKI}/ca.crt}}
authorization: {{mode: AlwaysAllow}}
tlsCertFile: {PKI}/kubelet.crt
tlsPrivateKeyFile: {PKI}/kubelet.key
clusterDomain: cluster.local
failSwapOn: false
podLogsDir: {STATE}/pod-logs
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard:
  memory.available: 100Mi
  nodefs.available: 1%
  nodefs.inodesFree: 1%
  imagefs.available: 1%
  imagefs.inodesFree: 1%
nodeStatusUpdateFrequency: 4s
syncFrequency: 10s
serializeImagePulls: false
resolvConf: /etc/resolv.conf
featureGates:{" {}" if not gates else ""}
{gates}
""",
    )
    for sub in ("plugins", "plugins_registry"):
        os.makedirs(os.path.join(KUBELET_ROOT, sub), exist_ok=True)
    start(
        "kubelet",
        [
            kubelet,
            "--config",
            cfg,
            "--kubeconfig",
            os.path.join(STATE, "kubelet.kubeconfig"),
            "--root-dir",
            KUBELET_ROOT,
            "--hostname-override",
            NODE_NAME,
            "--node-ip",
            ip,
            "--v=1",
            # The DRA plugin manager's story (health streams, connections) for a failed test's report.
            "--vmodule=dra_plugin_manager=4",
        ],
    )

    def ready() -> bool:
        r = kubectl(
            "get",
            "node",
            NODE_NAME,
            "-o",
            "jsonpath={.status.conditions[?(@.type=='Ready')].status}",
            check=False,
        )
        return r.stdout.strip() == "True"

    wait_for("kubelet", ready, what=f"Ready (node {NODE_NAME})")


# The peer's client rate limit by default: far above any rate a bench drives (~1,000 calls/s), so it
# never binds. client-go's own default (50 QPS, burst 100) would make a bench measure the limiter
# (every prepare GETs its claim): 50 claims/s, a p99 of 1/50 s.
PEER_KUBE_API_QPS = 100000.0
PEER_KUBE_API_BURST = 100000


def start_peer_driver(
    kube_api_qps: float | None = PEER_KUBE_API_QPS, kube_api_burst: int | None = PEER_KUBE_API_BURST
) -> None:
    """Upstream's DRA test driver (test/e2e/dra/test-driver) as a host-process kubelet plugin;
    ready once it publishes its ResourceSlices. `kube_api_qps`/`kube_api_burst`: its
    `--kube-api-qps`/`--kube-api-burst`; None leaves that flag out (client-go's default)."""
    binary = os.path.join(BIN_K8S, "dra-test-driver")
    # the driver creates only the parent of its socket directory
    os.makedirs(os.path.join(KUBELET_ROOT, "plugins", PLUGIN_NAME), exist_ok=True)
    start(
        "peer-driver",
        [
            binary,
            "--kubeconfig",
            ADMIN_KUBECONFIG,
            "--drivername",
            PLUGIN_NAME,
            "-v=3",
            *([f"--kube-api-qps={kube_api_qps:g}"] if kube_api_qps is not None else []),
            *([f"--kube-api-burst={kube_api_burst}"] if kube_api_burst is not None else []),
            "kubelet-plugin",
            "--node-name",
            NODE_NAME,
            "--cdi-dir",
            PEER_CDI_DIR,
            "--datadir",
            os.path.join(KUBELET_ROOT, "plugins"),
            "--plugin-registration-path",
            os.path.join(KUBELET_ROOT, "plugins_registry"),
            "--num-devices",
            "4",
        ],
    )

    def published() -> bool:
        r = kubectl("get", "resourceslices", "-o", "jsonpath={.items[*].spec.driver}", check=False)
        return PLUGIN_NAME in r.stdout.split()

    try:
        wait_for("peer-driver", published, timeout=60, what="publishing ResourceSlices")
    except Fail:
        say(f"---- last lines of {logfile('peer-driver')} ----\n{log_tail('peer-driver')}")
        raise
    say(f"peer driver {PLUGIN_NAME} running; log {logfile('peer-driver')}")
