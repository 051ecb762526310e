"""The e2e peer driver (upstream's DRA test driver) runs with a client rate limit that never binds,
so the benches that compare against it measure its work, not client-go's default limiter
(50 QPS, burst 100: one GET per prepare, so 50 claims/s and a p99 of 1/50 s)."""

from __future__ import annotations

from typing import Any

import pytest

from e2e.harness import cli, components


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The command lines `peer-driver start` would run (nothing is started)."""
    argvs: list[list[str]] = []
    monkeypatch.setattr(components, "start", lambda name, argv, *a, **k: argvs.append(list(argv)))
    monkeypatch.setattr(components, "wait_for", lambda *a, **k: None)
    monkeypatch.setattr(components, "say", lambda *a, **k: None)
    monkeypatch.setattr(components.os, "makedirs", lambda *a, **k: None)
    monkeypatch.setattr(cli, "read_pid", lambda name: None)
    monkeypatch.setattr(cli, "state_lock", lambda: None)
    return argvs


def client_flags(argv: list[str]) -> dict[str, str]:
    """The client flags, which come before the `kubelet-plugin` subcommand."""
    shared = argv[: argv.index("kubelet-plugin")]
    return dict(a.split("=", 1) for a in shared if a.startswith("--kube-api-"))


def test_the_peer_starts_with_a_limit_that_never_binds(started: list[list[str]]) -> None:
    assert cli.main(["e2e/cluster", "peer-driver", "start"]) == 0
    flags = client_flags(started[0])
    # far above the ~1,000 calls/s a bench drives
    assert float(flags["--kube-api-qps"]) >= 10_000
    assert int(flags["--kube-api-burst"]) >= 10_000


def test_client_go_defaults_on_request(started: list[list[str]]) -> None:
    assert (
        cli.main(
            ["e2e/cluster", "peer-driver", "start", "--kube-api-qps", "default", "--kube-api-burst=default"]
        )
        == 0
    )
    assert client_flags(started[0]) == {}


def test_explicit_limits_pass_through(started: list[list[str]]) -> None:
    assert (
        cli.main(["e2e/cluster", "peer-driver", "start", "--kube-api-qps=200", "--kube-api-burst", "300"])
        == 0
    )
    assert client_flags(started[0]) == {"--kube-api-qps": "200", "--kube-api-burst": "300"}


@pytest.mark.parametrize(
    "flags",
    [
        ["--kube-api-qps"],
        ["--kube-api-qps", "fast"],
        ["--kube-api-burst=1.5"],
        ["--qps=1"],
        ["--kube-api-qps=1", "--kube-api-qps=2"],
    ],
)
def test_bad_flags_print_the_usage(started: list[list[str]], flags: list[str], capsys: Any) -> None:
    assert cli.main(["e2e/cluster", "peer-driver", "start", *flags]) == 2
    assert started == []
    assert "peer-driver start [--kube-api-qps Q]" in capsys.readouterr().err
