"""The plugin's MpsDaemons with NVIDIA's real control daemons of both Debian roots (535.261.03 writes
no pid file, 550.163.01 does), without a cluster: run as root in a private mount and pid namespace
whose /dev is a tmpfs (NVIDIA's code, run as root, makes device nodes where it can: never in the
host's /dev). The e2e (e2e/tests/test_real_mps.py) runs the same daemons under the chart's DaemonSet.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.driver_root import debian_root, run_probe_in_private_namespace

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="needs root and unshare (a private namespace)",
)

SUITES = {"bookworm": "535.261.03", "trixie": "550.163.01"}

# Runs in the namespace: start a daemon through MpsDaemons, look at it, change a limit behind the
# plugin's back, check, stop; prints what it saw as JSON.
PROBE = r"""
import ctypes, json, os, subprocess, sys, time
from pathlib import Path
from dra_gpu.plugin.driver_programs import DriverProgram
from dra_gpu.plugin.mps import MpsDaemon, MpsDaemons

root, work = Path(sys.argv[1]), Path(sys.argv[2])
lib = next(root.glob("usr/lib/x86_64-linux-gnu/nvidia/current/libcuda.so.5*"))
program = DriverProgram(root / "usr/bin/nvidia-cuda-mps-control", lib, [root / "usr/bin", root / "usr/sbin"])
daemons = MpsDaemons(work, lambda: program, shm_size=96 << 20)
daemon = MpsDaemon("claim-0", ["GPU-1"], 25, {"GPU-1": "10240M"})
out = {"isolate": daemons.isolate, "pid": int(daemons.start(daemon).removeprefix("pid="))}
out["processes"] = daemons.processes("claim-0")
out["client"] = sorted(os.listdir(daemons.client_dir("claim-0")))
out["pipe"] = sorted(os.listdir(daemons.pipe_dir("claim-0")))
out["mount"] = [l.split()[3] for l in open("/proc/self/mounts") if l.split()[1] == str(work / "claim-0")]
cuinit = "import ctypes, sys; print(ctypes.CDLL(sys.argv[1]).cuInit(0))"
for name, pipe in (("cuInit via client", daemons.client_dir("claim-0")), ("cuInit no daemon", work)):
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(pipe), "PATH": "/usr/bin:/bin"}
    out[name] = subprocess.run([sys.executable, "-c", cuinit, str(lib)], env=env, capture_output=True,
                               text=True, timeout=30).stdout.strip()
out["drift"] = daemons.drift(daemon)
# A tenant's open control session (an interactive client through the client view): NVIDIA's daemon
# serves one control client at a time, so the plugin's question goes unanswered while it runs.
env = {"CUDA_MPS_PIPE_DIRECTORY": str(daemons.client_dir("claim-0")), "PATH": "/usr/bin:/bin"}
holder = subprocess.Popen([str(program.binary)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          env={**program.env("/usr/bin:/bin"), **env}, text=True)
holder.stdin.write("get_default_active_thread_percentage\n"); holder.stdin.flush()
time.sleep(1.0)  # connected and answered (its output waits in its buffer until it ends)
daemons.command_timeout = 2.0
out["held"] = {"answers": daemons.answers("claim-0"), "alive": daemons.alive("claim-0")}
holder.stdin.close(); holder.wait(timeout=10)
daemons.command_timeout = 5.0
out["released"] = {"answers": daemons.answers("claim-0"), "alive": daemons.alive("claim-0")}
daemons.control("claim-0", ["set_default_active_thread_percentage 90"])
out["check"] = daemons.check(daemon)
out["answers"] = daemons.control("claim-0", ["get_default_active_thread_percentage"]).split()
daemons.stop("claim-0")
out["after stop"] = {
    "processes": daemons.processes("claim-0"),
    "directory": (work / "claim-0").exists(),
    "mounts": [l for l in open("/proc/self/mounts") if str(work) in l],
}
print(json.dumps(out))
"""


@pytest.mark.parametrize("suite", sorted(SUITES))
def test_nvidias_daemon_started_checked_and_stopped_with_or_without_a_pid_file(
    suite: str, tmp_path: Path
) -> None:
    root = debian_root(suite)
    stdout = run_probe_in_private_namespace(PROBE, root, tmp_path)
    seen = json.loads(stdout.strip().splitlines()[-1])
    print(f"\n[mps] NVIDIA {SUITES[suite]}: {json.dumps(seen)}")
    assert seen["isolate"] is True
    assert seen["processes"] == [[seen["pid"], "nvidia-cuda-mps-control"]]
    assert seen["client"] == ["control"]  # not control_privileged, the pid file or the log FIFO
    assert "control_privileged" in seen["pipe"]
    assert ("nvidia-cuda-mps-control.pid" in seen["pipe"]) == (suite == "trixie")  # found without it on 535
    (options,) = seen["mount"]
    assert "size=98304k" in options and "nr_inodes=24576" in options, options  # shm_size, a page each
    # NVIDIA's libcuda reaches the daemon through the client view (805: its server finds no GPU).
    assert seen["cuInit via client"] == "805" and seen["cuInit no daemon"] == "100", seen
    assert seen["drift"] == []
    # While a tenant holds the control session the daemon runs but does not answer (the plugin keeps
    # it, Sharing.ensure); answering again once the session ends.
    assert seen["held"] == {"answers": False, "alive": True}, seen
    assert seen["released"] == {"answers": True, "alive": True}, seen
    assert seen["check"] == ["get_default_active_thread_percentage answered '90.0', expected 25"]
    assert seen["answers"] == ["25.0"]
    assert seen["after stop"] == {"processes": [], "directory": False, "mounts": []}
    assert not list(Path("/dev").glob("nvidia*"))  # nothing reached the host's /dev
