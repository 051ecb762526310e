"""containerd's CDI settings, read from its TOML config (and the files it imports).

containerd 2.x (config version 3) keeps them in `[plugins.'io.containerd.cri.v1.runtime']`,
version 2 configs in `[plugins.'io.containerd.grpc.v1.cri']`; `enable_cdi` defaults to true in
2.x and false in 1.7, `cdi_spec_dirs` to /etc/cdi and /var/run/cdi.
"""

from __future__ import annotations

import glob
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_SPEC_DIRS = ("/etc/cdi", "/var/run/cdi")
CRI_SECTIONS = {3: "io.containerd.cri.v1.runtime", 2: "io.containerd.grpc.v1.cri", 1: "cri"}
MAX_CONFIG_BYTES = 1024 * 1024
MAX_IMPORTS = 32


class ContainerdConfigError(Exception):
    """The file cannot be read or is not TOML."""


@dataclass
class ContainerdCdi:
    path: str
    version: int
    enabled: bool | None  # None: not set, and the default depends on the containerd release
    spec_dirs: list[str]
    spec_dirs_default: bool  # cdi_spec_dirs not set: containerd's defaults
    files: list[str] = field(default_factory=list)  # the config and what it imports, in order


def _read(path: Path) -> dict[str, Any]:
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise ContainerdConfigError(f"{path}: larger than {MAX_CONFIG_BYTES} bytes")
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ContainerdConfigError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ContainerdConfigError(f"{path} is not valid TOML: {exc}") from exc


def _imports(config: dict[str, Any], base: Path) -> list[Path]:
    out: list[Path] = []
    for pattern in config.get("imports") or []:
        if not isinstance(pattern, str):
            continue
        full = pattern if os.path.isabs(pattern) else str(base.parent / pattern)
        out.extend(Path(p) for p in sorted(glob.glob(full)))
    return out[:MAX_IMPORTS]


def read_containerd_cdi(path: Path) -> ContainerdCdi:
    """The CDI settings in effect for the CRI plugin: the main file, then its imports in order."""
    main = _read(path)
    version = int(main.get("version") or 1)
    section = CRI_SECTIONS.get(version, CRI_SECTIONS[3])
    files = [path, *_imports(main, path)]
    enabled: bool | None = None
    spec_dirs: list[str] | None = None
    for i, f in enumerate(files):
        doc = main if i == 0 else _read(f)
        cri = (doc.get("plugins") or {}).get(section)
        if not isinstance(cri, dict):
            continue
        if isinstance(cri.get("enable_cdi"), bool):
            enabled = cri["enable_cdi"]
        if isinstance(cri.get("cdi_spec_dirs"), list):
            spec_dirs = [str(d) for d in cri["cdi_spec_dirs"]]
    if enabled is None and version >= 3:
        enabled = True  # containerd 2.x: on by default
    return ContainerdCdi(
        path=str(path),
        version=version,
        enabled=enabled,
        spec_dirs=list(DEFAULT_SPEC_DIRS) if spec_dirs is None else spec_dirs,
        spec_dirs_default=spec_dirs is None,
        files=[str(f) for f in files],
    )


def same_directory(a: str | Path, b: str | Path) -> bool:
    """Equal after resolving links (/var/run is usually a link to /run)."""
    return os.path.realpath(a) == os.path.realpath(b)
