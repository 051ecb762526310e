"""Hostile-input reliability counts for the table in docs/security.md: per input class, how many inputs were
tried and how many crashed (an exception other than the input's own error type, a traceback, an
HTTP 500, an exit code other than 0/1/2) or hung (past the per-input bound).

Each in-process input runs in a forked child with a time bound, so a hang (a huge exponent in a
quantity, an exponential clique search) is counted instead of stalling the run. Deterministic
(seeded). To measure another checkout (e.g. main before the hardening), point DRA_GPU_CODE at a
directory holding its dra_gpu package:

    .venv/bin/python bench/reliability.py [--per-class 300]
    DRA_GPU_CODE=/tmp/main_code .venv/bin/python bench/reliability.py
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import random
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CODE = os.environ.get("DRA_GPU_CODE", str(ROOT))
sys.path.insert(0, str(ROOT))
sys.path.insert(0, CODE)

import yaml  # noqa: E402

from tests.controller.objects import GPU_CLASS, claim, node_slices  # noqa: E402
from tests.controller.test_hostile_inputs import BAD_PROFILES, HOSTILE, gpu, profile  # noqa: E402
from tests.controller.test_webhook import make_cert  # noqa: E402
from tests.mutation import paths  # noqa: E402

BOUND_S = 3.0  # per in-process input (after the hardening, each takes milliseconds)
SCALARS: list[Any] = [
    None, True, 0, -1, 2**70, 1.5, float("nan"), float("inf"), "", "x", "1e999999999",
    "NaN", "Infinity", "80Gi", "-5Gi", "gpu.dra-gpu.io", [], {}, [None], {"a": None},
]  # fmt: skip


def value(rng: random.Random, depth: int = 0) -> Any:
    r = rng.random()
    if depth > 2 or r < 0.6:
        return copy.deepcopy(rng.choice(SCALARS))
    if r < 0.8:
        return [value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(["a", "spec", "devices", "requests", "name"]): value(rng, depth + 1) for _ in range(2)}


def mutate(base: Any, rng: random.Random) -> Any:
    obj = copy.deepcopy(base)
    for _ in range(rng.randint(1, 3)):
        where = rng.choice(paths(obj))
        if not where:
            return value(rng)
        target = obj
        for key in where[:-1]:
            target = target[key]
        target[where[-1]] = value(rng)
    return obj


def probe(fn: Callable[[Any], None], arg: Any, bound_s: float = BOUND_S) -> str:
    """'ok', 'crash' or 'hang': fn(arg) in a forked child; fn raises only on a crash."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            fn(arg)
        except BaseException:
            code = 3
        os._exit(code)
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return "ok" if os.waitstatus_to_exitcode(status) == 0 else "crash"
        time.sleep(0.002)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return "hang"


def count(results: list[str]) -> tuple[int, int, int]:
    return len(results), results.count("crash"), results.count("hang")


def objects(n: int, rng: random.Random) -> list[str]:
    from dra_gpu.controller.inputs import Inputs
    from dra_gpu.controller.rules import Validator

    slices = node_slices()
    validator = Validator("gpu.dra-gpu.io", slices, [GPU_CLASS])
    template = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
                "metadata": {"name": "t"}, "spec": {"spec": claim("c")["spec"]}}  # fmt: skip
    bases = [
        claim("c", 2, selectors=['device.attributes["gpu.dra-gpu.io"].type == "gpu"']),
        GPU_CLASS,
        template,
    ]

    def check(obj: Any) -> None:
        validator.validate(obj)
        Inputs().add(obj, "doc")

    def check_slice(obj: Any) -> None:
        inputs = Inputs()
        inputs.add(obj, "doc")
        Validator("gpu.dra-gpu.io", inputs.slices, [GPU_CLASS]).validate(claim("c"))

    out = [probe(check, mutate(rng.choice(bases), rng)) for _ in range(n)]
    out += [probe(check_slice, mutate(slices[0], rng)) for _ in range(n // 2)]
    return out


def opaque_configs(n: int, rng: random.Random) -> list[str]:
    from dra_gpu.model.config import ConfigError, decode

    base = {"apiVersion": "gpu.dra-gpu.io/v1alpha1", "kind": "GpuConfig",
            "sharing": {"strategy": "MPS", "mps": {"defaultActiveThreadPercentage": 50,
                                                   "defaultPinnedDeviceMemoryLimit": "10Gi"}}}  # fmt: skip

    def check(p: Any) -> None:
        with contextlib.suppress(ConfigError):
            decode(p)

    return [probe(check, mutate(base, rng)) for _ in range(n)]


def quantities(n: int, rng: random.Random) -> list[str]:
    from dra_gpu.kube.values import parse_quantity

    def check(text: str) -> None:
        """Parse, then what the callers do with a quantity: compare it and convert it to bytes."""
        try:
            q = parse_quantity(text)
        except ValueError:
            return
        if q >= 1:
            int(q.to_integral_value())

    texts = ["1e999999999", "NaN", "Infinity", "-Inf", "1e-999999999", "1E+100000000", "9" * 5000]
    while len(texts) < n:
        mant = rng.choice(["1", "0.5", "-3", ".7", "12345678901234567890", "+2"])
        suffix = rng.choice(
            ["", "Gi", "m", "k", "E", f"e{rng.randint(-(10**9), 10**9)}", f"e{rng.randint(-20, 20)}"]
        )
        texts.append(mant + suffix)
    return [probe(check, t) for t in texts[:n]]


def profiles(n: int, rng: random.Random) -> list[str]:
    from simnode.profiles import ProfileError, parse_profile

    base = yaml.safe_load(profile([gpu(0, nvlinkCount=2, mig={"enabled": False}), gpu(1)]))

    def check(text: str) -> None:
        with contextlib.suppress(ProfileError):
            parse_profile(text, "fuzz.yaml")

    texts = [t for t, _ in BAD_PROFILES.values()]
    texts += [yaml.safe_dump(mutate(base, rng)) for _ in range(n - len(texts))]
    return [probe(check, t) for t in texts]


def cli_files(tmp: Path) -> list[str]:
    """The named hostile files through `dra-gpu validate` / `explain` / `inventory --profile`."""
    from bench.webhook_hostile_bench import doubling_selector

    files = {f"{k}.yaml": t for k, (t, _) in HOSTILE.items()}
    files["costly-cel.yaml"] = yaml.safe_dump_all(
        [*node_slices(), GPU_CLASS, claim("h", selectors=[doubling_selector(26)])]
    )
    fifo = tmp / "fifo"
    os.mkfifo(fifo)
    runs: list[list[str]] = []
    for name, text in files.items():
        (tmp / name).write_text(text)
        runs += [["validate", "-f", str(tmp / name)], ["explain", "-f", str(tmp / name)]]
    for name, (text, _) in BAD_PROFILES.items():
        (tmp / f"p-{name}.yaml").write_text(text)
        runs.append(["inventory", "--profile", str(tmp / f"p-{name}.yaml")])
    for special in ("/dev/zero", str(fifo)):
        runs += [["validate", "-f", special], ["inventory", "--profile", special]]
    out = []
    env = {**os.environ, "PYTHONPATH": CODE}
    for args in runs:
        try:
            p = subprocess.run([sys.executable, "-m", "dra_gpu.cli", *args], capture_output=True, text=True,
                               timeout=30, cwd=tmp, env=env)  # fmt: skip
            out.append("crash" if "Traceback" in p.stderr or p.returncode not in (0, 1, 2) else "ok")
        except subprocess.TimeoutExpired:
            out.append("hang")
    return out


def webhook(n: int, rng: random.Random, tmp: Path) -> list[str]:
    """Mutated AdmissionReviews (and objects inside them) over HTTPS to `dra-gpu controller`."""
    cert, key = make_cert(tmp, "rel")
    (tmp / "cluster.yaml").write_text(yaml.safe_dump_all([*node_slices(), GPU_CLASS]))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": CODE}
    cmd = [sys.executable, "-m", "dra_gpu.cli", "controller", "--cert", str(cert), "--key", str(key)]
    cmd += ["--address", "127.0.0.1", "--port", str(port), "--no-watch", "-f", str(tmp / "cluster.yaml")]
    proc = subprocess.Popen(cmd, cwd=tmp, env=env, stderr=subprocess.DEVNULL)
    ctx = ssl.create_default_context(cafile=str(cert))

    def post(body: bytes, timeout: float) -> int:
        req = urllib.request.Request(f"https://127.0.0.1:{port}/validate", data=body,
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        try:
            with urllib.request.urlopen(req, context=ctx, timeout=timeout) as resp:
                return int(resp.status)
        except urllib.error.HTTPError as exc:
            return int(exc.code)

    out = []
    try:
        for _ in range(60):
            try:
                post(b"{}", 2)
                break
            except OSError:
                time.sleep(0.5)
        base = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                "request": {"uid": "u", "kind": {"group": "resource.k8s.io", "version": "v1",
                                                 "kind": "ResourceClaim"},
                            "operation": "CREATE", "object": claim("c", 2)}}  # fmt: skip
        for _ in range(n):
            review = mutate(base, rng)
            try:
                body = json.dumps(review).encode()
            except ValueError:
                continue
            try:
                status = post(body, 10.0)
                out.append("crash" if status >= 500 else "ok")
            except (TimeoutError, OSError):
                out.append("hang")
    finally:
        proc.terminate()
        proc.wait(10)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--per-class", type=int, default=300)
    ap.add_argument("--seed", type=int, default=13)
    ap.add_argument("--only", help="run only the classes whose name contains this")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    n = args.per_class
    classes: dict[str, Callable[[], list[str]]] = {
        "DeviceClass / ResourceClaim / template / ResourceSlice (mutated fields)": lambda: objects(
            n, random.Random(args.seed)
        ),
        "opaque configs (mutated fields)": lambda: opaque_configs(n, random.Random(args.seed)),
        "quantities (huge exponents, NaN, Infinity, random), parsed and used": lambda: quantities(
            n, random.Random(args.seed)
        ),
        "node profiles (mutated fields + named hostile cases)": lambda: profiles(n, random.Random(args.seed)),
        "CLI: named hostile files (validate, explain, inventory --profile)": lambda: cli_files(tmp),
        "webhook: mutated AdmissionReviews over HTTPS": lambda: webhook(n, random.Random(args.seed), tmp),
    }
    print(f"code: {CODE}")
    print(f"{'input class':72} {'tried':>6} {'crashes':>8} {'hangs':>6}")
    for name, run_class in classes.items():
        if args.only and args.only not in name:
            continue
        tried, crashes, hangs = count(run_class())
        print(f"{name:72} {tried:6} {crashes:8} {hangs:6}", flush=True)


if __name__ == "__main__":
    main()
