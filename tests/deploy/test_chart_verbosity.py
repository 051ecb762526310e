"""The chart's `verbosity` (0..10, klog's -v=N) reaches both containers as `-v=N`, the deprecated
`verbose: true` of older values files as 4, and the schema refuses a level out of range."""

from __future__ import annotations

import subprocess
from typing import Any

import pytest
import yaml

from dra_gpu import cli

from .conftest import CHART, Render, one


def args_of(obj: dict[str, Any]) -> list[str]:
    (c,) = obj["spec"]["template"]["spec"]["containers"]
    return list(c["args"])


@pytest.mark.parametrize(
    ("sets", "level"),
    [
        ((), 0),
        (("verbosity=2",), 2),
        (("verbosity=10",), 10),
        (("verbose=true",), 4),  # deprecated: the bare -v it passed
        (("verbose=true", "verbosity=2"), 4),
        (("verbose=true", "verbosity=7"), 7),
        (("verbose=false", "verbosity=3"), 3),
    ],
)
def test_verbosity_reaches_both_containers_as_v_n(render: Render, sets: tuple[str, ...], level: int) -> None:
    objs = render(*sets)
    for kind, command in (("DaemonSet", "kubelet-plugin"), ("Deployment", "controller")):
        args = args_of(one(objs, kind))
        assert args[:2] == [command, f"-v={level}"], (kind, args)
        assert "--verbose" not in args
        parsed = cli._parser().parse_args(args)
        assert (parsed.command, parsed.verbosity) == (command, level)


@pytest.mark.parametrize(
    ("setting", "said"),
    [
        ("verbosity=11", "at '/verbosity': maximum: got 11, want 10"),
        ("verbosity=-1", "at '/verbosity': minimum: got -1, want 0"),
        ("verbosity=debug", "at '/verbosity': got string, want integer"),
    ],
)
def test_a_verbosity_out_of_range_is_refused(helm: str, setting: str, said: str) -> None:
    r = subprocess.run(
        [helm, "template", "dra-gpu", str(CHART), "--set", setting], capture_output=True, text=True
    )
    assert r.returncode != 0 and said in r.stderr, r.stderr


def test_values_yaml_sets_verbosity_not_verbose() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["verbosity"] == 0 and "verbose" not in values
