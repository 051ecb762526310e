"""Release dra-gpu: `scripts/release VERSION --registry HOST[:PORT][/PATH]`.

1. Checks that VERSION is the version of every file that states one (pyproject.toml, the
   package's version module, the chart's version and appVersion): a release never renames.
2. Builds the images (e2e/node/image_build.sh: buildah, no container engine, bases made by
   mmdebstrap) and pushes them as they were built, with go-containerregistry's crane:
   <registry>/dra-gpu:VERSION and <registry>/dra-gpu-simnode:VERSION (the driver plus its
   simulated GPU node, for clusters without GPUs). One platform: the build machine's (the bases
   are made by mmdebstrap for it, and no emulator runs another's build steps here).
3. Packages the chart with the registry and both digests in its values (the images are pulled
   by digest) and pushes it to oci://<registry>/charts/dra-gpu:VERSION with Helm.
4. Writes an SPDX 2.3 SBOM of the pushed driver image, read from the image's own layers (Debian's
   dpkg status and the Python distributions' metadata), a CHANGELOG.md entry when VERSION has
   none, and release.json (what was pushed, by digest) into --out.

Plain-HTTP registries need --plain-http; a registry with a private CA, --ca-file (both tools
verify against it). Exit codes: 0 released, 2 usage or a version mismatch, 1 a step failed.
"""

from __future__ import annotations

import argparse
import datetime
import email.parser
import gzip
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy" / "helm" / "dra-gpu"
CACHE = Path(os.environ.get("DRA_GPU_CACHE") or Path.home() / ".cache" / "dra-gpu")
CHANGELOG = ROOT / "CHANGELOG.md"
SEMVER = re.compile(r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(-[0-9A-Za-z.-]+)?$")
REGISTRY = re.compile(
    r"^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?(:[0-9]{1,5})?(/[a-z0-9]+([._-][a-z0-9]+)*)*$"
)
IMAGES = {"dra-gpu": "dra-gpu.tar", "dra-gpu-simnode": "dra-gpu-simnode.tar"}
CHANGELOG_SUBJECTS = 60  # an entry lists at most this many commit subjects


class ReleaseError(Exception):
    """A step failed; the message says which and why."""


@dataclass
class Transport:
    """How both tools reach the registry."""

    plain_http: bool = False
    ca_file: str = ""
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))

    def __post_init__(self) -> None:
        if self.ca_file:  # Go's TLS stack (crane, helm) reads its roots from here
            self.env["SSL_CERT_FILE"] = self.ca_file

    def crane(self) -> list[str]:
        return ["--insecure"] if self.plain_http else []

    def helm(self) -> list[str]:
        flags = ["--plain-http"] if self.plain_http else []
        return flags + (["--ca-file", self.ca_file] if self.ca_file else [])


def run(
    argv: list[str], env: dict[str, str] | None = None, timeout: float = 3600, stderr: bool = False
) -> str:
    """The program's output (with its standard error when `stderr`); a ReleaseError when it fails."""
    r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout, check=False)
    if r.returncode != 0:
        raise ReleaseError(
            f"{' '.join(argv[:3])} ... failed ({r.returncode}):\n{(r.stderr or r.stdout)[-3000:]}"
        )
    return r.stdout + (r.stderr if stderr else "")


def say(msg: str) -> None:
    print(f"[release] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------ versions


def stated_versions() -> dict[str, str]:
    """Every place that states the version, and what it says."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    module = re.search(r'^VERSION = "([^"]+)"', (ROOT / "dra_gpu/common/version.py").read_text(), re.M)
    chart = (CHART / "Chart.yaml").read_text()
    version = re.search(r"^version: (\S+)", chart, re.M)
    app = re.search(r'^appVersion: "?([^"\s]+)"?', chart, re.M)
    return {
        "pyproject.toml project.version": pyproject,
        "dra_gpu/common/version.py VERSION": module.group(1) if module else "",
        "deploy/helm/dra-gpu/Chart.yaml version": version.group(1) if version else "",
        "deploy/helm/dra-gpu/Chart.yaml appVersion": app.group(1) if app else "",
    }


def check_version(version: str) -> None:
    if not SEMVER.match(version):
        raise ValueError(f"VERSION {version!r} is not a semantic version (MAJOR.MINOR.PATCH[-PRE])")
    wrong = {where: said for where, said in stated_versions().items() if said != version}
    if wrong:
        lines = "\n".join(f"  {where}: {said or '(none)'}" for where, said in wrong.items())
        raise ValueError(f"VERSION {version} is not what these say (set them, then release):\n{lines}")


# -------------------------------------------------------------------------------------- images


def build_images() -> dict[str, Path]:
    say("building the images (e2e/node/image_build.sh; cached when its inputs did not change)")
    run(["bash", str(ROOT / "e2e" / "node" / "image_build.sh")])
    return {name: CACHE / "images" / archive for name, archive in IMAGES.items()}


def push_image(crane: str, archive: Path, ref: str, transport: Transport) -> str:
    """Pushes the OCI archive's one image to `ref`; returns its manifest digest."""
    with tempfile.TemporaryDirectory(prefix="dra-gpu-release-") as tmp:
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")  # an OCI image layout: crane pushes its one image
        refs = Path(tmp) / "pushed"
        run([crane, "push", *transport.crane(), "--image-refs", str(refs), tmp, ref], env=transport.env)
        pushed = refs.read_text().split()[0]  # <repository>@sha256:...
    digest = pushed.rsplit("@", 1)[1]
    said = run([crane, "digest", *transport.crane(), ref], env=transport.env).strip()
    if said != digest:
        raise ReleaseError(f"{ref}: the registry answers {said}, the push said {digest}")
    return digest


# ---------------------------------------------------------------------------------------- SBOM


@dataclass(frozen=True)
class Package:
    name: str
    version: str
    purl: str
    license: str = "NOASSERTION"


def image_files(archive: Path, wanted: re.Pattern[str]) -> dict[str, bytes]:
    """The files of the archive's image whose path matches `wanted`, as the image's root
    filesystem has them: its layers applied in order, whiteouts included."""
    files: dict[str, bytes] = {}
    with tarfile.open(archive) as outer:

        def blob(digest: str) -> bytes:
            member = outer.extractfile(f"blobs/sha256/{digest.split(':', 1)[1]}")
            if member is None:
                raise ReleaseError(f"{archive}: blob {digest} missing")
            return member.read()

        index = json.loads(blob_of_index(outer))
        manifest = json.loads(blob(index["manifests"][0]["digest"]))
        for layer in manifest["layers"]:
            data = blob(layer["digest"])
            if data[:2] == b"\x1f\x8b":
                data = gzip.decompress(data)
            with tarfile.open(fileobj=io.BytesIO(data)) as tar:
                for m in tar:
                    path = m.name.lstrip("./")
                    base = os.path.basename(path)
                    if base == ".wh..wh..opq":
                        gone = os.path.dirname(path) + "/"
                        files = {p: b for p, b in files.items() if not p.startswith(gone)}
                    elif base.startswith(".wh."):
                        gone = os.path.join(os.path.dirname(path), base[4:])
                        files = {p: b for p, b in files.items() if p != gone and not p.startswith(gone + "/")}
                    elif m.isfile() and wanted.search(path):
                        f = tar.extractfile(m)
                        if f is not None:
                            files[path] = f.read()
    return files


def blob_of_index(outer: tarfile.TarFile) -> bytes:
    member = outer.extractfile("index.json")
    if member is None:
        raise ReleaseError("not an OCI archive: no index.json")
    return member.read()


def image_packages(archive: Path) -> list[Package]:
    files = image_files(archive, re.compile(r"(^var/lib/dpkg/status$|\.dist-info/METADATA$)"))
    packages: list[Package] = []
    status = files.get("var/lib/dpkg/status", b"").decode()
    for stanza in status.split("\n\n"):
        fields = dict(
            line.split(": ", 1) for line in stanza.splitlines() if ": " in line and not line.startswith(" ")
        )
        if fields.get("Package") and "installed" in fields.get("Status", ""):
            name, version, arch = fields["Package"], fields.get("Version", ""), fields.get("Architecture", "")
            purl = f"pkg:deb/debian/{name}@{version}?arch={arch}"
            packages.append(Package(name, version, purl))
    for path, data in files.items():
        if path.endswith(".dist-info/METADATA"):
            meta = email.parser.BytesParser().parsebytes(data, headersonly=True)
            name, version = str(meta.get("Name", "")), str(meta.get("Version", ""))
            if name:
                normalized = re.sub(r"[-_.]+", "-", name).lower()
                lic = str(meta.get("License-Expression") or "NOASSERTION")
                packages.append(Package(name, version, f"pkg:pypi/{normalized}@{version}", lic))
    return sorted(packages, key=lambda p: p.purl)


def spdx_id(p: Package) -> str:
    return "SPDXRef-Package-" + hashlib.sha256(p.purl.encode()).hexdigest()[:16]


def sbom(archive: Path, image_ref: str, version: str) -> dict[str, object]:
    """An SPDX 2.3 document: the image, and every package in it, each with its package URL."""
    packages = image_packages(archive)
    if not packages:
        raise ReleaseError(f"{archive}: no Debian or Python package found in the image")
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    image = {
        "SPDXID": "SPDXRef-Image",
        "name": image_ref,
        "versionInfo": version,
        "downloadLocation": "NOASSERTION",
        "primaryPackagePurpose": "CONTAINER",
    }
    return {
        "spdxVersion": "SPDX-2.3",
        "dataLicense": "CC0-1.0",
        "SPDXID": "SPDXRef-DOCUMENT",
        "name": f"dra-gpu-{version}",
        "documentNamespace": f"https://spdx.org/spdxdocs/dra-gpu-{version}-{image_ref.rsplit('@', 1)[-1]}",
        "creationInfo": {"created": now, "creators": ["Tool: dra-gpu scripts/release"]},
        "packages": [image]
        + [
            {
                "SPDXID": spdx_id(p),
                "name": p.name,
                "versionInfo": p.version,
                "downloadLocation": "NOASSERTION",
                "licenseDeclared": p.license
                if re.fullmatch(r"[A-Za-z0-9.+ ()-]+", p.license)
                else "NOASSERTION",
                "externalRefs": [
                    {
                        "referenceCategory": "PACKAGE-MANAGER",
                        "referenceType": "purl",
                        "referenceLocator": p.purl,
                    }
                ],
            }
            for p in packages
        ],
        "relationships": [
            {
                "spdxElementId": "SPDXRef-DOCUMENT",
                "relationshipType": "DESCRIBES",
                "relatedSpdxElement": "SPDXRef-Image",
            }
        ]
        + [
            {
                "spdxElementId": "SPDXRef-Image",
                "relationshipType": "CONTAINS",
                "relatedSpdxElement": spdx_id(p),
            }
            for p in packages
        ],
    }


# --------------------------------------------------------------------------------------- chart


def set_value(text: str, key: str, value: str) -> str:
    """Sets `  key: ""` of values.yaml's image block (its comments stay: `helm show values`)."""
    old = f'\n  {key}: ""\n'
    if text.count(old) != 1:
        raise ReleaseError(f'values.yaml: expected exactly one line `  {key}: ""` in the image block')
    return text.replace(old, f'\n  {key}: "{value}"\n')


def package_chart(helm: str, registry: str, digests: dict[str, str], out: Path) -> Path:
    with tempfile.TemporaryDirectory(prefix="dra-gpu-chart-") as tmp:
        chart = Path(tmp) / "dra-gpu"
        shutil.copytree(CHART, chart)
        values = (chart / "values.yaml").read_text()
        values = set_value(values, "registry", registry)
        values = set_value(values, "digest", digests["dra-gpu"])
        values = set_value(values, "simulatorDigest", digests["dra-gpu-simnode"])
        (chart / "values.yaml").write_text(values)
        run([helm, "lint", str(chart), "--strict"])
        said = run([helm, "package", str(chart), "--destination", str(out)])
    return Path(said.strip().rsplit(": ", 1)[-1])


def push_chart(helm: str, package: Path, registry: str, transport: Transport) -> str:
    said = run(
        [helm, "push", str(package), f"oci://{registry}/charts", *transport.helm()],
        env=transport.env,
        stderr=True,
    )
    # Helm says "Pushed: <ref>" and "Digest: sha256:..." (on stderr or stdout by version).
    digest = re.search(r"Digest: (sha256:[0-9a-f]{64})", said)
    return digest.group(1) if digest else ""


# ----------------------------------------------------------------------------------- changelog


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=False).stdout


def changelog_entry(version: str, today: str) -> str:
    last = git("describe", "--tags", "--abbrev=0", "--match", "v*").strip()
    span = f"{last}..HEAD" if last else "HEAD"
    subjects = [s for s in git("log", "--format=%s", "--no-merges", span).splitlines() if s]
    lines = [f"## [{version}] - {today}", ""]
    if not last:
        lines += [f"The first release ({len(subjects)} commits): see README.md for what it does.", ""]
    else:
        lines += [f"Since {last} ({len(subjects)} commits):", ""]
        lines += [f"- {s}" for s in subjects[:CHANGELOG_SUBJECTS]]
        if len(subjects) > CHANGELOG_SUBJECTS:
            lines.append(f"- and {len(subjects) - CHANGELOG_SUBJECTS} more (git log {span})")
        lines.append("")
    return "\n".join(lines) + "\n"


def write_changelog(version: str) -> bool:
    """Adds VERSION's entry under the title unless it has one; True when it wrote one."""
    text = CHANGELOG.read_text() if CHANGELOG.exists() else "# Changelog\n\n"
    if re.search(rf"^## \[{re.escape(version)}\]", text, re.M):
        return False
    head, sep, rest = text.partition("\n## ")
    entry = changelog_entry(version, datetime.date.today().isoformat())
    new = head.rstrip("\n") + "\n\n" + entry + (("\n## " + rest) if sep else "")
    tmp = CHANGELOG.with_suffix(".md.tmp")
    tmp.write_text(new)
    tmp.replace(CHANGELOG)
    return True


# ---------------------------------------------------------------------------------------- main


def tool(script: str) -> str:
    """A pinned Go program, built once and cached by deploy/build-*.sh (the last line: its path)."""
    return run(["bash", str(ROOT / "deploy" / script)]).strip().splitlines()[-1]


def release(args: argparse.Namespace) -> dict[str, object]:
    version, registry = args.version, args.registry
    transport = Transport(plain_http=args.plain_http, ca_file=args.ca_file)
    out = Path(args.out) / version
    out.mkdir(parents=True, exist_ok=True)
    crane, helm = tool("build-crane.sh"), os.environ.get("DRA_GPU_HELM") or tool("build-helm.sh")
    archives = build_images()
    digests: dict[str, str] = {}
    for name, archive in archives.items():
        ref = f"{registry}/{name}:{version}"
        digests[name] = push_image(crane, archive, ref, transport)
        say(f"pushed {ref}@{digests[name]}")
    driver_ref = f"{registry}/dra-gpu:{version}@{digests['dra-gpu']}"
    doc = sbom(archives["dra-gpu"], driver_ref, version)
    sbom_path = out / f"dra-gpu-{version}.spdx.json"
    sbom_path.write_text(json.dumps(doc, indent=1) + "\n")
    say(f"SBOM: {sbom_path.name}, {len(doc['packages']) - 1} packages")  # type: ignore[arg-type]
    package = package_chart(helm, registry, digests, out)
    chart_digest = push_chart(helm, package, registry, transport)
    say(f"pushed oci://{registry}/charts/dra-gpu:{version} ({package.name})")
    wrote = write_changelog(version)
    say(
        f"CHANGELOG.md: {'entry for ' + version + ' written' if wrote else version + ' already has an entry'}"
    )
    manifest = {
        "version": version,
        "images": {name: f"{registry}/{name}:{version}@{d}" for name, d in digests.items()},
        "chart": {"ref": f"oci://{registry}/charts/dra-gpu", "version": version, "digest": chart_digest},
        "chart_package": package.name,
        "sbom": sbom_path.name,
        "platforms": [f"linux/{platform_arch()}"],
    }
    (out / "release.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def platform_arch() -> str:
    machine = os.uname().machine
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(machine, machine)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/release", description=__doc__.split("\n\n", 1)[0])
    p.add_argument("version", metavar="VERSION", help="the version to release, e.g. 0.1.0")
    p.add_argument("--registry", required=True, help="HOST[:PORT][/PATH] to push the images and the chart to")
    p.add_argument("--plain-http", action="store_true", help="the registry speaks HTTP, not HTTPS")
    p.add_argument(
        "--ca-file", default="", help="PEM bundle of the CA that signed the registry's certificate"
    )
    p.add_argument(
        "--out", default=str(ROOT / "dist"), help="where the chart package, SBOM and release.json go"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    try:
        if not REGISTRY.match(args.registry):
            raise ValueError(f"--registry {args.registry!r}: HOST[:PORT][/PATH] without a scheme or a tag")
        if args.ca_file and not Path(args.ca_file).is_file():
            raise ValueError(f"--ca-file {args.ca_file}: no such file")
        check_version(args.version)
    except ValueError as exc:
        print(f"scripts/release: {exc}", file=sys.stderr)
        return 2
    try:
        manifest = release(args)
    except (ReleaseError, subprocess.TimeoutExpired) as exc:
        print(f"scripts/release: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(manifest, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
