"""Fixtures for the controller tests."""

from __future__ import annotations

from typing import Any

import pytest

from .objects import node_slices


@pytest.fixture
def hgx() -> list[dict[str, Any]]:
    return node_slices()
