"""doctor's MPS check (dra_gpu.doctor.mps_daemons) against the plugin's real daemons (the simulated
driver's control program): OK while each claim's daemon runs with its limits; a FAIL that names
the claim or the daemon when a limit was changed, a daemon died, or a daemon no claim records runs."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

from dra_gpu.doctor.mps_daemons import check
from dra_gpu.doctor.node_checks import _checkpoint_claims
from plugin.conftest import PluginCore, claim, gpu_names, prepare_claim
from plugin.test_sharing import alive, ask, daemon_of, mps_config, pytestmark, ref_of, uid  # noqa: F401


def doctor(core: PluginCore) -> tuple[str, str]:
    assert core.preparer.sharing is not None
    r = check(_checkpoint_claims(core.checkpoint.path) or {}, core.preparer.sharing.mps)
    return r.status.value, r.detail


def test_doctor_names_changed_limits_a_dead_daemon_and_an_orphan(core: PluginCore) -> None:
    assert doctor(core) == ("OK", "no claim needs an MPS daemon; none running")
    c = claim(uid(), gpu_names(core)[:1], config=mps_config(30, None))
    core.add(c)
    asyncio.run(prepare_claim(core.preparer, ref_of(c)))
    client, pid = daemon_of(core, c)
    daemon_id = Path(client).parent.name
    status, detail = doctor(core)
    assert status == "OK" and "1 MPS daemons" in detail, detail

    ask(core, client, "set_default_active_thread_percentage 90")
    status, detail = doctor(core)
    assert (
        status == "FAIL"
        and f"daemon {daemon_id}: get_default_active_thread_percentage answered '90.0'" in detail
    )
    ask(core, client, "set_default_active_thread_percentage 30")

    os.kill(pid, signal.SIGKILL)
    # The signal is delivered asynchronously: until the process is gone (or a zombie) it is still
    # a running daemon that no longer answers, which doctor rightly reports as such.
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    status, detail = doctor(core)
    assert status == "FAIL" and f"its MPS daemon {daemon_id} is not running" in detail, detail
    asyncio.run(core.preparer.sweep(60))  # restarted
    assert doctor(core)[0] == "OK"

    # A daemon no claim records: the claim's record is gone (a crash between start and record).
    core.checkpoint.remove(c["metadata"]["uid"])
    status, detail = doctor(core)
    assert status == "FAIL" and f"orphan daemon {daemon_id} (pid " in detail, detail
