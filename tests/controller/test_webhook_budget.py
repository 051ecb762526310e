"""One hostile review (a selector that doubles a string with cel.bind) must not block the webhook:
it is denied at its deadline, while /healthz and normal reviews keep answering."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.webhook_hostile_bench import doubling_selector

from .objects import claim
from .test_webhook import Server


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    s = Server(tmp_path)
    yield s
    s.stop()


def test_hostile_review_is_denied_and_others_keep_answering(server: Server) -> None:
    result: dict[str, Any] = {}

    def attack() -> None:
        result["r"] = server.review(claim("hostile", selectors=[doubling_selector(26)]))

    t = threading.Thread(target=attack)
    t.start()
    time.sleep(0.3)
    slowest = 0.0
    while t.is_alive():
        t0 = time.monotonic()
        assert server.request("/healthz")[0] == 200
        assert server.review(claim("normal"))["allowed"] is True
        slowest = max(slowest, time.monotonic() - t0)
    t.join()
    r = result["r"]
    assert r["allowed"] is False
    assert "took longer than" in r["status"]["message"] or "memory budget" in r["status"]["message"]
    assert slowest < 1.0  # generous for a shared 2-core CI machine; bench/ records the p99
    assert server.review(claim("after"))["allowed"] is True
