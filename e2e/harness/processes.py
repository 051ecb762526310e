"""Host processes by pid: start one with its log, wait for it to be ready, stop it.

A component's pid file holds its pid and program path, so that a recycled pid is never taken
for it. Also the small shared helpers: messages, files, `kubectl` and `ctr`.
"""

import contextlib
import os
import signal
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from typing import Any

from .config import ADMIN_KUBECONFIG, BIN_CTRD, BIN_K8S, CTRD_SOCK, LOGS, ORDER, PIDS, PKI, STATE, TIMEOUT


class Fail(Exception):
    """A failure `e2e/cluster` reports in one line (exit status 1)."""


def say(msg: str) -> None:
    print("[cluster] " + msg, file=sys.stderr, flush=True)


def run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[Any]:
    kw.setdefault("check", True)
    return subprocess.run(cmd, **kw)


def kubectl(*args: str, check: bool = True, capture: bool = True) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, KUBECONFIG=ADMIN_KUBECONFIG)
    return subprocess.run(
        [os.path.join(BIN_K8S, "kubectl"), *args], env=env, check=check, capture_output=capture, text=True
    )


def ctr(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [os.path.join(BIN_CTRD, "ctr"), "--address", CTRD_SOCK, *args],
        check=check,
        capture_output=True,
        text=True,
    )


def write(path: str, content: str, mode: int = 0o644) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(content)
    os.chmod(path, mode)


def pidfile(name: str) -> str:
    return os.path.join(PIDS, name + ".pid")


def logfile(name: str) -> str:
    return os.path.join(LOGS, name + ".log")


def is_zombie(pid: int) -> bool:
    """True for a zombie, and for a pid that is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def read_pid(name: str) -> int | None:
    """The pid of a component we started, if it still runs that program."""
    try:
        with open(pidfile(name)) as f:
            pid_text, exe = f.read().split("\n")[:2]
        pid = int(pid_text)
        if is_zombie(pid):
            return None
        return pid if os.readlink(f"/proc/{pid}/exe") == os.path.realpath(exe) else None
    except (OSError, ValueError):
        return None


def running() -> dict[str, int | None]:
    """Each component (and the peer driver) with its pid, or None when it does not run."""
    return {n: read_pid(n) for n in [*ORDER, "peer-driver"]}


def start(name: str, argv: list[str], env: dict[str, str] | None = None) -> int:
    """Start `argv` in a session of its own, appending to the component's log; returns the pid."""
    os.makedirs(LOGS, exist_ok=True)
    os.makedirs(PIDS, exist_ok=True)
    e = dict(os.environ)
    e["PATH"] = BIN_CTRD + ":" + e.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
    e.update(env or {})
    with open(logfile(name), "ab") as log:
        log.write(f"\n==== {time.strftime('%F %T')} starting {' '.join(argv)}\n".encode())
        log.flush()
        p = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=e,
            start_new_session=True,
            cwd=STATE,
        )
    write(pidfile(name), f"{p.pid}\n{argv[0]}\n")
    return p.pid


def stop_pid(name: str, pid: int, timeout: float = 15.0) -> None:
    """SIGTERM, then SIGKILL after `timeout` seconds."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    t0 = time.time()
    while time.time() - t0 < timeout:
        if not os.path.exists(f"/proc/{pid}") or is_zombie(pid):
            return
        time.sleep(0.1)
    say(f"{name} (pid {pid}) did not stop in {timeout:.0f} s: SIGKILL")
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def log_tail(name: str, n: int = 40) -> str:
    try:
        with open(logfile(name), "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 16384))
            lines = f.read().decode(errors="replace").splitlines()[-n:]
        return "\n".join(lines)
    except OSError:
        return "(no log)"


def wait_for(name: str, check: Callable[[], bool], timeout: float = TIMEOUT, what: str = "ready") -> None:
    """Poll `check` until it is true; fail when the component exits or after `timeout` seconds."""
    t0 = time.time()
    last = None
    while time.time() - t0 < timeout:
        if read_pid(name) is None:
            raise Fail(f"{name} exited while waiting for it to be {what}")
        try:
            if check():
                return
        except Exception as e:  # any error means "not yet"
            last = e
        time.sleep(0.25)
    raise Fail(f"{name} not {what} after {timeout:.0f} s (last error: {last})")


def https_ok(url: str, client: str | None = None) -> bool:
    """GET `url` over TLS with our CA (and the client certificate `client` of PKI, if given)."""
    ctx = ssl.create_default_context(cafile=os.path.join(PKI, "ca.crt"))
    if client:
        ctx.load_cert_chain(os.path.join(PKI, client + ".crt"), os.path.join(PKI, client + ".key"))
    else:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    with urllib.request.urlopen(url, context=ctx, timeout=3) as r:
        return bool(r.status == 200)


def http_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=3) as r:
        return bool(r.status == 200)
