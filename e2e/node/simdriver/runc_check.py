#!/usr/bin/env python3
"""Run the Debian test images with runc and the simulated driver bind-mounted in (no cluster).

    python3 e2e/node/simdriver/runc_check.py IMAGEDIR DRIVER_ROOT

IMAGEDIR holds debian.tar and cuda-style.tar (`e2e/node/images.py IMAGEDIR --debian`); DRIVER_ROOT is a
simulated driver root (`e2e/node/simdriver/build.py`). Each case unpacks the image's layer into a rootfs,
writes a config.json from `runc spec` with the mounts and device nodes a CDI spec would add, runs it
under a private `runc --root`, and checks what the container printed. This proves that a glibc
container's own loader finds libnvidia-ml.so.1 / libcuda.so.1 at the mounted paths and that the
simulated libraries see exactly the device nodes the container was given. Needs root and runc.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RO = ["rbind", "ro", "nosuid", "nodev", "rprivate"]  # the options CDI mounts of driver files carry
SMI_FAILED = (
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
    "Make sure that the latest NVIDIA driver is installed and running."
)


@dataclass
class Case:
    name: str
    image: str
    args: list[str]
    mounts: dict[str, Path] = field(default_factory=dict)  # container path -> host file
    gpu_minors: list[int] | None = None  # None: no NVIDIA device node at all
    want_rc: int = 0
    want_out: list[str] = field(default_factory=list)  # lines that must be printed
    exact: bool = False  # the output is exactly want_out

    def passed(self, rc: int, out: str) -> bool:
        lines = out.splitlines()
        if self.exact:
            return rc == self.want_rc and lines == self.want_out
        return rc == self.want_rc and all(w in lines for w in self.want_out)


def _read_image(archive: Path) -> tuple[dict[str, Any], str]:
    """The image config and the layer blob's name inside the archive."""
    with tarfile.open(archive) as tf:

        def member(name: str) -> dict[str, Any]:
            f = tf.extractfile(name)
            assert f is not None, f"{archive} has no {name}"
            return dict(json.load(f))

        def blob(digest: str) -> dict[str, Any]:
            return member("blobs/sha256/" + digest.split(":", 1)[1])

        manifest = blob(member("index.json")["manifests"][0]["digest"])
        config = blob(manifest["config"]["digest"])
        (layer,) = manifest["layers"]
        return config, "blobs/sha256/" + layer["digest"].split(":", 1)[1]


def _unpack(archive: Path, layer: str, rootfs: Path) -> None:
    rootfs.mkdir(parents=True)
    with tarfile.open(archive) as tf:
        src = tf.extractfile(layer)
        assert src is not None
        # GNU tar: keeps hard links, ownership and modes as a runtime's snapshotter would.
        proc = subprocess.Popen(["tar", "-xz", "-C", str(rootfs)], stdin=subprocess.PIPE)
        assert proc.stdin is not None
        shutil.copyfileobj(src, proc.stdin)
        proc.stdin.close()
        if proc.wait() != 0:
            raise SystemExit(f"unpacking {layer} of {archive} failed")


def _device(path: str, minor: int) -> dict[str, Any]:
    return {"path": path, "type": "c", "major": 195, "minor": minor, "fileMode": 0o666, "uid": 0, "gid": 0}


def _run(case: Case, bundle: Path, rootfs: Path, image_env: list[str], runc_root: Path) -> tuple[int, str]:
    bundle.mkdir()
    subprocess.run(["runc", "spec", "--bundle", str(bundle)], check=True)
    spec = json.loads((bundle / "config.json").read_text())
    spec["root"] = {"path": str(rootfs), "readonly": True}
    spec["process"].update(terminal=False, args=case.args, env=image_env)
    spec["mounts"] += [
        {"destination": dst, "type": "bind", "source": str(src.resolve()), "options": RO}
        for dst, src in case.mounts.items()
    ]
    if case.gpu_minors is not None:
        nodes = [_device("/dev/nvidiactl", 255)] + [_device(f"/dev/nvidia{m}", m) for m in case.gpu_minors]
        spec["linux"]["devices"] = nodes
        spec["linux"]["resources"]["devices"].append(
            {"allow": True, "type": "c", "major": 195, "access": "rwm"}
        )
    (bundle / "config.json").write_text(json.dumps(spec, indent=1))
    cid = f"simdriver-check-{os.getpid()}-{bundle.name}"
    proc = subprocess.run(
        ["runc", "--root", str(runc_root), "run", "--bundle", str(bundle), cid],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc.returncode, proc.stdout + proc.stderr


def cases(root: Path, triplet: str, version: str) -> list[Case]:
    libdir = root / "usr" / "lib" / triplet
    smi = root / "usr" / "bin" / "nvidia-smi"
    sys_lib = f"/usr/lib/{triplet}"
    debian_mounts = {f"{sys_lib}/libnvidia-ml.so.1": libdir / "libnvidia-ml.so.1", "/usr/bin/nvidia-smi": smi}
    minor_query = ["nvidia-smi", "--query-gpu=minor_number,driver_version", "--format=csv,noheader"]
    cuinit = "import ctypes; c = ctypes.CDLL('libcuda.so.1'); print('cuInit', c.cuInit(0))"
    return [
        Case("debian: python3 and ctypes, no NVIDIA file", "debian.tar", ["python3", "-c", "import ctypes"]),
        Case("debian: no driver mounted", "debian.tar", ["sh", "-c", "nvidia-smi -L"], want_rc=127),
        Case(
            "debian: nvidia-smi without its library cannot start",
            "debian.tar",
            ["nvidia-smi", "-L"],
            {"/usr/bin/nvidia-smi": smi},
            [0],
            want_rc=127,
            want_out=[
                "nvidia-smi: error while loading shared libraries: libnvidia-ml.so.1: "
                "cannot open shared object file: No such file or directory"
            ],
        ),
        Case(
            "debian: libnvidia-ml.so.1 mounted in the system lib dir, one GPU node",
            "debian.tar",
            minor_query,
            debian_mounts,
            [3],
            want_out=[f"3, {version}"],
            exact=True,
        ),
        Case(
            "debian: driver files but no device node",
            "debian.tar",
            ["nvidia-smi", "-L"],
            debian_mounts,
            None,
            want_rc=9,
            want_out=[SMI_FAILED],
        ),
        Case(
            "debian: libcuda.so.1 mounted, cuInit through the container's loader",
            "debian.tar",
            ["python3", "-c", cuinit],
            {f"{sys_lib}/libcuda.so.1": libdir / "libcuda.so.1"},
            [0, 1],
            want_out=["cuInit 0"],
            exact=True,
        ),
        Case(
            "cuda-style: /usr/local/nvidia/{bin,lib64} found through the image's PATH and LD_LIBRARY_PATH",
            "cuda-style.tar",
            minor_query,
            {
                "/usr/local/nvidia/lib64/libnvidia-ml.so.1": libdir / "libnvidia-ml.so.1",
                "/usr/local/nvidia/bin/nvidia-smi": smi,
            },
            [1, 6],
            want_out=[f"1, {version}", f"6, {version}"],
            exact=True,
        ),
    ]


def main(argv: list[str]) -> int:
    if len(argv) != 2 or os.geteuid() != 0 or shutil.which("runc") is None:
        print("usage (as root, with runc): runc_check.py IMAGEDIR DRIVER_ROOT", file=sys.stderr)
        return 2
    imagedir, root = Path(argv[0]), Path(argv[1])
    (triplet,) = [p.name for p in (root / "usr" / "lib").iterdir()]
    (version,) = [p.name for p in (root / "lib" / "firmware" / "nvidia").iterdir()]
    failed = 0
    with tempfile.TemporaryDirectory(prefix="simdriver-runc-") as tmp:
        work = Path(tmp)
        configs = {name: _read_image(imagedir / name) for name in ("debian.tar", "cuda-style.tar")}
        for i, case in enumerate([None, *cases(root, triplet, version)]):
            name = case.image if case else "debian.tar"
            config, layer = configs[name]
            rootfs = work / f"rootfs{i}"  # fresh per case: runc leaves mount points behind
            _unpack(imagedir / name, layer, rootfs)
            if case is None:
                found = [str(p.relative_to(rootfs)) for p in rootfs.rglob("*nvidia*")]
                print(f"{'FAIL' if found else 'ok  '} debian image has no NVIDIA file {found[:3]}")
                failed += bool(found)
                continue
            rc, out = _run(case, work / f"bundle{i}", rootfs, config["config"]["Env"], work / "runc")
            ok = case.passed(rc, out)
            failed += not ok
            print(f"{'ok  ' if ok else 'FAIL'} {case.name}: rc={rc}")
            if not ok or os.environ.get("VERBOSE"):
                print("    " + out.strip().replace("\n", "\n    "))
            shutil.rmtree(rootfs)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
