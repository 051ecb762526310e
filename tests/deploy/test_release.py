"""deploy/release.py (scripts/release) without a registry: what it refuses, the SBOM it reads
from an image's layers, the chart values it pins and the CHANGELOG entry it writes. The release
itself, pushed to a real registry and installed from it, is e2e/tests/test_kind.py."""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path
from types import ModuleType

import pytest

from .conftest import CHART, ROOT


def load_release() -> ModuleType:
    spec = importlib.util.spec_from_file_location("release", ROOT / "deploy" / "release.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["release"] = module
    spec.loader.exec_module(module)
    return module


release = load_release()


def script(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "deploy" / "release.py"), *args], capture_output=True, text=True
    )


def test_a_version_no_file_states_is_refused() -> None:
    r = script("9.9.9", "--registry", "registry.example.com/gpu")
    assert r.returncode == 2
    assert "VERSION 9.9.9 is not what these say" in r.stderr and "Chart.yaml appVersion" in r.stderr


@pytest.mark.parametrize("value", ["https://registry.example.com", "registry.example.com/gpu:1.0", "Reg/GPU"])
def test_a_registry_that_is_not_one_is_refused(value: str) -> None:
    r = script("0.1.0", "--registry", value)
    assert r.returncode == 2 and "--registry" in r.stderr, r.stderr


def test_every_stated_version_is_the_same() -> None:
    assert len(set(release.stated_versions().values())) == 1


def layer(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def oci_archive(path: Path, layers: list[bytes]) -> None:
    """An OCI image layout of one image, as a tar (what buildah's oci-archive: writes)."""
    blobs: dict[str, bytes] = {}

    def add(data: bytes) -> str:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        blobs[digest] = data
        return digest

    config = add(b"{}")
    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "config": {"digest": config, "size": 2},
            "layers": [{"digest": add(data), "size": len(data)} for data in layers],
        }
    ).encode()
    index = json.dumps({"schemaVersion": 2, "manifests": [{"digest": add(manifest), "size": len(manifest)}]})
    with tarfile.open(path, "w") as tar:
        for name, data in [("index.json", index.encode())] + [
            (f"blobs/sha256/{d.split(':')[1]}", b) for d, b in blobs.items()
        ]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


STATUS = b"""Package: libc6
Status: install ok installed
Architecture: amd64
Version: 2.36-9+deb12u10

Package: removed-one
Status: deinstall ok config-files
Architecture: amd64
Version: 1.0
"""
SITE = "opt/dra-gpu/lib/python3.11/site-packages"


def test_the_sbom_lists_what_the_image_holds_after_its_whiteouts(tmp_path: Path) -> None:
    archive = tmp_path / "image.tar"
    oci_archive(
        archive,
        [
            layer(
                {
                    "var/lib/dpkg/status": STATUS,
                    f"{SITE}/grpcio-1.76.0.dist-info/METADATA": b"Name: grpcio\nVersion: 1.76.0\n",
                    f"{SITE}/pip-24.0.dist-info/METADATA": b"Name: pip\nVersion: 24.0\n",
                }
            ),
            layer(
                {
                    f"{SITE}/.wh.pip-24.0.dist-info": b"",  # pip uninstalled in a later layer
                    f"{SITE}/Nvidia_ML_Py-13.0.dist-info/METADATA": b"Name: nvidia-ml-py\nVersion: 13.0\n"
                    b"License-Expression: BSD-3-Clause\n",
                }
            ),
        ],
    )
    doc = release.sbom(archive, "registry.example.com/dra-gpu:0.1.0@sha256:" + "a" * 64, "0.1.0")
    purls = {p["externalRefs"][0]["referenceLocator"] for p in doc["packages"][1:]}
    assert purls == {
        "pkg:deb/debian/libc6@2.36-9+deb12u10?arch=amd64",
        "pkg:pypi/grpcio@1.76.0",
        "pkg:pypi/nvidia-ml-py@13.0",
    }
    assert doc["spdxVersion"] == "SPDX-2.3" and doc["packages"][0]["primaryPackagePurpose"] == "CONTAINER"
    contained = {r["relatedSpdxElement"] for r in doc["relationships"] if r["relationshipType"] == "CONTAINS"}
    assert contained == {p["SPDXID"] for p in doc["packages"][1:]}
    licenses = {p["name"]: p["licenseDeclared"] for p in doc["packages"][1:]}
    assert licenses["nvidia-ml-py"] == "BSD-3-Clause" and licenses["grpcio"] == "NOASSERTION"


def test_the_chart_values_pin_the_registry_and_digests() -> None:
    values = (CHART / "values.yaml").read_text()
    pinned = release.set_value(
        release.set_value(values, "registry", "reg.example.com/gpu"), "digest", "sha256:1"
    )
    assert '\n  registry: "reg.example.com/gpu"\n' in pinned and '\n  digest: "sha256:1"\n' in pinned
    assert pinned.count("\n") == values.count("\n")  # only those lines changed: the comments stay
    with pytest.raises(release.ReleaseError):
        release.set_value(pinned, "registry", "again")


def test_the_changelog_entry_is_written_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    changelog = tmp_path / "CHANGELOG.md"
    changelog.write_text("# Changelog\n\nIntro.\n\n## [0.0.9] - 2026-01-01\n\n- old\n")
    monkeypatch.setattr(release, "CHANGELOG", changelog)
    assert release.write_changelog("0.1.0") is True
    text = changelog.read_text()
    assert text.index("## [0.1.0]") < text.index("## [0.0.9]") and text.startswith("# Changelog\n\nIntro.\n")
    assert release.write_changelog("0.1.0") is False and changelog.read_text() == text
