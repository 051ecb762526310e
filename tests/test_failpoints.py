"""Failpoints obey DRA_GPU_FAILPOINTS only in a process started with --enable-failpoints: the
variable alone (leaked into a production plugin's environment) is ignored, with one warning."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from dra_gpu import cli
from dra_gpu.common import failpoints


def test_the_variable_alone_is_ignored_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(failpoints._Switch, "warned", False)
    monkeypatch.setenv(failpoints.ENV, "somewhere=error,elsewhere=kill")
    caplog.set_level(logging.WARNING, logger="dra_gpu.common.failpoints")
    for _ in range(3):
        failpoints.hit("somewhere")
        failpoints.hit("elsewhere")  # `kill`: the test process would die here
    assert [r.getMessage() for r in caplog.records] == [
        "DRA_GPU_FAILPOINTS is set but --enable-failpoints was not given: failpoints ignored"
    ]


@pytest.mark.usefixtures("enabled_failpoints")
def test_with_the_flag_a_failpoint_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(failpoints.ENV, "somewhere=error")
    with pytest.raises(failpoints.FailpointError, match="failpoint somewhere"):
        failpoints.hit("somewhere")
    failpoints.hit("elsewhere")


def test_the_plugin_command_has_the_flag_off_by_default() -> None:
    parser = cli._parser()
    assert parser.parse_args(["kubelet-plugin"]).enable_failpoints is False
    assert parser.parse_args(["kubelet-plugin", "--enable-failpoints"]).enable_failpoints is True


@pytest.mark.parametrize("flag", [[], ["--enable-failpoints"]])
def test_the_plugin_command_turns_them_on_only_with_the_flag(flag: list[str]) -> None:
    """The plugin process itself: `error` at the first failpoint a start meets would end it; here a
    failpoint is hit right after the command line is read, in a child process."""
    code = (
        "import sys\n"
        "from dra_gpu import cli\nfrom dra_gpu.common import failpoints\n"
        "import dra_gpu.plugin.server as server\n"
        "server.run = lambda cfg: failpoints.hit('x') or 0\n"
        f"sys.exit(cli.main(['kubelet-plugin', '--node-name', 'n', '--profile', 'hgx-2x4', *{flag!r}]))\n"
    )
    env = {"DRA_GPU_FAILPOINTS": "x=error", "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    if flag:
        assert "FailpointError: failpoint x" in r.stderr, r.stderr
    else:
        assert r.returncode == 0, r.stderr
        assert "failpoints ignored" in r.stderr
