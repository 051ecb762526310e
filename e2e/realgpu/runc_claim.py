#!/usr/bin/env python3
"""One claim's CDI spec, made by dra-gpu's own code, applied with runc over a glibc rootfs.

    runc_claim.py --driver-root R --dev-root DIR_WITH_dev --nvml-json J --work W
                  (--image IMAGEDIR/debian.tar | --host-rootfs) [--simulated]

The spec: the claim's part for the first GPU NVML listed (`CdiSpecs.build`: its device node, the
control nodes present under D, NVIDIA_VISIBLE_DEVICES=void, DRA_GPU_VISIBLE_DEVICES and the default
GpuConfig's env) composed with
the node's driver user space (`discover_installation` + `container_edits`: libraries, binaries,
firmware of the running version, found under R), exactly as the kubelet plugin composes them; no
CDI hook (NVIDIA's nvidia-cdi-hook is not assumed). Applied as a CDI-aware runtime applies it: env
appended, each deviceNode made in the container from its host node's type/major/minor and allowed
in the device cgroup, each mount bind-mounted with its options, hooks copied into runc's config.

The rootfs: the layer of the Debian test image (`e2e/node/images.py OUT --debian`: bookworm minbase
with python3, no NVIDIA file), or, offline on a GPU machine, one assembled read-only from the
host's own /usr, /lib*, /bin, /sbin, /etc, copy-on-write over a tmpfs so that runc can make the
spec's mount points (the host's files are never written; they may include NVIDIA files of the
host's own: the spec's mounts then cover them at the same paths). The container runs
`nvidia-smi -L` from its PATH.

Expected: on a real node the GPU is listed (`GPU 0: ... (UUID: GPU-...)`). On a host-like root
(--simulated) NVIDIA's real nvidia-smi loads the spec's simulated libnvidia-ml.so.1 and stops with
`Mismatch in versions between nvidia-smi and NVML.`: nvidia-smi checks NVML's private interface,
which only NVIDIA's own library has. Needs root and runc; prints `RESULT runc: ...`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
CONTAINER_CMD = (
    'command -v nvidia-smi >/dev/null || { echo "no nvidia-smi on the container\'s PATH ($PATH)"; '
    'exit 127; }; echo "nvidia-smi is $(command -v nvidia-smi)"; nvidia-smi -L'
)
SIM_ANSWER = "Mismatch in versions between nvidia-smi and NVML."
HOST_DIRS = ("usr", "etc", "bin", "sbin", "lib", "lib32", "lib64", "libx32")


def claim_spec(root: Path, dev_root: Path, version: str, gpu: dict[str, Any]) -> dict[str, Any]:
    """The claim's spec as the plugin composes it; `dev_root` holds `dev/` (and `proc/devices`)."""
    from dra_gpu.discovery.driver_install import discover_installation
    from dra_gpu.model.config.v1alpha1 import DEFAULT_GPU_CONFIG
    from dra_gpu.plugin.cdi import CdiDevice, CdiSpecs, visible_devices_env
    from dra_gpu.plugin.device_nodes import DeviceNodes, NumberedNode
    from dra_gpu.plugin.driver_files import container_edits

    found = discover_installation(root, version)
    summary = found.summary()
    summary.pop("files", None)
    print(f"  driver installation: {json.dumps(summary)}")
    if found.error:
        raise RuntimeError(f"dra-gpu finds no usable installation under {root}: {found.error}")
    # No nvidia-modprobe: the check creates no node; a missing one is left out and named.
    nodes = DeviceNodes(dev_root, modprobe=None, proc_devices=Path("/proc/devices"))
    control = []
    for n in nodes.control():
        if isinstance(n, NumberedNode) or os.path.exists(n.host_path):
            control.append(n)
        else:
            print(
                f"  {n.path}: no {n.host_path} (left out here; the plugin's prepare would refuse the claim)"
            )
    uuid = gpu["uuid"]
    device = CdiDevice(
        name=f"gpu-{gpu['minor']}",
        device_nodes=nodes.gpu(SimpleNamespace(minor=gpu["minor"])),  # type: ignore[arg-type]
        env=DEFAULT_GPU_CONFIG.container_env([uuid]),
    )
    specs = CdiSpecs(Path("/nonexistent"), "gpu.dra-gpu.io")
    own = specs.build("real-gpu-check", [device], control, visible_devices_env([uuid]))
    return specs.compose(own, container_edits(found))


def _runc_check() -> Any:
    path = REPO / "e2e" / "node" / "simdriver" / "runc_check.py"
    spec = importlib.util.spec_from_file_location("runc_check", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def image_rootfs(image: Path, rootfs: Path) -> list[str]:
    runc_check = _runc_check()
    config, layer = runc_check._read_image(image)
    runc_check._unpack(image, layer, rootfs)
    env: list[str] = config["config"]["Env"]
    return env


def host_rootfs(rootfs: Path) -> list[str]:
    """A rootfs of the host's own system directories, each an overlay whose upper layer is a tmpfs
    (runc makes the spec's mount points in it; the host's files are never written). This process
    is in a private mount namespace: the mounts vanish with it."""
    rootfs.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=755", "tmpfs", str(rootfs)], check=True)
    layers = rootfs / ".layers"
    for name in HOST_DIRS:
        src = Path("/") / name
        if src.is_symlink():
            os.symlink(os.readlink(src), rootfs / name)
        elif src.is_dir():
            upper, work = layers / name / "upper", layers / name / "work"
            upper.mkdir(parents=True)
            work.mkdir()
            (rootfs / name).mkdir()
            options = f"lowerdir={src},upperdir={upper},workdir={work}"
            mount = ["mount", "-t", "overlay", "overlay", "-o", options, str(rootfs / name)]
            subprocess.run(mount, check=True)
    for name in ("proc", "dev", "sys", "tmp", "run"):
        (rootfs / name).mkdir(exist_ok=True)
    return ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]


def runc_config(spec: dict[str, Any], base: dict[str, Any], rootfs: Path, env: list[str]) -> dict[str, Any]:
    """runc's config.json with the spec's container edits applied (spec-level, then the device's)."""
    config = dict(base)
    config["root"] = {"path": str(rootfs), "readonly": True}
    process = dict(config["process"])
    process.update(terminal=False, args=["sh", "-c", CONTAINER_CMD])
    env = list(env)
    linux = config["linux"]
    devices: list[dict[str, Any]] = []
    allow = linux["resources"]["devices"]
    mounts = list(config["mounts"])
    hooks: dict[str, list[dict[str, Any]]] = {}
    for edits in [spec.get("containerEdits", {})] + [d["containerEdits"] for d in spec["devices"]]:
        env += edits.get("env", [])
        for n in edits.get("deviceNodes", []):
            if "major" in n:  # by number: the runtime makes it, no host node is read
                kind, major, minor = n.get("type", "c"), n["major"], n["minor"]
            else:  # the host's node: its type and numbers
                st = os.stat(n.get("hostPath", n["path"]))
                kind = "c" if stat.S_ISCHR(st.st_mode) else "b"
                major, minor = os.major(st.st_rdev), os.minor(st.st_rdev)
            mode = n.get("fileMode", 0o666)
            node = {"path": n["path"], "type": kind, "major": major, "minor": minor, "fileMode": mode}
            devices.append({**node, "uid": 0, "gid": 0})
            access = n.get("permissions", "rwm")
            allow.append({"allow": True, "type": kind, "major": major, "minor": minor, "access": access})
        for m in edits.get("mounts", []):
            mounts.append(
                {
                    "destination": m["containerPath"],
                    "type": m.get("type", "bind"),
                    "source": m["hostPath"],
                    "options": m.get("options", []),
                }
            )
        for h in edits.get("hooks", []):
            entry = {k: h[k] for k in ("path", "args", "env", "timeout") if k in h}
            hooks.setdefault(h["hookName"], []).append(entry)
    process["env"] = env
    config["process"] = process
    linux["devices"] = devices
    config["mounts"] = mounts
    if hooks:
        config["hooks"] = hooks
    return config


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--driver-root", type=Path, required=True)
    ap.add_argument("--dev-root", type=Path, required=True)
    ap.add_argument("--nvml-json", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--image", type=Path)
    ap.add_argument("--host-rootfs", action="store_true")
    ap.add_argument("--simulated", action="store_true")
    args = ap.parse_args()
    runc = shutil.which("runc")
    if runc is None:
        print("RESULT runc: SKIP runc is not installed")
        return 0
    try:
        nvml = json.loads(args.nvml_json.read_text())
        gpu = nvml["gpus"][0]
        version = nvml["driverVersion"]
    except (OSError, ValueError, KeyError, IndexError) as exc:
        print(f"RESULT runc: FAIL no GPU from the NVML section ({args.nvml_json}: {exc})")
        return 1
    try:
        spec = claim_spec(args.driver_root, args.dev_root, version, gpu)
    except Exception as exc:
        print(f"RESULT runc: FAIL cannot make the claim's CDI spec: {type(exc).__name__}: {exc}")
        return 1
    edits = spec["containerEdits"]
    print(
        f"  claim spec: cdiVersion {spec['cdiVersion']}, kind {spec['kind']}, device "
        f"{spec['devices'][0]['name']}, {len(edits.get('mounts', []))} mounts, "
        f"{len(edits.get('deviceNodes', [])) + len(spec['devices'][0]['containerEdits']['deviceNodes'])} "
        f"device nodes, env {edits.get('env')}"
    )
    smi = [m["containerPath"] for m in edits.get("mounts", []) if m["containerPath"].endswith("/nvidia-smi")]
    print(f"  nvidia-smi in the spec: {', '.join(smi) or 'none'}")
    (args.work / "claim-spec.json").write_text(json.dumps(spec, indent=1) + "\n")
    rootfs = args.work / "rootfs"
    if args.image:
        env = image_rootfs(args.image, rootfs)
        print(f"  rootfs: the layer of {args.image}")
    elif args.host_rootfs:
        env = host_rootfs(rootfs)
        dirs = ", ".join("/" + d for d in HOST_DIRS if os.path.lexists("/" + d))
        print(f"  rootfs: the host's own {dirs} (overlays over a tmpfs: the host's files are not written)")
    else:
        print("RESULT runc: FAIL no rootfs (--image or --host-rootfs)")
        return 1
    bundle = args.work / "bundle"
    bundle.mkdir()
    subprocess.run([runc, "spec", "--bundle", str(bundle)], check=True)
    base = json.loads((bundle / "config.json").read_text())
    (bundle / "config.json").write_text(json.dumps(runc_config(spec, base, rootfs, env), indent=1))
    cid = f"real-gpu-check-{os.getpid()}"
    try:
        proc = subprocess.run(
            [runc, "--root", str(args.work / "runc-state"), "run", "--bundle", str(bundle), cid],
            capture_output=True,
            text=True,
            timeout=120,
        )
    except subprocess.TimeoutExpired:
        subprocess.run(
            [runc, "--root", str(args.work / "runc-state"), "delete", "--force", cid], capture_output=True
        )
        print("RESULT runc: FAIL the container ran past 120 s")
        return 1
    out = (proc.stdout + proc.stderr).strip()
    print(f"  container (rc {proc.returncode}):")
    for line in out.splitlines():
        print(f"    {line}")
    lines = out.splitlines()
    listed = [line for line in lines if line.startswith("GPU ") and "(UUID: GPU-" in line]
    if listed and proc.returncode == 0:
        print(f"RESULT runc: ok nvidia-smi -L in the container listed {len(listed)} GPU(s)")
        return 0
    if args.simulated and SIM_ANSWER in lines:
        print(
            "RESULT runc: ok NVIDIA's nvidia-smi ran in the container over the spec's simulated "
            "libnvidia-ml.so.1 and gave the simulated node's answer (it checks NVML's private "
            "interface, which only NVIDIA's own library has)"
        )
        return 0
    reason = lines[-1] if lines else f"rc {proc.returncode}, no output"
    print(f"RESULT runc: FAIL {reason}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
