"""A plugin killed (SIGKILL) at a random moment of prepare and unprepare: after the restart's
reconciliation every CDI spec belongs to a completed record and every completed record has its
spec, the CDI and plugin directories hold nothing else (the temp file of a write the kill
interrupted is removed at the start), no device is held twice, and every claim can be prepared
and unprepared again.

Each kill comes after a random delay, up to 1.5 ms after the next write began (its temp file
appeared; the child pauses 2 ms before each rename, as a slow disk would, since a write that is
not fsynced is over in microseconds): most kills must interrupt a write, which the temp files
found after the kill show."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from dra_gpu.plugin.checkpoint import COMPLETED
from plugin.conftest import (
    ClaimStore,
    PluginCore,
    assert_only_live_files,
    claim,
    gpu_names,
    kill_in_a_write,
    make_core,
    mig_names,
    prepare_claim,
    temp_files,
)
from plugin.test_prepare import ref_of

TESTS = Path(__file__).resolve().parents[1]

# The plugin's prepare/unprepare loop in a process of its own, over the test's directories.
CHILD = textwrap.dedent(
    """
    import asyncio, json, sys
    from pathlib import Path
    from plugin.conftest import ClaimStore, make_core, prepare_claim, slow_renames
    from simnode.fake import discover_node
    from dra_gpu.kubeletplugin.driver import ClaimRef

    root, driver_root, claims = Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3])
    store = ClaimStore()
    for c in claims:
        store[(c["metadata"]["namespace"], c["metadata"]["name"])] = c
    core = make_core(root, discover_node("node-a", "dgx-a100-mig"), store, driver_root)
    core.preparer.reconcile()
    slow_renames()  # a window for the kills to land in (the writes are not fsynced)
    refs = [ClaimRef(c["metadata"]["namespace"], c["metadata"]["uid"], c["metadata"]["name"]) for c in claims]

    async def main():
        print("ready", flush=True)
        while True:
            await asyncio.gather(*(prepare_claim(core.preparer, r) for r in refs))
            await asyncio.gather(*(core.preparer.unprepare(r) for r in refs[::2]))
            await asyncio.gather(*(prepare_claim(core.preparer, r) for r in refs[::2]))
            await asyncio.gather(*(core.preparer.unprepare(r) for r in refs))

    asyncio.run(main())
    """
)


def check_consistent(core: PluginCore) -> None:
    records = core.checkpoint.records()
    assert {r.state for r in records} <= {COMPLETED}
    assert set(core.cdi.owned()) == {r.uid for r in records}
    edits = core.preparer.driver_files.edits()
    for r in records:
        assert r.cdi_spec is not None
        assert core.cdi.read(r.uid) == core.cdi.compose(r.cdi_spec, edits)
    held = [d for r in records for d in r.device_names]
    assert len(held) == len(set(held))


def test_sigkill_at_any_point_leaves_a_consistent_node(core: PluginCore) -> None:
    devices = gpu_names(core)[:2] + mig_names(core)[:6]
    claims = [claim(f"{i:08d}-0000-4000-8000-000000000000", [d]) for i, d in enumerate(devices)]
    rng = random.Random(7)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)])}
    directories = (core.cdi.dir, core.checkpoint.path.parent)
    kills = 12
    in_a_write = []  # per kill: the temp files it left (a write it interrupted)
    for _ in range(kills):
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(core.root), str(core.driver_root), json.dumps(claims)],
            stdout=subprocess.PIPE,
            env=env,
        )
        try:
            assert child.stdout is not None and child.stdout.readline() == b"ready\n"
            time.sleep(rng.uniform(0.01, 0.25))
            kill_in_a_write(child.pid, directories, delay=rng.uniform(0, 0.0015))  # into the pause
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(10)
        assert child.returncode == -signal.SIGKILL, "the plugin died before it was killed"
        left = temp_files(*directories)
        in_a_write.append(left)
        restarted = make_core(core.root, core.inventory, ClaimStore(), core.driver_root)
        counts = restarted.preparer.reconcile()
        assert counts.get("tempsRemoved", 0) == len(left), counts
        check_consistent(restarted)
        assert_only_live_files(restarted)
    interrupted = sum(1 for left in in_a_write if left)
    print(
        f"\n{interrupted} of {kills} kills interrupted a write: {[[p.name for p in t] for t in in_a_write]}"
    )
    assert interrupted > kills // 2, f"only {interrupted} of {kills} kills interrupted a write"
    store = ClaimStore()
    for c in claims:
        store[(c["metadata"]["namespace"], c["metadata"]["name"])] = c
    last = make_core(core.root, core.inventory, store, core.driver_root)
    last.preparer.reconcile()

    async def round_trip() -> None:
        await asyncio.gather(*(prepare_claim(last.preparer, ref_of(c)) for c in claims))
        check_consistent(last)
        await asyncio.gather(*(last.preparer.unprepare(ref_of(c)) for c in claims))

    asyncio.run(round_trip())
    assert last.checkpoint.records() == [] and last.cdi.owned() == {}
    assert_only_live_files(last)
