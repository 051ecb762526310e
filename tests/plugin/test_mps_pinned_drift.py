"""An MPS daemon's pinned device-memory limit changed behind the plugin is a drift, found and set
again: by MpsDaemons.drift/check over the answers NVIDIA's daemon gives (`10G` for a limit set as
`10240M`, nothing for a UUID that does not resolve), by a prepare of the claim over the simulated
node's daemon (a tenant of a 535 driver can change it through its pipe), and over NVIDIA's real
daemons of both Debian roots, which answer for a device ordinal without a GPU."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import uuid
from pathlib import Path

import pytest

from dra_gpu.plugin.driver_programs import DriverProgram
from dra_gpu.plugin.mps import MpsDaemon, MpsDaemons, MpsError
from plugin.conftest import PluginCore, claim, gpu_names, prepare_claim
from plugin.test_sharing import ask, daemon_of, ref_of, share
from tests.driver_root import debian_root, run_probe_in_private_namespace

PINNED = "get_default_device_pinned_mem_limit GPU-1"


class AnsweringDaemon:
    """A control interface that answers as NVIDIA's daemon does: `set_…` of a pinned limit prints
    nothing, `get_…` prints the value as it was set (or what `answers` says instead)."""

    def __init__(self, answers: dict[str, str]) -> None:
        self.answers = answers
        self.sent: list[str] = []

    def __call__(self, _daemon_id: str, commands: list[str]) -> str:
        self.sent.extend(commands)
        out = []
        for c in commands:
            words = c.split()
            if words[0] == "set_default_device_pinned_mem_limit":
                self.answers[f"get_default_device_pinned_mem_limit {words[1]}"] = words[2]
            elif words[0] == "set_default_active_thread_percentage":
                self.answers["get_default_active_thread_percentage"] = f"{float(words[1]):.1f}"
                out.append(self.answers["get_default_active_thread_percentage"])
            else:
                out.append(self.answers.get(c, ""))
        return "".join(f"{line}\n" for line in out)


def daemons_answering(tmp_path: Path, answers: dict[str, str]) -> tuple[MpsDaemons, AnsweringDaemon]:
    daemons = MpsDaemons(tmp_path, lambda: DriverProgram(None), isolate=False)
    fake = AnsweringDaemon(answers)
    daemons.control = fake  # type: ignore[method-assign]
    return daemons, fake


@pytest.mark.parametrize(
    ("answer", "drifted"),
    [
        ("10240M", False),
        ("10G", False),  # how NVIDIA's daemon answers a limit set as 10240M
        ("5G", True),
        ("10239M", True),
        ("20480M", True),
    ],
)
def test_a_pinned_limit_answered_differently_is_a_drift_whatever_its_unit(
    tmp_path: Path, answer: str, drifted: bool
) -> None:
    daemon = MpsDaemon("claim-0", ["GPU-1"], None, {"GPU-1": "10240M"})
    daemons, _ = daemons_answering(tmp_path, {PINNED: answer})
    want = [f"{PINNED} answered {answer!r}, expected 10240"] if drifted else []
    assert daemons.drift(daemon) == want


def test_a_pinned_limit_changed_behind_the_plugin_is_set_again_and_read_back(tmp_path: Path) -> None:
    daemon = MpsDaemon("claim-0", ["GPU-1", "GPU-2"], 50, {"GPU-1": "10240M", "GPU-2": "2048M"})
    daemons, fake = daemons_answering(
        tmp_path,
        {
            "get_default_active_thread_percentage": "50.0",
            PINNED: "100G",  # a tenant raised it
            "get_default_device_pinned_mem_limit GPU-2": "2G",  # as set, in GiB
        },
    )
    assert daemons.check(daemon) == [f"{PINNED} answered '100G', expected 10240"]
    assert "set_default_device_pinned_mem_limit GPU-1 10240M" in fake.sent
    assert fake.answers[PINNED] == "10240M" and daemons.drift(daemon) == []


def test_a_pinned_limit_that_does_not_resolve_is_no_drift_and_one_that_will_not_stay_fails(
    tmp_path: Path,
) -> None:
    """Without a GPU NVIDIA's daemon answers nothing for a UUID: logged, not a drift. A limit that
    reads back wrong after being set again fails the check, naming the daemon and the command."""
    daemon = MpsDaemon("claim-0", ["GPU-1"], None, {"GPU-1": "10240M"})
    daemons, _ = daemons_answering(tmp_path, {PINNED: ""})
    assert daemons.drift(daemon) == []
    daemons.control = lambda _id, commands: "1G\n"  # type: ignore[method-assign]
    with pytest.raises(MpsError, match=f"MPS daemon claim-0: limits cannot be restored: {PINNED}"):
        daemons.check(daemon)


def test_a_memory_shares_pinned_limit_raised_through_its_pipe_is_set_back_by_the_next_prepare(
    core: PluginCore,
) -> None:
    """The simulated node's daemon (the plugin's own program) takes a limit from any client of
    the container's pipe, as NVIDIA's 535 daemon does; the kubelet's next prepare of the claim
    finds the drift and sets the share's limit again."""
    g0 = gpu_names(core)[0]
    gpu = next(g for g in core.inventory.gpus if g.device_name == g0)
    c = share(claim(str(uuid.uuid4()), [g0]), str(uuid.uuid4()), {"memory": "40Gi", "computeShare": "30"})
    core.add(c)
    asyncio.run(prepare_claim(core.preparer, ref_of(c)))
    pipe, pid = daemon_of(core, c)
    limit = f"get_default_device_pinned_mem_limit {gpu.uuid}"
    ask(core, pipe, f"set_default_device_pinned_mem_limit {gpu.uuid} 80G")
    assert ask(core, pipe, limit) == ["80G"]
    asyncio.run(prepare_claim(core.preparer, ref_of(c)))
    assert ask(core, pipe, limit) == ["40960M"]
    assert daemon_of(core, c)[1] == pid  # set again in the daemon that runs, not restarted


# Runs in a private mount and pid namespace (NVIDIA's code as root makes device nodes where it can):
# start NVIDIA's daemon through MpsDaemons with a pinned limit on device ordinal 0 (a UUID does not
# resolve without a GPU), change it behind the plugin, check; prints what it saw as JSON.
PROBE = r"""
import json, sys
from pathlib import Path
from dra_gpu.plugin.driver_programs import DriverProgram
from dra_gpu.plugin.mps import MpsDaemon, MpsDaemons

root, work = Path(sys.argv[1]), Path(sys.argv[2])
lib = next(root.glob("usr/lib/x86_64-linux-gnu/nvidia/current/libcuda.so.5*"))
program = DriverProgram(root / "usr/bin/nvidia-cuda-mps-control", lib, [root / "usr/bin", root / "usr/sbin"])
daemons = MpsDaemons(work, lambda: program)
daemon = MpsDaemon("claim-0", ["GPU-1"], None, {"0": "10240M"})
daemons.start(daemon)
ask = "get_default_device_pinned_mem_limit 0"
out = {"as set": daemons.control("claim-0", [ask]).split(), "drift as set": daemons.drift(daemon)}
daemons.control("claim-0", ["set_default_device_pinned_mem_limit 0 80G"])
out["changed"] = daemons.control("claim-0", [ask]).split()
out["check"] = daemons.check(daemon)
out["after check"] = daemons.control("claim-0", [ask]).split()
daemons.stop("claim-0")
print(json.dumps(out))
"""


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="needs root and unshare (a private namespace)",
)
@pytest.mark.parametrize("suite", ["bookworm", "trixie"])
def test_nvidias_daemon_pinned_limit_changed_behind_the_plugin_is_found_and_set_again(
    suite: str, tmp_path: Path
) -> None:
    root = debian_root(suite)
    stdout = run_probe_in_private_namespace(PROBE, root, tmp_path)
    seen = json.loads(stdout.strip().splitlines()[-1])
    print(f"\n[mps pinned] {suite}: {json.dumps(seen)}")
    assert seen["drift as set"] == [], seen
    assert seen["changed"] == ["80G"], seen
    assert seen["check"] == ["get_default_device_pinned_mem_limit 0 answered '80G', expected 10240"]
    # NVIDIA's daemon answers a limit of whole GiB in G, however it was set.
    assert seen["as set"] == seen["after check"] == ["10G"], seen
