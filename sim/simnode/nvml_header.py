"""NVIDIA's NVML header, the one the simulated libnvidia-ml.so.1 is compiled against.

It is `pkg/nvml/nvml.h` of the Go module github.com/NVIDIA/go-nvml at a pinned version, fetched
from the Go module proxy once (the zip's sha256 is checked) and kept in the cache; it is never
part of this repository. `DRA_GPU_NVML_H=<path>` names a header to use instead (offline builds).
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import tempfile
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

MODULE = "github.com/NVIDIA/go-nvml"
VERSION = "v0.13.4-1"
ZIP_SHA256 = "89d6490fdd1ac400524bfd65f2f5e23af2b3fb14131afeecd2468e7d85cf4c6e"
HEADER_IN_ZIP = f"{MODULE}@{VERSION}/pkg/nvml/nvml.h"
DEFAULT_PROXY = "https://proxy.golang.org"
HEADER_ENV = "DRA_GPU_NVML_H"


class NvmlHeaderError(RuntimeError):
    """The header is neither named, cached nor downloadable; the message says what to provide."""


class NvmlHeaderUnreachable(NvmlHeaderError):
    """Neither named nor cached, and the module proxy cannot be reached (no network)."""


def escape_module_path(path: str) -> str:
    """The module proxy's case encoding: each upper-case letter becomes '!' + its lower case."""
    return "".join(f"!{c.lower()}" if c.isupper() else c for c in path)


def proxy() -> str:
    """The first URL of $GOPROXY (as the go command reads it: a comma or pipe separated list),
    else proxy.golang.org."""
    for entry in re.split(r"[,|]", os.environ.get("GOPROXY", "")):
        if entry.startswith(("https://", "http://", "file://")):
            return entry
    return DEFAULT_PROXY


def zip_url(base: str | None = None) -> str:
    return f"{(base or proxy()).rstrip('/')}/{escape_module_path(MODULE)}/@v/{VERSION}.zip"


def _download(url: str) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=60) as resp:
            data: bytes = resp.read()
    except (urllib.error.URLError, OSError) as exc:
        raise NvmlHeaderUnreachable(
            f"cannot download NVIDIA's NVML header ({MODULE} {VERSION}) from {url}: {exc}; "
            f"without network access set {HEADER_ENV} to a copy of its pkg/nvml/nvml.h"
        ) from exc
    digest = hashlib.sha256(data).hexdigest()
    if digest != ZIP_SHA256:
        raise NvmlHeaderError(f"{url}: sha256 {digest}, expected {ZIP_SHA256}: refusing it")
    return data


def nvml_header(cache_dir: Path) -> Path:
    """The path of nvml.h: $DRA_GPU_NVML_H, else `<cache_dir>/nvml-header/<version>/nvml.h`
    (downloaded and checked on first use, written atomically)."""
    named = os.environ.get(HEADER_ENV)
    if named:
        path = Path(named)
        if not path.is_file():
            raise NvmlHeaderError(f"{HEADER_ENV}={named}: no such file (it must name NVIDIA's nvml.h)")
        return path
    dest = Path(cache_dir) / "nvml-header" / f"go-nvml-{VERSION}" / "nvml.h"
    if dest.is_file():
        return dest
    data = _download(zip_url())
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        header = zf.read(HEADER_IN_ZIP)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".nvml.h.", dir=dest.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(header)
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return dest


def header_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
