"""`--profile` without the simulator installed: the driver's wheel carries none, and says how to get
it instead of failing with an import error (dra_gpu.node.profiles)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from dra_gpu import cli
from dra_gpu.node import profiles


@pytest.fixture
def no_simulator(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """What a plain `pip install dra-gpu` has: no package under the `dra_gpu.node_profiles` entry point."""
    monkeypatch.setattr(profiles, "entry_points", lambda group: [])
    profiles.installed.cache_clear()
    yield
    profiles.installed.cache_clear()


def test_the_installed_simulator_is_found_through_its_entry_point() -> None:
    profiles.installed.cache_clear()
    assert "hgx-2x4" in profiles.profile_names()


def test_a_profile_without_the_simulator_says_how_to_get_it(
    no_simulator: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert profiles.profile_names() == ()
    with pytest.raises(profiles.NodePreparationError, match="dra-gpu-simnode"):
        profiles.prepare_node("hgx-2x4", Path("/nonexistent"))
    assert cli.main(["inventory", "--profile", "hgx-2x4"]) == 2
    err = capsys.readouterr().err
    assert "--profile hgx-2x4" in err and "pip install ./sim" in err and "Traceback" not in err


def test_no_nvml_without_the_simulator_names_it_instead_of_profiles(
    no_simulator: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["inventory", "--driver-root", "/nonexistent"]) == 2
    err = capsys.readouterr().err
    assert "NVML is not available" in err and "dra-gpu-simnode" in err


def test_the_plugin_on_a_profile_without_the_simulator_exits_saying_so(
    no_simulator: None, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The chart's simulatedProfile on the driver's own image: the plugin stops at start, naming
    what to install, instead of serving nothing."""
    dirs = ["--plugin-dir", str(tmp_path), "--registry-dir", str(tmp_path), "--cdi-dir", str(tmp_path)]
    assert cli.main(["kubelet-plugin", "--node-name", "n", "--profile", "hgx-2x4", *dirs]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dra-gpu kubelet-plugin: --profile hgx-2x4:") and "dra-gpu-simnode" in err
