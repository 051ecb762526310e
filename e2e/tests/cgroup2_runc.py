"""Run one CDI device of a claim's spec in a container with runc, on cgroup v2 (no cluster).

    unshare --mount --propagation private sh -c \\
        'mount --bind /sys/fs/cgroup/unified /sys/fs/cgroup && exec "$@"' sh \\
        python cgroup2_runc.py SPEC DEVICE IMAGE_TAR DEV_DIR WORK

For a node whose kubelet and containerd run cgroup v1 with the unified (v2) hierarchy mounted
beside it (`/sys/fs/cgroup/unified`): in a private mount namespace where that hierarchy is
`/sys/fs/cgroup`, runc and NVIDIA's hooks see a cgroup v2 node. The container gets the device's
and the spec's environment and the device's OCI hooks exactly as the spec has them (runc runs
them: NVIDIA's `apply-cuda-memory-limits` among them), runs `sleep`, and is deleted. Printed (JSON):
the container's cgroup, the memory limits the simulated driver (DEV_DIR) held while it ran and
after it was gone, runc's exit code and output.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "node" / "simdriver"))
from runc_check import _read_image, _unpack
from simnode.state import read_state

RUNS_FOR = 4  # seconds the container sleeps: the limit is looked at while it runs
CGROUP = "/dra-gpu-e2e-memory-limits"


def bundle_for(spec: dict[str, Any], device: str, image: Path, work: Path) -> tuple[Path, str]:
    config, layer = _read_image(image)
    rootfs = work / "rootfs"
    _unpack(image, layer, rootfs)
    bundle = work / "bundle"
    bundle.mkdir()
    subprocess.run(["runc", "spec", "--bundle", str(bundle)], check=True)
    oci = json.loads((bundle / "config.json").read_text())
    (edits,) = [d["containerEdits"] for d in spec["devices"] if d["name"] == device]
    env = [*config["config"]["Env"], *spec["containerEdits"].get("env", []), *edits.get("env", [])]
    oci["root"] = {"path": str(rootfs), "readonly": True}
    oci["process"].update(terminal=False, args=["sleep", str(RUNS_FOR)], env=env)
    cgroup = f"{CGROUP}/{work.name}"
    oci["linux"]["cgroupsPath"] = cgroup
    hooks: dict[str, list[dict[str, Any]]] = {}
    for hook in edits.get("hooks", []):
        entry = {k: v for k, v in hook.items() if k != "hookName"}
        hooks.setdefault(hook["hookName"], []).append(entry)
    oci["hooks"] = hooks
    (bundle / "config.json").write_text(json.dumps(oci))
    return bundle, "/sys/fs/cgroup" + cgroup


def main(argv: list[str]) -> int:
    spec_path, device, image, dev_dir, work = argv
    spec = json.loads(Path(spec_path).read_text())
    bundle, cgroup = bundle_for(spec, device, Path(image), Path(work))
    proc = subprocess.Popen(
        ["runc", "--root", str(Path(work) / "runc"), "run", "--bundle", str(bundle), Path(work).name],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    during: dict[str, Any] = {}
    deadline = time.monotonic() + RUNS_FOR
    while proc.poll() is None and time.monotonic() < deadline and not during:
        during = read_state(dev_dir).memory_limits
        time.sleep(0.1)
    output, _ = proc.communicate(timeout=60)
    after = read_state(dev_dir).memory_limits
    json.dump(
        {"cgroup": cgroup, "during": during, "after": after, "rc": proc.returncode, "output": output},
        sys.stdout,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
