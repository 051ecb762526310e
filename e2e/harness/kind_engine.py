"""A private Docker daemon for the kind path: started for one run, stopped and wiped after it.

`up` installs Debian's docker.io if needed and starts `dockerd` with its own data root, exec
root, socket and pid file (under $DRA_GPU_KIND_STATE, default /var/lib/dra-gpu-kind) and
e2e/kind/runtime.py as its default runtime (runc without the capabilities this machine's bounding
set lacks, so that kind's privileged node containers start). It never touches iptables
(`iptables`, `ip-masq`, `ip-forward` off): containers reach each other on the bridge and the host
reaches published ports through docker-proxy. `down` removes every container and network, stops
the daemon (its managed containerd with it), deletes the bridges it made, checks that no DOCKER
iptables chain exists (removing any), and unmounts what it mounted. Images stay in the data root
(the node image is cached there), unless `down --wipe`.

    python3 -m harness.kind_engine up|down [--wipe]|env      (from e2e/)
"""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

from tenacity import retry, retry_if_result, stop_after_delay, wait_exponential

from .cleanup import unmount_under

E2E_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNTIME = os.path.join(E2E_DIR, "kind", "runtime.py")
STATE = os.path.abspath(os.environ.get("DRA_GPU_KIND_STATE", "/var/lib/dra-gpu-kind"))
DATA_ROOT = os.path.join(STATE, "docker")
# A short exec root: containerd's sockets under it must fit in sun_path (108 bytes).
EXEC_ROOT = os.environ.get("DRA_GPU_KIND_EXEC_ROOT", "/run/dra-gpu-kind")
SOCK = os.path.join(EXEC_ROOT, "docker.sock")
PIDFILE = os.path.join(EXEC_ROOT, "dockerd.pid")
LOG = os.path.join(STATE, "dockerd.log")
CONFIG = os.path.join(STATE, "daemon.json")
BRIDGES_FILE = os.path.join(STATE, "bridges-before.json")
RUNTIME_NAME = "dra-gpu-runc"
DOCKER_HOST = "unix://" + SOCK
TIMEOUT = float(os.environ.get("DRA_GPU_KIND_TIMEOUT", "60"))


def say(msg: str) -> None:
    print("[kind-engine] " + msg, file=sys.stderr, flush=True)


def env() -> dict[str, str]:
    """The environment for `docker` and `kind` to use this daemon."""
    return dict(os.environ, DOCKER_HOST=DOCKER_HOST)


def docker(*args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["docker", *args], env=env(), check=check, capture_output=True, text=True, timeout=timeout
    )


def install() -> None:
    """Debian's docker.io (dockerd 20.10 and its containerd); the package's own service is not used."""
    if shutil.which("dockerd"):
        return
    say("apt-get install docker.io")
    apt_env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    cmd = ["apt-get", "install", "-y", "--no-install-recommends", "docker.io"]
    # The package's own docker.service must not start (it would add docker0 and iptables chains
    # for good): a policy-rc.d that denies every start, only for the install, unless one exists.
    policy = "/usr/sbin/policy-rc.d"
    ours = not os.path.exists(policy)
    if ours:
        with open(policy, "w") as f:
            f.write("#!/bin/sh\nexit 101\n")
        os.chmod(policy, 0o755)
    try:
        if subprocess.run(cmd, env=apt_env, capture_output=True).returncode != 0:
            subprocess.run(["apt-get", "update"], env=apt_env, capture_output=True, check=True)
            subprocess.run(cmd, env=apt_env, capture_output=True, check=True)
    finally:
        if ours:
            os.unlink(policy)


def bridges() -> list[str]:
    return sorted(os.listdir("/sys/class/net")) if os.path.isdir("/sys/class/net") else []


def daemon_pid() -> int | None:
    """dockerd's pid from its pid file, only while that pid is still our dockerd."""
    try:
        with open(PIDFILE) as f:
            pid = int(f.read().strip())
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except (OSError, ValueError):
        return None
    return pid if argv and argv[0].endswith(b"dockerd") and CONFIG.encode() in argv else None


def _config() -> dict[str, object]:
    return {
        "data-root": DATA_ROOT,
        "exec-root": EXEC_ROOT,
        "pidfile": PIDFILE,
        "hosts": [DOCKER_HOST],
        "storage-driver": "overlay2",
        "runtimes": {RUNTIME_NAME: {"path": RUNTIME}},
        "default-runtime": RUNTIME_NAME,
        # Leave the host's firewall and forwarding alone (other e2e tiers share this machine).
        "iptables": False,
        "ip6tables": False,
        "ip-masq": False,
        "ip-forward": False,
        "log-driver": "json-file",
        "log-opts": {"max-size": "10m"},
    }


@retry(
    retry=retry_if_result(lambda ok: not ok),
    wait=wait_exponential(multiplier=0.2, max=2),
    stop=stop_after_delay(TIMEOUT),
    retry_error_callback=lambda state: False,
)
def _answers() -> bool:
    if daemon_pid() is None and os.path.exists(PIDFILE):
        return False
    return docker("version", "--format", "{{.Server.Version}}", check=False, timeout=10).returncode == 0


def up() -> None:
    install()
    if daemon_pid() is not None and _answers():
        say(f"dockerd already running on {DOCKER_HOST}")
        return
    os.makedirs(DATA_ROOT, exist_ok=True)
    os.makedirs(EXEC_ROOT, exist_ok=True)
    with open(CONFIG, "w") as f:
        json.dump(_config(), f, indent=2)
    with open(BRIDGES_FILE, "w") as f:
        json.dump(bridges(), f)
    os.chmod(RUNTIME, 0o755)
    # PATH: the runtime execs runc; dockerd finds its containerd and docker-proxy there.
    with open(LOG, "ab") as log:
        proc = subprocess.Popen(
            ["dockerd", "--config-file", CONFIG],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    t0 = time.monotonic()
    if not _answers():
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        with open(LOG, errors="replace") as f:
            tail = f.read()[-3000:]
        raise RuntimeError(
            f"dockerd did not answer on {DOCKER_HOST} within {TIMEOUT:.0f} s; its log:\n{tail}"
        )
    version = docker("version", "--format", "{{.Server.Version}}").stdout.strip()
    say(f"dockerd {version} on {DOCKER_HOST} (pid {proc.pid}) in {time.monotonic() - t0:.1f} s")


def _stop_daemon() -> None:
    pid = daemon_pid()
    if pid is None:
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline and os.path.exists(f"/proc/{pid}"):
        time.sleep(0.2)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
    if os.path.exists(f"/proc/{pid}"):
        say(f"dockerd {pid} did not stop in {TIMEOUT:.0f} s: SIGKILL")
        os.kill(pid, signal.SIGKILL)


# The daemon's helpers; matched by program too, so that a shell whose argv names the socket is not.
OUR_PROGRAMS = {b"dockerd", b"containerd", b"containerd-shim", b"containerd-shim-runc-v2", b"docker-proxy"}


def _our_processes() -> list[int]:
    """The daemon's processes: argv names our exec root or data root (containerd, shims, docker-proxy)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        prog = os.path.basename(cmd.split(b"\0")[0])
        if prog in OUR_PROGRAMS and (EXEC_ROOT.encode() in cmd or DATA_ROOT.encode() in cmd):
            out.append(int(d))
    return out


def _docker_chains() -> list[tuple[str, str, str]]:
    """(iptables binary, table, chain) of every DOCKER* chain on the host."""
    found = []
    for binary in ("iptables", "ip6tables"):
        if not shutil.which(binary):
            continue
        for table in ("filter", "nat"):
            out = subprocess.run([binary, "-t", table, "-S"], capture_output=True, text=True).stdout
            for line in out.splitlines():
                parts = line.split()
                if len(parts) >= 2 and parts[0] == "-N" and parts[1].startswith("DOCKER"):
                    found.append((binary, table, parts[1]))
    return found


def _remove_docker_chains() -> None:
    chains = _docker_chains()
    for binary, table, _ in {(b, t, "") for b, t, _ in chains}:
        rules = subprocess.run([binary, "-t", table, "-S"], capture_output=True, text=True).stdout
        for line in rules.splitlines():
            if line.startswith("-A ") and "DOCKER" in line:
                subprocess.run([binary, "-t", table, "-D", *line.split()[1:]], capture_output=True)
    for binary, table, chain in chains:
        subprocess.run([binary, "-t", table, "-F", chain], capture_output=True)
    for binary, table, chain in chains:
        subprocess.run([binary, "-t", table, "-X", chain], capture_output=True)


def down(wipe: bool = False) -> list[str]:
    """Stop everything; returns what is left (empty when clean)."""
    if daemon_pid() is not None:
        ids = docker("ps", "-aq", check=False, timeout=60).stdout.split()
        if ids:
            docker("rm", "-f", "-v", *ids, check=False, timeout=300)
        docker("network", "prune", "-f", check=False, timeout=60)
    _stop_daemon()
    for pid in _our_processes():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    before: list[str] = []
    with contextlib.suppress(OSError, ValueError), open(BRIDGES_FILE) as f:
        before = json.load(f)
    for link in bridges():
        if link not in before and (link == "docker0" or link.startswith(("br-", "veth"))):
            subprocess.run(["ip", "link", "delete", link], capture_output=True)
    _remove_docker_chains()
    still_mounted = unmount_under(EXEC_ROOT, DATA_ROOT)
    if wipe and not still_mounted:
        shutil.rmtree(STATE, ignore_errors=True)
    shutil.rmtree(EXEC_ROOT, ignore_errors=True)
    left = [f"mounted: {m}" for m in still_mounted]
    left += [f"process: {p}" for p in _our_processes()]
    left += [
        f"link: {link}" for link in bridges() if link not in before and link.startswith(("docker0", "br-"))
    ]
    left += [f"iptables: {b} -t {t} {c}" for b, t, c in _docker_chains()]
    return left


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("up", "down", "env"):
        print(__doc__, file=sys.stderr)
        return 2
    if argv[0] == "up":
        up()
    elif argv[0] == "down":
        left = down(wipe="--wipe" in argv)
        for item in left:
            say("left: " + item)
        return 1 if left else 0
    else:
        print(f"export DOCKER_HOST={DOCKER_HOST}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
