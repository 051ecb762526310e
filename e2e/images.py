#!/usr/bin/env python3
"""Build OCI image archives without a registry (Python stdlib only).

    e2e/images.py OUTDIR

writes OUTDIR/busybox.tar and OUTDIR/pause.tar: OCI image layouts (oci-layout, index.json,
blobs/sha256/...) that `ctr -n k8s.io images import` and `kind load image-archive` accept.
Both share one layer: Debian's static busybox at /bin/busybox plus a symlink per applet.

- busybox image: name from $E2E_BUSYBOX_IMAGE (default localhost/dra-gpu-e2e/busybox:1), cmd sh.
- pause image: name from $E2E_PAUSE_IMAGE (default registry.k8s.io/pause:3.10.1, the sandbox
  image containerd 2.2 pins); its entrypoint sleeps forever (the sandbox is killed with SIGKILL).

The archives are deterministic (mtime 0, sorted entries), so the same busybox gives the same
digests; OUTDIR/.stamp records the busybox hash so callers can skip rebuilding.
"""

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile

BUSYBOX = os.environ.get("E2E_BUSYBOX_BIN", "/bin/busybox")
BUSYBOX_IMAGE = os.environ.get("E2E_BUSYBOX_IMAGE", "localhost/dra-gpu-e2e/busybox:1")
PAUSE_IMAGE = os.environ.get("E2E_PAUSE_IMAGE", "registry.k8s.io/pause:3.10.1")


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
    diff_id = "sha256:" + hashlib.sha256(layer).hexdigest()
    config = {
        "architecture": {"x86_64": "amd64", "aarch64": "arm64"}.get(os.uname().machine, os.uname().machine),
        "os": "linux",
        "config": dict({"Env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"], "WorkingDir": "/"}, **config_extra),
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        "history": [{"created_by": "dra-gpu e2e/images.py"}],
    }
    tmp = path + ".tmp"
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tf:
        tf.addfile(_tarinfo("blobs/", type=tarfile.DIRTYPE, mode=0o755))
        tf.addfile(_tarinfo("blobs/sha256/", type=tarfile.DIRTYPE, mode=0o755))
        layer_desc = _blob(tf, layer, "application/vnd.oci.image.layer.v1.tar")
        config_desc = _blob(tf, _dumps(config), "application/vnd.oci.image.config.v1+json")
        manifest = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": config_desc,
            "layers": [layer_desc],
        }
        mdesc = _blob(tf, _dumps(manifest), "application/vnd.oci.image.manifest.v1+json")
        tag = name.rsplit(":", 1)[1] if ":" in name.rsplit("/", 1)[-1] else "latest"
        mdesc["annotations"] = {"io.containerd.image.name": name, "org.opencontainers.image.ref.name": tag}
        index = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.index.v1+json",
            "manifests": [mdesc],
        }
        for fname, content in (
            ("oci-layout", _dumps({"imageLayoutVersion": "1.0.0"})),
            ("index.json", _dumps(index)),
        ):
            tf.addfile(_tarinfo(fname, size=len(content), mode=0o644), io.BytesIO(content))
    os.replace(tmp, path)


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


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: images.py OUTDIR")
    main(sys.argv[1])
