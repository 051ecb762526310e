"""A kind node image built here, from Debian packages and the Go programs e2e/ builds.

`kind build node-image` cannot run on a machine without registries: it starts containerd in a
container of `kindest/base` and fetches pause, etcd, CoreDNS, kindnetd and the local-path
provisioner from their registries there (`ctr content fetch`). So this module makes the same image
itself, in the layout kind's node image has:

1. the base (what kind's images/base/Dockerfile installs): a Debian rootfs made by mmdebstrap with
   systemd and the node's tools, kind's own files of its base image (entrypoint, systemd units,
   containerd config; taken from the pinned kind module, not copied into this repo), containerd and
   crictl built from their Go modules, runc and the CNI plugins from Debian, `cri-base.json` from
   `ctr oci spec` as kind makes it;
2. the Kubernetes bits as `kind build node-image` places them: kubeadm, kubelet, kubectl in
   /usr/bin, the version in /kind/version;
3. the images kubeadm and kind need, imported (pinned, not unpacked) into the rootfs's containerd
   store by a containerd run here: pause (kind's sandbox image), etcd, CoreDNS, kube-apiserver,
   kube-controller-manager, kube-scheduler (one binary each) and kube-proxy (with Debian's
   iptables, conntrack and nftables), all built from their Go modules. kindnetd is not among them:
   its module (sigs.k8s.io/kind/images/kindnetd) is not served by the Go module proxy, so the
   cluster here uses a static ptp CNI config instead (see e2e/kind/README.md).

The rootfs tarball is cached under $DRA_GPU_CACHE/images/kind-node/<hash of all inputs>.tar and
imported into the private daemon (e2e/harness/kind_engine.py) as
localhost/dra-gpu/kind-node:<k8s version>-<hash>, unless the daemon already has it.

    python3 -m harness.kind_node [--print-name]       (from e2e/, with the daemon up)
"""

import hashlib
import importlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from tenacity import retry, retry_if_result, stop_after_delay, wait_exponential

from . import kind_engine
from .config import BIN_CTRD, BIN_ETCD, BIN_K8S, CACHE, E2E_DIR, V

# e2e/node/images.py (a script, untyped): the OCI layout writer and pause layer of the local cluster.
sys.path.insert(0, os.path.join(E2E_DIR, "node"))
images: Any = importlib.import_module("images")

K8S_VERSION = V["K8S_VERSION"]
KIND_VERSION = V["KIND_VERSION"]
ETCD_TAG = V["ETCD_VERSION"].lstrip("v") + "-0"
BIN = os.path.join(CACHE, "bin")
BIN_K8S_KIND = os.path.join(BIN, "kubernetes-kind-" + K8S_VERSION)
BIN_CRICTL = os.path.join(BIN, "crictl-" + V["CRICTL_VERSION"])
BIN_COREDNS = os.path.join(BIN, "coredns-" + V["COREDNS_VERSION"])
BIN_KIND = os.path.join(BIN, "kind-" + KIND_VERSION)
OUT_DIR = os.path.join(CACHE, "images", "kind-node")
SUITE = "bookworm"
MIRROR = os.environ.get("E2E_DEBIAN_MIRROR", "http://deb.debian.org/debian")
FORMAT = 1  # bump when the layout of the image changes without its inputs changing

# What kind's base Dockerfile installs from apt, minus the NFS/iSCSI clients and fuse-overlayfs
# (rootless only); plus Debian's runc and CNI plugins, which kind builds from source.
NODE_PACKAGES = [
    "systemd", "conntrack", "iptables", "nftables", "iproute2", "ethtool", "util-linux", "mount",
    "kmod", "libseccomp2", "pigz", "e2fsprogs", "bash", "ca-certificates", "curl", "jq", "procps",
    "runc", "containernetworking-plugins",
]  # fmt: skip
KUBE_PROXY_PACKAGES = ["iptables", "conntrack", "nftables"]
MMDEBSTRAP_COMMON = [
    "--variant=minbase",
    "--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr",
    *images.MMDEBSTRAP_PATH_FILTERS,
]
CNI_PLUGINS = ["host-local", "loopback", "ptp", "portmap", "bridge"]
# kind's default pod subnet; the static CNI config that stands in for kindnetd uses it.
POD_SUBNET = "10.244.0.0/16"
PTP_CONFLIST = {
    "cniVersion": "1.0.0",
    "name": "kind-ptp",
    "plugins": [
        {
            "type": "ptp",
            "ipMasq": False,
            "ipam": {
                "type": "host-local",
                "ranges": [[{"subnet": POD_SUBNET}]],
                "routes": [{"dst": "0.0.0.0/0"}],
            },
        },
        {"type": "portmap", "capabilities": {"portMappings": True}},
    ],
}


def say(msg: str) -> None:
    print("[kind-node] " + msg, file=sys.stderr, flush=True)


def kind_module_dir() -> str:
    """The pinned kind module's source (for its base image files), downloaded by Go if needed."""
    out = subprocess.run(
        ["go", "mod", "download", "-json", "sigs.k8s.io/kind@" + KIND_VERSION],
        check=True,
        capture_output=True,
        text=True,
        cwd=tempfile.gettempdir(),
    ).stdout
    return str(json.loads(out)["Dir"])


def image_names() -> dict[str, str]:
    """Image name -> what it is, for the images the node's containerd holds."""
    return {
        "registry.k8s.io/pause:3.10": "pause (kind's containerd sandbox_image)",
        f"registry.k8s.io/etcd:{ETCD_TAG}": "etcd",
        f"registry.k8s.io/coredns/coredns:{V['COREDNS_VERSION']}": "coredns",
        f"registry.k8s.io/kube-apiserver:{K8S_VERSION}": "kube-apiserver",
        f"registry.k8s.io/kube-controller-manager:{K8S_VERSION}": "kube-controller-manager",
        f"registry.k8s.io/kube-scheduler:{K8S_VERSION}": "kube-scheduler",
        f"registry.k8s.io/kube-proxy:{K8S_VERSION}": "kube-proxy",
    }


def _programs() -> dict[str, str]:
    return {
        "kubeadm": os.path.join(BIN_K8S_KIND, "kubeadm"),
        "kube-proxy": os.path.join(BIN_K8S_KIND, "kube-proxy"),
        "kubelet": os.path.join(BIN_K8S, "kubelet"),
        "kubectl": os.path.join(BIN_K8S, "kubectl"),
        "kube-apiserver": os.path.join(BIN_K8S, "kube-apiserver"),
        "kube-controller-manager": os.path.join(BIN_K8S, "kube-controller-manager"),
        "kube-scheduler": os.path.join(BIN_K8S, "kube-scheduler"),
        "etcd": os.path.join(BIN_ETCD, "etcd"),
        "coredns": os.path.join(BIN_COREDNS, "coredns"),
        "crictl": os.path.join(BIN_CRICTL, "crictl"),
        "containerd": os.path.join(BIN_CTRD, "containerd"),
        "ctr": os.path.join(BIN_CTRD, "ctr"),
        "containerd-shim-runc-v2": os.path.join(BIN_CTRD, "containerd-shim-runc-v2"),
    }


def _file_hash(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def input_hash() -> str:
    """Everything the image is made of: programs, package lists, kind's version, this module."""
    h = hashlib.sha256()
    for name, path in sorted(_programs().items()):
        h.update(f"{name}={_file_hash(path)}\n".encode())
    for part in (SUITE, MIRROR, str(FORMAT), KIND_VERSION, K8S_VERSION, *NODE_PACKAGES, *KUBE_PROXY_PACKAGES):
        h.update(part.encode() + b"\n")
    h.update(_file_hash(os.path.abspath(__file__)).encode())
    return h.hexdigest()[:16]


def image_name(key: str) -> str:
    return f"localhost/dra-gpu/kind-node:{K8S_VERSION}-{key}"


# ---------------------------------------------------------------------------- component images


def _ti(name: str, **kw: Any) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.mtime, ti.uid, ti.gid, ti.uname, ti.gname = 0, 0, 0, "root", "root"
    for k, v in kw.items():
        setattr(ti, k, v)
    return ti


def _binary_layer(files: dict[str, str], base: bytes = b"") -> bytes:
    """An uncompressed layer: the members of `base` (a tar) first, then `files` (image path -> host
    path), with the directories a static Go program's image needs."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as out:
        if base:
            with tarfile.open(fileobj=io.BytesIO(base)) as src:
                for member in src:
                    out.addfile(member, src.extractfile(member) if member.isreg() else None)
        else:
            for d in ("etc", "tmp", "usr", "usr/local", "usr/local/bin", "var", "var/run"):
                out.addfile(_ti(d + "/", type=tarfile.DIRTYPE, mode=0o1777 if d == "tmp" else 0o755))
            content = b"root:x:0:0:root:/root:/sbin/nologin\nnobody:x:65534:65534:nobody:/:/sbin/nologin\n"
            out.addfile(_ti("etc/passwd", size=len(content), mode=0o644), io.BytesIO(content))
        for target, path in files.items():
            with open(path, "rb") as f:
                out.addfile(_ti(target, size=os.path.getsize(path), mode=0o755), f)
    return buf.getvalue()


def _write_image(path: str, name: str, layer: bytes, config: dict[str, Any]) -> None:
    diff_id = "sha256:" + hashlib.sha256(layer).hexdigest()

    def add_layer(tf: tarfile.TarFile) -> dict[str, Any]:
        tf.addfile(_ti("blobs/sha256/" + diff_id[7:], size=len(layer), mode=0o644), io.BytesIO(layer))
        return {"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": diff_id, "size": len(layer)}

    images._write_layout(path, name, [(diff_id, add_layer)], config)


def _mmdebstrap(packages: list[str], target: str, *hooks: str) -> None:
    cmd = [
        "mmdebstrap",
        "--quiet",
        *MMDEBSTRAP_COMMON,
        "--include=" + ",".join(packages),
        *hooks,
        SUITE,
        target,
        MIRROR,
    ]
    env = dict(os.environ, SOURCE_DATE_EPOCH="0")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"mmdebstrap failed ({proc.returncode}): {proc.stderr[-3000:]}")


def component_images(outdir: str) -> list[str]:
    """OCI archives of the images the node preloads; returns their paths."""
    progs = _programs()
    path_env = ["PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin"]
    archives = []
    for name, what in image_names().items():
        path = os.path.join(outdir, what.split()[0] + ".tar")
        if what.startswith("pause"):
            continue  # written below by images.py
        if what == "kube-proxy":
            rootfs_tar = os.path.join(outdir, "kube-proxy-base.tar")
            _mmdebstrap(KUBE_PROXY_PACKAGES, rootfs_tar, "--skip=output/dev")
            with open(rootfs_tar, "rb") as f:
                base = f.read()
            os.unlink(rootfs_tar)
            layer = _binary_layer({"usr/local/bin/kube-proxy": progs["kube-proxy"]}, base)
            _write_image(path, name, layer, {"Env": path_env, "Entrypoint": ["/usr/local/bin/kube-proxy"]})
        elif what == "coredns":
            layer = _binary_layer({"coredns": progs["coredns"]})
            _write_image(path, name, layer, {"Env": path_env, "Entrypoint": ["/coredns"]})
        else:
            layer = _binary_layer({"usr/local/bin/" + what: progs[what]})
            _write_image(path, name, layer, {"Env": path_env, "Entrypoint": ["/usr/local/bin/" + what]})
        archives.append(path)
    # The pause image of the local cluster (e2e/node/images.py), under kind's sandbox image name.
    pause_name = next(n for n, w in image_names().items() if w.startswith("pause"))
    pause = os.path.join(outdir, "pause.tar")
    images.write_image(pause, pause_name, images.build_layer(), {"Entrypoint": ["/bin/sleep", "2147483647"]})
    archives.append(pause)
    return archives


# ---------------------------------------------------------------------------- the rootfs


@retry(
    retry=retry_if_result(lambda ok: not ok),
    wait=wait_exponential(multiplier=0.1, max=1),
    stop=stop_after_delay(60),
    retry_error_callback=lambda state: False,
)
def _ctr_ready(sock: str) -> bool:
    ctr = os.path.join(BIN_CTRD, "ctr")
    return subprocess.run([ctr, "--address", sock, "version"], capture_output=True).returncode == 0


@contextmanager
def _containerd_on(root: str) -> Iterator[str]:
    """A containerd of our own whose content store and metadata are `root` (the node's
    /var/lib/containerd); yields its socket."""
    state = tempfile.mkdtemp(prefix="kind-node-ctrd-")
    sock = os.path.join(state, "c.sock")
    cfg = os.path.join(state, "config.toml")
    with open(cfg, "w") as f:
        f.write(f"version = 3\nroot = '{root}'\nstate = '{state}/s'\n[grpc]\n  address = '{sock}'\n")
        f.write(f"[ttrpc]\n  address = '{sock}.ttrpc'\n")
        # Only the content store and metadata are wanted: no CRI, no snapshotters to mount.
        f.write("disabled_plugins = ['io.containerd.grpc.v1.cri', 'io.containerd.cri.v1.runtime']\n")
    with open(os.path.join(state, "log"), "wb") as log:
        proc = subprocess.Popen(
            [os.path.join(BIN_CTRD, "containerd"), "--config", cfg], stdout=log, stderr=subprocess.STDOUT
        )
    try:
        if not _ctr_ready(sock):
            with open(os.path.join(state, "log"), errors="replace") as f:
                raise RuntimeError("containerd for the node's image store did not start: " + f.read()[-2000:])
        yield sock
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
        shutil.rmtree(state, ignore_errors=True)


def _install_base(root: str, kind_files: str) -> None:
    """What kind's base Dockerfile does after apt, on the mmdebstrap rootfs `root`."""
    progs = _programs()
    # kind's files of its base image (entrypoint, units, containerd config, sysctls, scripts).
    shutil.copytree(kind_files, root, dirs_exist_ok=True, symlinks=True)
    shutil.rmtree(os.path.join(root, "LICENSES"), ignore_errors=True)
    # Go's module cache is read-only: give the copies the modes of kind's Dockerfile (its
    # scripts executable), not the cache's.
    for dirpath, dirnames, filenames in os.walk(kind_files):
        rel = os.path.relpath(dirpath, kind_files)
        for d in dirnames:
            if os.path.isdir(os.path.join(root, rel, d)):
                os.chmod(os.path.join(root, rel, d), 0o755)
        for name in filenames:
            target = os.path.join(root, rel, name)
            if os.path.exists(target) and not os.path.islink(target):
                executable = os.stat(os.path.join(dirpath, name)).st_mode & 0o111 or rel.endswith("bin")
                os.chmod(target, 0o755 if executable else 0o644)
    # systemd as in a container: no tmpfiles setup at boot, none of the default wants.
    sysd = os.path.join(root, "usr/lib/systemd/system")
    with_globs: list[tuple[str, Callable[[str], bool]]] = [
        ("sysinit.target.wants", lambda n: n == "systemd-tmpfiles-setup.service"),
        ("multi-user.target.wants", lambda n: True),
        ("local-fs.target.wants", lambda n: True),
        ("sockets.target.wants", lambda n: "udev" in n or "initctl" in n),
        ("basic.target.wants", lambda n: True),
    ]
    for sub, match in with_globs:
        d = os.path.join(sysd, sub)
        for n in os.listdir(d) if os.path.isdir(d) else []:
            if match(n):
                os.unlink(os.path.join(d, n))
    etc_sysd = os.path.join(root, "etc/systemd/system")
    for d in os.listdir(etc_sysd):
        if d.endswith(".wants"):
            shutil.rmtree(os.path.join(etc_sysd, d))
    with open(os.path.join(root, "etc/systemd/journald.conf"), "a") as f:
        f.write("ReadKMsg=no\n")
    init = os.path.join(root, "sbin/init")
    if not os.path.lexists(init):
        os.symlink("/usr/lib/systemd/systemd", init)
    # containerd, ctr, the shim, crictl as kind installs them; runc is Debian's (/usr/sbin).
    for name in ("containerd", "ctr", "containerd-shim-runc-v2", "crictl"):
        shutil.copy2(progs[name], os.path.join(root, "usr/local/bin", name))
    os.makedirs(os.path.join(root, "opt/cni/bin"), exist_ok=True)
    for p in CNI_PLUGINS:
        shutil.copy2(os.path.join(root, "usr/lib/cni", p), os.path.join(root, "opt/cni/bin", p))
    # cri-base.json: `ctr oci spec` plus kind's product-files hook, without rlimits.
    spec = json.loads(
        subprocess.run([progs["ctr"], "oci", "spec"], check=True, capture_output=True, text=True).stdout
    )
    spec.setdefault("hooks", {}).setdefault("createContainer", []).append(
        {"path": "/kind/bin/mount-product-files.sh"}
    )
    spec["process"].pop("rlimits", None)
    with open(os.path.join(root, "etc/containerd/cri-base.json"), "w") as f:
        json.dump(spec, f, indent=2)
    subprocess.run(
        [
            "chroot",
            root,
            "systemctl",
            "enable",
            "kubelet.service",
            "containerd.service",
            "undo-mount-hacks.service",
        ],
        check=True,
        capture_output=True,
    )
    subprocess.run(
        ["chroot", root, "systemctl", "mask", "systemd-binfmt.service"], check=True, capture_output=True
    )
    os.makedirs(os.path.join(root, "etc/kubernetes/manifests"), exist_ok=True)
    # What `kind build node-image` adds: the Kubernetes programs and the version.
    for name in ("kubeadm", "kubelet", "kubectl"):
        shutil.copy2(progs[name], os.path.join(root, "usr/bin", name))
    with open(os.path.join(root, "kind/version"), "w") as f:
        f.write(K8S_VERSION)
    # Stands in for kindnetd (not buildable here): one node, pods on ptp links from the pod subnet.
    os.makedirs(os.path.join(root, "etc/cni/net.d"), exist_ok=True)
    with open(os.path.join(root, "etc/cni/net.d/10-kind-ptp.conflist"), "w") as f:
        json.dump(PTP_CONFLIST, f, indent=2)


def build_rootfs_tar(key: str) -> str:
    """The node's rootfs as a tarball in the cache (built once per input hash)."""
    out = os.path.join(OUT_DIR, key + ".tar")
    if os.path.exists(out):
        return out
    os.makedirs(OUT_DIR, exist_ok=True)
    work = tempfile.mkdtemp(prefix="kind-node-", dir=OUT_DIR)
    try:
        root = os.path.join(work, "rootfs")
        t0 = time.monotonic()
        say(f"mmdebstrap {SUITE}: {len(NODE_PACKAGES)} packages and their dependencies")
        _mmdebstrap(NODE_PACKAGES, root, "--skip=output/dev")
        say(f"rootfs in {time.monotonic() - t0:.0f} s; kind's base files and the programs")
        _install_base(root, os.path.join(kind_module_dir(), "images", "base", "files"))
        imgdir = os.path.join(work, "images")
        os.makedirs(imgdir)
        t1 = time.monotonic()
        archives = component_images(imgdir)
        say(f"{len(archives)} component images in {time.monotonic() - t1:.0f} s; importing them")
        ctr = os.path.join(BIN_CTRD, "ctr")
        with _containerd_on(os.path.join(root, "var/lib/containerd")) as sock:
            for archive in archives:
                pinned = "--label=io.cri-containerd.pinned=pinned"
                subprocess.run(
                    [
                        ctr,
                        "--address",
                        sock,
                        "-n",
                        "k8s.io",
                        "images",
                        "import",
                        "--no-unpack",
                        pinned,
                        archive,
                    ],
                    check=True,
                    capture_output=True,
                )
            listed = subprocess.run(
                [ctr, "--address", sock, "-n", "k8s.io", "images", "ls", "-q"],
                check=True,
                capture_output=True,
                text=True,
            ).stdout.split()
        missing = set(image_names()) - set(listed)
        if missing:
            raise RuntimeError(f"images missing from the node's store after import: {sorted(missing)}")
        tmp = out + ".tmp"
        subprocess.run(["tar", "-C", root, "--numeric-owner", "-cf", tmp, "."], check=True)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, out)
        say(f"node rootfs {out} ({os.path.getsize(out) >> 20} MiB) in {time.monotonic() - t0:.0f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def ensure_image() -> str:
    """The node image in the private daemon (built or imported when missing); returns its name."""
    key = input_hash()
    name = image_name(key)
    if kind_engine.docker("image", "inspect", name, check=False).returncode == 0:
        say(f"{name} present")
        return name
    tarball = build_rootfs_tar(key)
    t0 = time.monotonic()
    kind_engine.docker(
        "import",
        "--change",
        'ENTRYPOINT ["/usr/local/bin/entrypoint", "/sbin/init"]',
        "--change",
        "ENV container=docker",
        tarball,
        name,
    )
    say(f"imported {name} in {time.monotonic() - t0:.0f} s")
    return name


def main(argv: list[str]) -> int:
    name = ensure_image()
    if "--print-name" in argv:
        print(name)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
