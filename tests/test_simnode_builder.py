"""Where the simulated NVML comes from (sim/simnode): NVIDIA's header from the module proxy
or a named file, the export table against the C source, and the errors that say what is missing."""

from __future__ import annotations

import hashlib
import io
import re
import zipfile
from pathlib import Path

import pytest
from simnode import builder, exports, nvml_header

C_SOURCE = Path(builder.SRC) / "libnvidia-ml.c"


def test_the_module_proxy_url_escapes_upper_case() -> None:
    assert nvml_header.escape_module_path("github.com/NVIDIA/go-nvml") == "github.com/!n!v!i!d!i!a/go-nvml"
    assert nvml_header.zip_url("https://proxy.golang.org/") == (
        "https://proxy.golang.org/github.com/!n!v!i!d!i!a/go-nvml/@v/v0.13.4-1.zip"
    )


def test_goproxy_first_url_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GOPROXY", "off|https://mirror.example/go,direct")
    assert nvml_header.proxy() == "https://mirror.example/go"
    monkeypatch.setenv("GOPROXY", "direct")
    assert nvml_header.proxy() == nvml_header.DEFAULT_PROXY


def test_every_exported_function_is_defined_in_the_c_source_and_back() -> None:
    defined = set(re.findall(r"^(?:nvmlReturn_t|const char \*)\s*(nvml\w+)\(", C_SOURCE.read_text(), re.M))
    assert defined == set(exports.FUNCTIONS)
    assert set(exports.FIRST_DRIVER) <= set(exports.FUNCTIONS)


def test_the_export_list_follows_the_driver_version() -> None:
    old, new = set(exports.exported("535.261.03")), set(exports.exported("580.95.05"))
    assert new - old == {
        "nvmlDeviceGetNumaNodeId",
        "nvmlDeviceGetGpuFabricInfoV",
        "nvmlDeviceGetGpuInstanceProfileInfoByIdV",
        "nvmlDeviceSetMemoryLimits_v1",
        "nvmlDeviceGetMemoryLimits_v1",
    }
    assert "nvmlDeviceGetGpuInstanceProfileInfoByIdV" not in exports.exported("570.195.03")
    script = exports.version_script("570.195.03")
    assert script.startswith("{\n  global:\n") and script.endswith("  local: *;\n};\n")
    assert "    nvmlDeviceGetGpuInstanceProfileInfoV;\n" in script


def test_a_named_header_that_is_missing_is_an_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DRA_GPU_NVML_H", str(tmp_path / "nvml.h"))
    with pytest.raises(nvml_header.NvmlHeaderError, match=r"DRA_GPU_NVML_H=.*no such file"):
        nvml_header.nvml_header(tmp_path)


def test_without_network_the_error_names_the_url_and_the_way_out(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("DRA_GPU_NVML_H", raising=False)
    monkeypatch.setenv("GOPROXY", "http://127.0.0.1:9")  # discard port: nothing listens
    with pytest.raises(nvml_header.NvmlHeaderUnreachable) as err:
        nvml_header.nvml_header(tmp_path / "cache")
    assert "http://127.0.0.1:9/github.com/!n!v!i!d!i!a/go-nvml/@v/v0.13.4-1.zip" in str(err.value)
    assert "DRA_GPU_NVML_H" in str(err.value)
    # The builder says the same, as its own error.
    with pytest.raises(builder.SimDriverError, match="DRA_GPU_NVML_H"):
        builder.ensure_nvml_library(tmp_path / "cache", "dgx-h100")
    assert not (tmp_path / "cache" / "nvml-header").exists()


def test_a_download_with_another_checksum_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    forged = io.BytesIO()
    with zipfile.ZipFile(forged, "w") as zf:
        zf.writestr(nvml_header.HEADER_IN_ZIP, "/* not NVIDIA's */\n")
    target = tmp_path / "proxy" / nvml_header.zip_url("x").removeprefix("x/")
    target.parent.mkdir(parents=True)
    target.write_bytes(forged.getvalue())
    monkeypatch.delenv("DRA_GPU_NVML_H", raising=False)
    monkeypatch.setenv("GOPROXY", f"file://{tmp_path / 'proxy'}")
    digest = hashlib.sha256(forged.getvalue()).hexdigest()
    with pytest.raises(nvml_header.NvmlHeaderError, match=f"sha256 {digest}, expected"):
        nvml_header.nvml_header(tmp_path / "cache")
    assert not (tmp_path / "cache" / "nvml-header").exists()


def test_without_a_c_compiler_the_error_says_so(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    header = tmp_path / "nvml.h"
    header.write_text("/* stand-in: never compiled */\n")
    monkeypatch.setenv("DRA_GPU_NVML_H", str(header))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(builder.SimDriverError, match=r"no C compiler .*no-such-cc.*install gcc"):
        builder.ensure_nvml_library(tmp_path / "cache", "dgx-h100")
