"""The hashed dependency locks (scripts/lock) match pyproject.toml: what scripts/setup (development,
CI) and deploy/Dockerfile (the image) install is what pyproject.toml declares, every file checked
by its sha256 (`pip install --require-hashes`)."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
REGENERATE = "run scripts/lock (it keeps the other pins; `scripts/lock --upgrade` takes newer releases)"
PROJECT = "dra-gpu (pyproject.toml)"  # how pip-compile names a requirement pyproject.toml declares


@dataclass
class Pin:
    version: str
    hashes: list[str] = field(default_factory=list)
    via: set[str] = field(default_factory=set)


def read_lock(path: Path) -> dict[str, Pin]:
    """pip-compile's output: `name==version \\`, then `--hash=sha256:...` and `# via` lines."""
    pins: dict[str, Pin] = {}
    current: Pin | None = None
    for line in path.read_text().splitlines():
        pinned = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", line)
        if pinned:
            current = pins.setdefault(canonicalize_name(pinned[1]), Pin(pinned[2]))
        elif current is not None and (hashed := re.match(r"^\s+--hash=sha256:([0-9a-f]{64})", line)):
            current.hashes.append(hashed[1])
        elif current is not None and (via := re.match(r"^\s+#\s+(?:via\s+)?(\S.*)$", line)):
            if via[1] != "via":
                current.via.add(via[1].strip())
        elif line.strip() and not line.startswith("#"):
            raise AssertionError(f"{path.name}: unexpected line {line!r}")
    return pins


def declared() -> dict[str, list[Requirement]]:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return {
        "runtime": [Requirement(r) for r in pyproject["project"]["dependencies"]],
        "dev": [Requirement(r) for r in pyproject["project"]["optional-dependencies"]["dev"]],
        "build": [Requirement(r) for r in pyproject["build-system"]["requires"]],
    }


LOCKS = {  # lock file -> the declared groups it holds
    "requirements.lock": ("runtime",),
    "requirements-build.lock": ("build",),
    "requirements-dev.lock": ("runtime", "dev", "build"),
}


def lock_problems(path: Path, wanted: list[Requirement]) -> list[str]:
    """How the lock at `path` differs from the declared requirements `wanted` (none: it is current)."""
    pins = read_lock(path)
    problems = []
    for requirement in wanted:
        pin = pins.get(canonicalize_name(requirement.name))
        if pin is None:
            problems.append(f"{path.name} lacks {requirement} of pyproject.toml")
        elif not requirement.specifier.contains(pin.version, prereleases=True):
            problems.append(
                f"{path.name} pins {requirement.name}=={pin.version}, outside pyproject.toml's {requirement}"
            )
    # No dependency pyproject.toml no longer declares (pip-compile marks the declared ones).
    direct = {name for name, pin in pins.items() if any(v.startswith(PROJECT[:-1]) for v in pin.via)}
    for name in sorted(direct - {canonicalize_name(r.name) for r in wanted}):
        problems.append(f"{path.name} pins {name}, which pyproject.toml no longer declares")
    return [f"{problem}: {REGENERATE}" for problem in problems]


@pytest.mark.parametrize("lock", sorted(LOCKS))
def test_a_lock_pins_every_declared_dependency_within_its_range(lock: str) -> None:
    wanted = [r for group in LOCKS[lock] for r in declared()[group]]
    assert lock_problems(ROOT / lock, wanted) == []


@pytest.mark.parametrize("lock", sorted(LOCKS))
def test_every_pin_carries_the_hashes_pip_checks(lock: str) -> None:
    for name, pin in read_lock(ROOT / lock).items():
        assert pin.hashes, f"{lock}: {name}=={pin.version} has no --hash: {REGENERATE}"


@pytest.mark.parametrize("lock", ["requirements.lock", "requirements-build.lock"])
def test_the_image_installs_the_versions_ci_tests(lock: str) -> None:
    dev = read_lock(ROOT / "requirements-dev.lock")
    for name, pin in read_lock(ROOT / lock).items():
        assert name in dev and dev[name].version == pin.version, (
            f"{lock} pins {name}=={pin.version}, requirements-dev.lock "
            f"{dev[name].version if name in dev else 'nothing'}: {REGENERATE}"
        )
        assert set(pin.hashes) <= set(dev[name].hashes), f"{lock}: {name}'s files differ: {REGENERATE}"


def test_setup_installs_from_the_lock_with_hashes_required() -> None:
    """(deploy/Dockerfile's installs: tests/deploy/test_image.py.)"""
    setup = (ROOT / "scripts" / "setup").read_text()
    assert "--require-hashes --only-binary=:all: -r requirements-dev.lock" in setup
    assert "--no-deps --no-build-isolation -e ." in setup


def test_a_stale_lock_is_reported_with_the_command_that_regenerates_it(tmp_path: Path) -> None:
    """A lock one release behind pyproject.toml's range, and one with a dependency pyproject.toml
    dropped, as after an edit of pyproject.toml without scripts/lock."""
    text = (ROOT / "requirements.lock").read_text()
    stale = tmp_path / "requirements.lock"
    stale.write_text(re.sub(r"^nvidia-ml-py==\S+", "nvidia-ml-py==12.570.86", text, flags=re.MULTILINE))
    runtime = declared()["runtime"]
    (nvml,) = [r for r in runtime if r.name == "nvidia-ml-py"]
    assert lock_problems(stale, runtime) == [
        f"requirements.lock pins nvidia-ml-py==12.570.86, outside pyproject.toml's {nvml}: {REGENERATE}"
    ]
    without_tenacity = [r for r in runtime if r.name != "tenacity"]
    assert lock_problems(ROOT / "requirements.lock", without_tenacity) == [
        f"requirements.lock pins tenacity, which pyproject.toml no longer declares: {REGENERATE}"
    ]
    assert lock_problems(ROOT / "requirements.lock", [*runtime, Requirement("left-pad>=1")]) == [
        f"requirements.lock lacks left-pad>=1 of pyproject.toml: {REGENERATE}"
    ]
