"""The program of an MPS daemon's pod: NVIDIA's control daemon in the foreground, ended cleanly.

    python -m dra_gpu.plugin.mps_supervisor PIPE_DIR PRELOAD BINARY [ARG...]

Runs `BINARY ARG...` (`nvidia-cuda-mps-control -f`: its log goes to the pod's log) with
`PRELOAD` (may be empty) as its `LD_PRELOAD`, only in the child's environment, so this Python
process never loads the driver's library, and exits with the daemon's status. It stays to do two
things the daemon does not:

- SIGTERM (the pod deleted, the node drained): the daemon dies of SIGTERM at once, leaving its
  servers and sockets; here it is sent `quit` through its own pipe first, and killed only if it
  has not ended within QUIT_TIMEOUT.
- The daemon's directory gone: only its plugin removes it, at the claim's unprepare. A plugin of a
  release that ran the daemons itself (0.1.0, after a rollback) removes the directory without
  deleting this pod; the daemon then has no claim, and is ended the same way.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from types import FrameType

CHECK_INTERVAL = 2.0  # seconds between looks at the daemon's directory
QUIT_TIMEOUT = 5.0  # seconds a quit may take before the daemon is killed


def _quit(binary: str, env: dict[str, str], daemon: subprocess.Popen[bytes], pipe: str) -> None:
    if os.path.isdir(pipe):
        try:
            subprocess.run([binary], input=b"quit\n", env=env, timeout=QUIT_TIMEOUT, capture_output=True)
        except (OSError, subprocess.TimeoutExpired) as exc:
            print(f"mps_supervisor: quit not sent: {exc}", file=sys.stderr, flush=True)
    else:  # no pipe to send it through: SIGTERM ends it (its sockets went with the directory)
        daemon.terminate()
    try:
        daemon.wait(QUIT_TIMEOUT)
    except subprocess.TimeoutExpired:
        print("mps_supervisor: the daemon did not quit, killing it", file=sys.stderr, flush=True)
        daemon.kill()
        daemon.wait()


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        raise SystemExit("usage: python -m dra_gpu.plugin.mps_supervisor PIPE_DIR PRELOAD BINARY [ARG...]")
    pipe, preload, binary, *args = argv
    env = dict(os.environ)
    if preload:
        env["LD_PRELOAD"] = preload
    daemon = subprocess.Popen([binary, *args], env=env)
    stopping = False

    def on_term(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    while True:
        try:
            return daemon.wait(CHECK_INTERVAL)
        except subprocess.TimeoutExpired:
            pass
        if stopping:
            print("mps_supervisor: terminated, asking the daemon to quit", file=sys.stderr, flush=True)
        elif not os.path.isdir(pipe):
            print(
                f"mps_supervisor: {pipe} is gone (the claim was unprepared), asking the daemon to quit",
                file=sys.stderr,
                flush=True,
            )
        else:
            continue
        started = time.monotonic()
        _quit(binary, env, daemon, pipe)
        print(f"mps_supervisor: the daemon ended in {time.monotonic() - started:.1f} s", flush=True)
        return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
