"""Counting the process's fsyncs in a test: which writes pay for durability."""

from __future__ import annotations

import os

import pytest


def fsync_counter(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every `os.fsync` of this process from now on, worker threads included, by file descriptor
    (the call still syncs)."""
    synced: list[int] = []
    real = os.fsync

    def counting(fd: int) -> None:
        synced.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fsync", counting)
    return synced
