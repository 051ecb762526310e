"""Kubernetes quantities as the apiserver reads them (k8s.io/apimachinery's resource.Quantity)."""

from __future__ import annotations

from decimal import Decimal

import pytest

from dra_gpu.kube.values import parse_quantity, quantity_or_none


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("80Gi", Decimal(80 << 30)),
        ("1.5", Decimal("1.5")),
        ("500m", Decimal("0.5")),
        ("100u", Decimal("0.0001")),
        ("3n", Decimal("3e-9")),
        ("2k", Decimal(2000)),
        ("1E", Decimal(10) ** 18),
        ("1e3", Decimal(1000)),
        ("1E3", Decimal(1000)),
        ("+.5Ki", Decimal(512)),
    ],
)
def test_every_suffix_the_apiserver_accepts(text: str, value: Decimal) -> None:
    assert parse_quantity(text) == value


@pytest.mark.parametrize("text", ["", " 1Gi", "1gi", "1ki", "1K", "1Gib", "0x10", "1e", "Gi", "1e65", "nan"])
def test_what_the_apiserver_refuses(text: str) -> None:
    with pytest.raises(ValueError):
        parse_quantity(text)
    assert quantity_or_none(text) is None


def test_quantity_or_none_reads_numbers_and_none() -> None:
    assert quantity_or_none(80) == Decimal(80)
    assert quantity_or_none("1Mi") == Decimal(1 << 20)
    assert quantity_or_none(None) is None
