"""e2e/kind/runtime.py, the OCI runtime of the kind tier's Docker daemon, run as dockerd runs it:
with runc's arguments, in front of a stand-in runc that records the spec it was given."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

RUNTIME = Path(__file__).resolve().parents[1] / "e2e" / "kind" / "runtime.py"
# Linux capability numbers 0..40 (include/uapi/linux/capability.h).
ALL_CAPS = ["CAP_" + n for n in [
    "CHOWN", "DAC_OVERRIDE", "DAC_READ_SEARCH", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID",
    "SETPCAP", "LINUX_IMMUTABLE", "NET_BIND_SERVICE", "NET_BROADCAST", "NET_ADMIN", "NET_RAW",
    "IPC_LOCK", "IPC_OWNER", "SYS_MODULE", "SYS_RAWIO", "SYS_CHROOT", "SYS_PTRACE", "SYS_PACCT",
    "SYS_ADMIN", "SYS_BOOT", "SYS_NICE", "SYS_RESOURCE", "SYS_TIME", "SYS_TTY_CONFIG", "MKNOD",
    "LEASE", "AUDIT_WRITE", "AUDIT_CONTROL", "SETFCAP", "MAC_OVERRIDE", "MAC_ADMIN", "SYSLOG",
    "WAKE_ALARM", "BLOCK_SUSPEND", "AUDIT_READ", "PERFMON", "BPF", "CHECKPOINT_RESTORE",
]]  # fmt: skip


def bounding_set() -> set[str]:
    line = next(ln for ln in Path("/proc/self/status").read_text().splitlines() if ln.startswith("CapBnd:"))
    bits = int(line.split()[1], 16)
    return {c for i, c in enumerate(ALL_CAPS) if bits >> i & 1}


def make_runc(d: Path) -> Path:
    """A runc that writes its argv and the spec or process file it would run into record.json."""
    script = d / "runc"
    script.write_text(
        f"#!{sys.executable}\n"
        "import json, sys\n"
        "args = sys.argv[1:]\n"
        "spec = None\n"
        "for flag, name in (('--bundle', '/config.json'), ('--process', '')):\n"
        "    if flag in args:\n"
        "        spec = json.load(open(args[args.index(flag) + 1] + name))\n"
        f"json.dump({{'args': args, 'spec': spec}}, open({str(d / 'record.json')!r}, 'w'))\n"
    )
    script.chmod(0o755)
    return script


@pytest.fixture
def fake_runc(tmp_path: Path) -> Path:
    return make_runc(tmp_path)


def run_runtime(args: list[str], runc: Path) -> dict:
    env = dict(os.environ, DRA_GPU_RUNC=str(runc))
    subprocess.run([sys.executable, str(RUNTIME), *args], check=True, env=env)
    return json.loads((runc.parent / "record.json").read_text())


caps_lists = st.lists(st.sampled_from(ALL_CAPS), unique=True)


@settings(max_examples=20, deadline=None)
@given(caps=st.fixed_dictionaries({k: caps_lists for k in ("bounding", "effective", "permitted")}))
def test_create_keeps_only_the_capabilities_this_machine_can_grant(tmp_path_factory, caps):
    tmp = tmp_path_factory.mktemp("bundle")
    script = make_runc(tmp)
    bundle = tmp / "b"
    bundle.mkdir()
    spec = {"process": {"args": ["sh"], "capabilities": caps}, "root": {"path": "rootfs"}}
    (bundle / "config.json").write_text(json.dumps(spec))
    args = ["--root", "/run/x", "--log", "l", "create", "--bundle", str(bundle), "--pid-file", "p", "id1"]
    got = run_runtime(args, script)
    allowed = bounding_set()
    # runc gets the same arguments; the spec loses exactly what the bounding set lacks, in order.
    assert got["args"] == args
    for kind, names in caps.items():
        assert got["spec"]["process"]["capabilities"][kind] == [n for n in names if n in allowed]
    assert got["spec"]["root"] == spec["root"]


def test_exec_process_file_is_stripped_too(tmp_path, fake_runc):
    process = tmp_path / "process.json"
    caps = {"bounding": ALL_CAPS, "effective": ALL_CAPS}
    process.write_text(json.dumps({"args": ["sh"], "capabilities": caps}))
    got = run_runtime(["exec", "--process", str(process), "--detach", "id1"], fake_runc)
    allowed = bounding_set()
    assert got["spec"]["capabilities"]["bounding"] == [c for c in ALL_CAPS if c in allowed]


def test_other_commands_pass_through(tmp_path, fake_runc):
    got = run_runtime(["--root", "/run/x", "state", "id1"], fake_runc)
    assert got == {"args": ["--root", "/run/x", "state", "id1"], "spec": None}
