#!/usr/bin/env python3
"""Build OCI image archives without a registry (Python stdlib only).

    e2e/node/images.py OUTDIR [--debian]

writes OUTDIR/busybox.tar and OUTDIR/pause.tar: OCI image layouts (oci-layout, index.json,
blobs/sha256/...) that `ctr -n k8s.io images import` and `kind load image-archive` accept.
Both share one layer: Debian's static busybox at /bin/busybox plus a symlink per applet.

- busybox image: name from $E2E_BUSYBOX_IMAGE (default localhost/dra-gpu-e2e/busybox:1), cmd sh.
- pause image: name from $E2E_PAUSE_IMAGE (default registry.k8s.io/pause:3.10.1, the sandbox
  image containerd 2.2 pins); its entrypoint sleeps forever (the sandbox is killed with SIGKILL).

The archives are deterministic (mtime 0, sorted entries), so the same busybox gives the same
digests; OUTDIR/.stamp records the busybox hash so callers can skip rebuilding.

With --debian it also writes two glibc images for the CDI user-space tests, sharing one layer: a
Debian bookworm minbase root with python3 built by `mmdebstrap` from Debian's archive (no NVIDIA
file in it; apt lists and caches, docs, man pages and locales left out):

- debian image: name from $E2E_DEBIAN_IMAGE (default localhost/dra-gpu-e2e/debian:1), cmd sh;
  the same archive names the same manifest `docker.io/library/debian:bookworm-slim` too (two
  entries of its index.json, one digest: `ctr images import` and `kind load image-archive` make
  an image of each), the public image deploy/examples run. The e2e clusters reach no registry,
  so that name is served by this local build: like debian:bookworm-slim, a Debian bookworm
  minbase root from Debian's archive, with python3 added (the examples use only sh, coreutils
  and grep, which both have; the slim image has no python3).
- cuda-style image: name from $E2E_CUDA_STYLE_IMAGE (default localhost/dra-gpu-e2e/cuda-style:1),
  with the PATH and LD_LIBRARY_PATH of NVIDIA's CUDA base images (/usr/local/nvidia/...).
- nvidia-demo image: name from $E2E_NVIDIA_DEMO_IMAGE (default localhost/dra-gpu-e2e/nvidia-demo:1),
  the debian image plus a second layer with /tmp/sample (its cmd), a script in place of the CUDA
  samples NVIDIA's demo manifests run, which reports the GPUs the container sees and stays up.

The layer (gzip) is cached as OUTDIR/debian-layer/<hash of the mmdebstrap inputs>.tar.gz and
rebuilt only when those inputs change; $E2E_DEBIAN_MIRROR overrides the Debian mirror.
"""

import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from typing import Any, Protocol

BUSYBOX = os.environ.get("E2E_BUSYBOX_BIN", "/bin/busybox")
BUSYBOX_IMAGE = os.environ.get("E2E_BUSYBOX_IMAGE", "localhost/dra-gpu-e2e/busybox:1")
PAUSE_IMAGE = os.environ.get("E2E_PAUSE_IMAGE", "registry.k8s.io/pause:3.10.1")
DEBIAN_IMAGE = os.environ.get("E2E_DEBIAN_IMAGE", "localhost/dra-gpu-e2e/debian:1")
# The public image of deploy/examples, served by the debian archive under its full name (what the
# kubelet and containerd normalise `debian:bookworm-slim` to).
DEBIAN_SLIM_IMAGE = "docker.io/library/debian:bookworm-slim"
CUDA_STYLE_IMAGE = os.environ.get("E2E_CUDA_STYLE_IMAGE", "localhost/dra-gpu-e2e/cuda-style:1")
NVIDIA_DEMO_IMAGE = os.environ.get("E2E_NVIDIA_DEMO_IMAGE", "localhost/dra-gpu-e2e/nvidia-demo:1")
DEMO_SAMPLE = b"""#!/bin/sh
# Stands in for the CUDA sample of NVIDIA's demo manifests: what this container sees of its GPUs.
nvidia-smi -L
env | grep -E '^(NVIDIA|CUDA)_' | sort
echo END-OF-REPORT
exec sleep 2147483647
"""
DEBIAN_MIRROR = os.environ.get("E2E_DEBIAN_MIRROR", "http://deb.debian.org/debian")
DEBIAN_SUITE = "bookworm"
DEBIAN_LAYER_FORMAT = 1  # bump when the filtering of mmdebstrap's output changes: a new cache key
# The merged-usr hook sets up /bin -> usr/bin without the usrmerge package (which pulls in perl).
# No docs, man pages or locales in an image (the copyrights and locale.alias stay).
MMDEBSTRAP_PATH_FILTERS = [
    f"--dpkgopt=path-{kind}=/usr/share/{path}"
    for kind, path in (
        ("exclude", "doc/*"),
        ("include", "doc/*/copyright"),
        ("exclude", "man/*"),
        ("exclude", "info/*"),
        ("exclude", "locale/*"),
        ("include", "locale/locale.alias"),
    )
]
MMDEBSTRAP_ARGS = [
    "--variant=minbase",
    "--include=python3",
    "--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr",
    *MMDEBSTRAP_PATH_FILTERS,
]
DEBIAN_PATH = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# NVIDIA's CUDA base images (nvidia/cuda .../base/Dockerfile): the GKE-style /usr/local/nvidia first.
CUDA_STYLE_ENV = [
    "PATH=/usr/local/nvidia/bin:/usr/local/cuda/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LD_LIBRARY_PATH=/usr/local/nvidia/lib:/usr/local/nvidia/lib64",
]


def _tarinfo(name, **kw):
    ti = tarfile.TarInfo(name)
    ti.mtime = 0
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = "root"
    for k, v in kw.items():
        setattr(ti, k, v)
    return ti


def build_layer():
    with open(BUSYBOX, "rb") as f:
        data = f.read()
    applets = subprocess.run(
        [BUSYBOX, "--list-full"], check=True, capture_output=True, text=True
    ).stdout.split()
    dirs = {"bin", "dev", "etc", "proc", "sys", "tmp", "root", "usr", "usr/bin", "usr/sbin", "sbin", "var"}
    for a in applets:
        parts = a.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            dirs.add("/".join(parts[:i]))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for d in sorted(dirs):
            mode = 0o1777 if d == "tmp" else 0o755
            tf.addfile(_tarinfo(d + "/", type=tarfile.DIRTYPE, mode=mode))
        tf.addfile(_tarinfo("bin/busybox", size=len(data), mode=0o755), io.BytesIO(data))
        for a in sorted(set(applets)):
            if a == "bin/busybox":
                continue
            tf.addfile(_tarinfo(a, type=tarfile.SYMTYPE, linkname="/bin/busybox", mode=0o777))
        passwd = b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n"
        group = b"root:x:0:\nnobody:x:65534:\n"
        for name, content in (("etc/passwd", passwd), ("etc/group", group)):
            tf.addfile(_tarinfo(name, size=len(content), mode=0o644), io.BytesIO(content))
    return buf.getvalue()


def _blob(tf, data, media_type):
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    tf.addfile(_tarinfo("blobs/sha256/" + digest[7:], size=len(data), mode=0o644), io.BytesIO(data))
    return {"mediaType": media_type, "digest": digest, "size": len(data)}


def _dumps(obj):
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def write_image(path, name, layer, config_extra):
    """An image of one uncompressed layer given as bytes."""
    _write_layout(path, name, [_bytes_layer(layer)], config_extra)


# A layer: (diff_id, a function that stores its blob in the archive and returns its descriptor).
Layer = tuple[str, Callable[[tarfile.TarFile], dict[str, Any]]]


def _bytes_layer(layer: bytes) -> Layer:
    def add_layer(tf: tarfile.TarFile) -> dict[str, Any]:
        return _blob(tf, layer, "application/vnd.oci.image.layer.v1.tar")

    return "sha256:" + hashlib.sha256(layer).hexdigest(), add_layer


def _write_layout(
    path: str, name: str, layers: list[Layer], config_extra: dict[str, Any], also: tuple[str, ...] = ()
) -> None:
    """Write an OCI layout archive of `layers`, bottom first, named `name` and each of `also`
    (one index entry per name, all of the same manifest)."""
    config = {
        "architecture": {"x86_64": "amd64", "aarch64": "arm64"}.get(os.uname().machine, os.uname().machine),
        "os": "linux",
        "config": dict({"Env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"], "WorkingDir": "/"}, **config_extra),
        "rootfs": {"type": "layers", "diff_ids": [diff_id for diff_id, _ in layers]},
        "history": [{"created_by": "dra-gpu e2e/node/images.py"}],
    }
    tmp = path + ".tmp"
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tf:
        tf.addfile(_tarinfo("blobs/", type=tarfile.DIRTYPE, mode=0o755))
        tf.addfile(_tarinfo("blobs/sha256/", type=tarfile.DIRTYPE, mode=0o755))
        layer_descs = [add_layer(tf) for _, add_layer in layers]
        config_desc = _blob(tf, _dumps(config), "application/vnd.oci.image.config.v1+json")
        manifest = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": config_desc,
            "layers": layer_descs,
        }
        mdesc = _blob(tf, _dumps(manifest), "application/vnd.oci.image.manifest.v1+json")
        entries = []
        for n in (name, *also):
            tag = n.rsplit(":", 1)[1] if ":" in n.rsplit("/", 1)[-1] else "latest"
            annotations = {"io.containerd.image.name": n, "org.opencontainers.image.ref.name": tag}
            entries.append(dict(mdesc, annotations=annotations))
        index = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.index.v1+json",
            "manifests": entries,
        }
        for fname, content in (
            ("oci-layout", _dumps({"imageLayoutVersion": "1.0.0"})),
            ("index.json", _dumps(index)),
        ):
            tf.addfile(_tarinfo(fname, size=len(content), mode=0o644), io.BytesIO(content))
    os.replace(tmp, path)


# ---------------------------------------------------------------------------- Debian images


class _Sink(Protocol):
    def write(self, data: bytes, /) -> int: ...


class _Hashing(io.RawIOBase):
    """A write-only stream that hashes and counts what passes through to `out`."""

    def __init__(self, out: _Sink) -> None:
        self.out, self.sha, self.size = out, hashlib.sha256(), 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        data = bytes(b)
        self.sha.update(data)
        self.size += len(data)
        self.out.write(data)
        return len(data)


def _keep(member: tarfile.TarInfo) -> bool:
    """Leave out what a container gets from its runtime (/dev) and what apt left behind."""
    if member.isdir():
        return True
    return not member.name.startswith(("dev/", "var/lib/apt/lists/", "var/cache/apt/"))


def debian_layer(cache_dir: str) -> tuple[str, dict[str, Any]]:
    """The gzip'ed rootfs layer and its metadata, built with mmdebstrap once per input hash."""
    cmd = ["mmdebstrap", "--quiet", *MMDEBSTRAP_ARGS, DEBIAN_SUITE, "-", DEBIAN_MIRROR]
    key = hashlib.sha256(_dumps([cmd, DEBIAN_LAYER_FORMAT])).hexdigest()[:16]
    layer, meta_path = os.path.join(cache_dir, key + ".tar.gz"), os.path.join(cache_dir, key + ".json")
    if os.path.exists(meta_path) and os.path.exists(layer):
        with open(meta_path) as f:
            return layer, json.load(f)
    if shutil.which("mmdebstrap") is None:
        sys.exit("images.py --debian needs mmdebstrap (e2e/node/build.sh debs installs it)")
    os.makedirs(cache_dir, exist_ok=True)
    t0 = time.monotonic()
    env = dict(os.environ, SOURCE_DATE_EPOCH="0")  # mmdebstrap clamps mtimes: stable layers
    with (
        tempfile.TemporaryFile() as log,
        open(layer + ".tmp", "wb") as raw,
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, env=env) as proc,
    ):
        gz_hash = _Hashing(raw)
        with gzip.GzipFile(fileobj=gz_hash, mode="wb", compresslevel=6, mtime=0) as gz:
            tar_hash = _Hashing(gz)
            assert proc.stdout is not None
            with (
                tarfile.open(fileobj=proc.stdout, mode="r|") as src,
                tarfile.open(fileobj=tar_hash, mode="w|", format=tarfile.PAX_FORMAT) as dst,
            ):
                for m in src:
                    m.name = m.name.removeprefix("./") or "."
                    if m.islnk():
                        m.linkname = m.linkname.removeprefix("./")
                    if m.name == "." or not _keep(m):
                        continue
                    dst.addfile(m, src.extractfile(m) if m.isreg() else None)
        if proc.wait() != 0:
            log.seek(0)
            tail = log.read().decode(errors="replace")[-3000:]
            sys.exit(f"mmdebstrap failed ({proc.returncode}):\n{tail}")
    meta = {
        "digest": "sha256:" + gz_hash.sha.hexdigest(),
        "size": gz_hash.size,
        "diff_id": "sha256:" + tar_hash.sha.hexdigest(),
        "uncompressed_size": tar_hash.size,
        "seconds": round(time.monotonic() - t0, 1),
    }
    os.replace(layer + ".tmp", layer)
    with open(meta_path + ".tmp", "w") as f:
        json.dump(meta, f)
    os.replace(meta_path + ".tmp", meta_path)
    for old in os.listdir(cache_dir):  # keep one layer: the inputs moved on
        if not old.startswith(key):
            os.remove(os.path.join(cache_dir, old))
    return layer, meta


def _demo_layer() -> bytes:
    """/tmp/sample, in place of the CUDA sample programs of NVIDIA's demo manifests (there is no
    GPU here to run CUDA on): it reports what the container sees of its GPUs and stays up."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        tf.addfile(_tarinfo("tmp/", type=tarfile.DIRTYPE, mode=0o1777))
        tf.addfile(_tarinfo("tmp/sample", size=len(DEMO_SAMPLE), mode=0o755), io.BytesIO(DEMO_SAMPLE))
    return buf.getvalue()


def debian_images(outdir: str) -> None:
    """OUTDIR/debian.tar, OUTDIR/cuda-style.tar and OUTDIR/nvidia-demo.tar, rewritten only when
    their inputs change."""
    layer, meta = debian_layer(os.path.join(outdir, "debian-layer"))
    targets = {
        "debian.tar": (DEBIAN_IMAGE, {"Cmd": ["sh"], "Env": [DEBIAN_PATH]}),
        "cuda-style.tar": (CUDA_STYLE_IMAGE, {"Cmd": ["sh"], "Env": CUDA_STYLE_ENV}),
        "nvidia-demo.tar": (NVIDIA_DEMO_IMAGE, {"Cmd": ["/tmp/sample"], "Env": [DEBIAN_PATH]}),
    }
    also = {"debian.tar": (DEBIAN_SLIM_IMAGE,)}
    stamp = _dumps([meta["digest"], targets, also, DEMO_SAMPLE.decode()]).decode()
    stamp_path = os.path.join(outdir, ".debian-stamp")
    if (
        os.path.exists(stamp_path)
        and _read(stamp_path) == stamp
        and all(os.path.exists(os.path.join(outdir, n)) for n in targets)
    ):
        return

    def add_layer(tf: tarfile.TarFile) -> dict[str, Any]:
        ti = _tarinfo("blobs/sha256/" + meta["digest"][7:], size=meta["size"], mode=0o644)
        with open(layer, "rb") as f:
            tf.addfile(ti, f)
        return {
            "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
            **{k: meta[k] for k in ("digest", "size")},
        }

    base: Layer = (meta["diff_id"], add_layer)
    for fname, (name, config) in targets.items():
        layers = [base, _bytes_layer(_demo_layer())] if fname == "nvidia-demo.tar" else [base]
        _write_layout(os.path.join(outdir, fname), name, layers, config, also.get(fname, ()))
    with open(stamp_path, "w") as f:
        f.write(stamp)


def main(outdir):
    os.makedirs(outdir, exist_ok=True)
    with open(BUSYBOX, "rb") as f:
        stamp = f"{hashlib.sha256(f.read()).hexdigest()} {BUSYBOX_IMAGE} {PAUSE_IMAGE}"
    stamp_path = os.path.join(outdir, ".stamp")
    if (
        os.path.exists(stamp_path)
        and _read(stamp_path) == stamp
        and all(os.path.exists(os.path.join(outdir, n)) for n in ("busybox.tar", "pause.tar"))
    ):
        return
    layer = build_layer()
    write_image(os.path.join(outdir, "busybox.tar"), BUSYBOX_IMAGE, layer, {"Cmd": ["sh"]})
    write_image(
        os.path.join(outdir, "pause.tar"), PAUSE_IMAGE, layer, {"Entrypoint": ["/bin/sleep", "2147483647"]}
    )
    with open(stamp_path, "w") as f:
        f.write(stamp)


def _read(path):
    with open(path) as f:
        return f.read()


def import_missing(outdir, containerd_address, archives):
    """Import the archives whose image containerd (k8s.io namespace) lacks; `ctr` from PATH."""
    ctr = ["ctr", "--address", containerd_address, "-n", "k8s.io", "images"]
    have = subprocess.run([*ctr, "ls", "-q"], check=True, capture_output=True, text=True).stdout.split()
    imported = set()
    for tar, name in archives:
        if name not in have and tar not in imported:  # an archive may carry several names
            subprocess.run([*ctr, "import", os.path.join(outdir, tar)], check=True, capture_output=True)
            imported.add(tar)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="build OCI image archives without a registry")
    ap.add_argument("outdir")
    ap.add_argument("--debian", action="store_true", help="also the Debian (glibc) and CUDA-style images")
    ap.add_argument("--import-to", metavar="CONTAINERD_ADDRESS", help="import the --debian images there")
    args = ap.parse_args()
    main(args.outdir)
    if args.debian:
        debian_images(args.outdir)
        if args.import_to:
            import_missing(
                args.outdir,
                args.import_to,
                (
                    ("debian.tar", DEBIAN_IMAGE),
                    ("debian.tar", DEBIAN_SLIM_IMAGE),
                    ("cuda-style.tar", CUDA_STYLE_IMAGE),
                    ("nvidia-demo.tar", NVIDIA_DEMO_IMAGE),
                ),
            )
