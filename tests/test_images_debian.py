"""e2e/node/images.py --debian without the network: a stand-in mmdebstrap emits a tiny root tarball.

Checks the layer filtering (no /dev nodes, no apt lists, no "./" prefixes), the OCI digests
(compressed blob, uncompressed diff_id), the two image configs, and that the layer is cached.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import io
import json
import os
import sys
import tarfile
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

IMAGES = Path(__file__).resolve().parents[1] / "e2e" / "node" / "images.py"

FAKE_MMDEBSTRAP = """#!{python}
import io, os, sys, tarfile
open(os.environ["FAKE_MMDEBSTRAP_CALLS"], "a").write(" ".join(sys.argv[1:]) + "\\n")
assert sys.argv[-2] == "-", sys.argv  # the tarball goes to stdout
with tarfile.open(fileobj=sys.stdout.buffer, mode="w|") as tf:
    def add(name, **kw):
        ti = tarfile.TarInfo(name)
        data = kw.pop("data", None)
        for k, v in kw.items():
            setattr(ti, k, v)
        if data is not None:
            ti.size = len(data)
        tf.addfile(ti, io.BytesIO(data) if data is not None else None)
    add("./", type=tarfile.DIRTYPE, mode=0o755)
    add("./dev/", type=tarfile.DIRTYPE, mode=0o755)
    add("./dev/null", type=tarfile.CHRTYPE, devmajor=1, devminor=3, mode=0o666)
    add("./bin", type=tarfile.SYMTYPE, linkname="usr/bin")
    add("./usr/", type=tarfile.DIRTYPE, mode=0o755)
    add("./usr/bin/", type=tarfile.DIRTYPE, mode=0o755)
    add("./usr/bin/python3.11", data=b"\\x7fELF python", mode=0o755)
    add("./usr/bin/python3", type=tarfile.LNKTYPE, linkname="./usr/bin/python3.11")
    add("./var/lib/apt/lists/", type=tarfile.DIRTYPE, mode=0o755)
    add("./var/lib/apt/lists/lock", data=b"")
    add("./etc/os-release", data=b"ID=debian\\n", mode=0o644)
"""


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("e2e_images", IMAGES)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def images(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "mmdebstrap"
    fake.write_text(FAKE_MMDEBSTRAP.format(python=sys.executable))
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setenv("FAKE_MMDEBSTRAP_CALLS", str(tmp_path / "calls"))
    for var in ("E2E_DEBIAN_IMAGE", "E2E_CUDA_STYLE_IMAGE", "E2E_DEBIAN_MIRROR"):
        monkeypatch.delenv(var, raising=False)  # read when the script is loaded
    return _load()


def _read(archive: Path) -> tuple[dict[str, Any], dict[str, Any], bytes]:
    """Index, image config and layer blob of an OCI archive, with every digest checked."""
    with tarfile.open(archive) as tf:

        def blob(desc: dict[str, Any]) -> bytes:
            f = tf.extractfile("blobs/sha256/" + desc["digest"].split(":", 1)[1])
            assert f is not None
            data = f.read()
            assert (len(data), "sha256:" + hashlib.sha256(data).hexdigest()) == (desc["size"], desc["digest"])
            return data

        f = tf.extractfile("index.json")
        assert f is not None
        index = json.load(f)
        manifest = json.loads(blob(index["manifests"][0]))
        config = json.loads(blob(manifest["config"]))
        (layer_desc,) = manifest["layers"]
        assert layer_desc["mediaType"] == "application/vnd.oci.image.layer.v1.tar+gzip"
        return index, config, blob(layer_desc)


def test_debian_images(images: ModuleType, tmp_path: Path) -> None:
    out = tmp_path / "out"
    images.debian_images(str(out))
    idx, config, layer = _read(out / "debian.tar")
    assert idx["manifests"][0]["annotations"]["io.containerd.image.name"] == "localhost/dra-gpu-e2e/debian:1"
    assert config["config"]["Cmd"] == ["sh"]
    raw = gzip.decompress(layer)
    assert config["rootfs"]["diff_ids"] == ["sha256:" + hashlib.sha256(raw).hexdigest()]
    with tarfile.open(fileobj=io.BytesIO(raw)) as tf:
        members = {m.name: m for m in tf.getmembers()}
    assert sorted(members) == [
        "bin",
        "dev",
        "etc/os-release",
        "usr",
        "usr/bin",
        "usr/bin/python3",
        "usr/bin/python3.11",
        "var/lib/apt/lists",
    ]
    assert members["usr/bin/python3"].islnk() and members["usr/bin/python3"].linkname == "usr/bin/python3.11"

    idx, cuda_config, cuda_layer = _read(out / "cuda-style.tar")
    assert (
        idx["manifests"][0]["annotations"]["io.containerd.image.name"] == "localhost/dra-gpu-e2e/cuda-style:1"
    )
    assert cuda_layer == layer
    env = dict(e.split("=", 1) for e in cuda_config["config"]["Env"])
    assert env["PATH"].startswith("/usr/local/nvidia/bin:/usr/local/cuda/bin:")
    assert env["LD_LIBRARY_PATH"] == "/usr/local/nvidia/lib:/usr/local/nvidia/lib64"

    # NVIDIA's demo manifests' image: the same Debian layer, and /tmp/sample above it as its cmd.
    with tarfile.open(out / "nvidia-demo.tar") as tf:

        def member(name: str) -> bytes:
            f = tf.extractfile(name)
            assert f is not None, name
            return f.read()

        (entry,) = json.loads(member("index.json"))["manifests"]
        demo = json.loads(member("blobs/sha256/" + entry["digest"][7:]))
        base, sample = demo["layers"]
        assert member("blobs/sha256/" + base["digest"][7:]) == layer
        demo_config = json.loads(member("blobs/sha256/" + demo["config"]["digest"][7:]))
        with tarfile.open(fileobj=io.BytesIO(member("blobs/sha256/" + sample["digest"][7:]))) as st:
            f = st.extractfile("tmp/sample")
            assert f is not None
            script = f.read().decode()
    assert demo_config["config"]["Cmd"] == ["/tmp/sample"]
    assert len(demo_config["rootfs"]["diff_ids"]) == 2
    assert "nvidia-smi -L" in script and "exec sleep" in script

    # Cached: no second mmdebstrap run, the archives stay as they are.
    before = (out / "debian.tar").stat().st_mtime_ns
    images.debian_images(str(out))
    assert len((tmp_path / "calls").read_text().splitlines()) == 1
    assert (out / "debian.tar").stat().st_mtime_ns == before
