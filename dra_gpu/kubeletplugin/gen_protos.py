"""Generates the Python gRPC stubs for `protos/*.proto` into `dra_gpu/kubeletplugin/_proto/`.

Run at install time (`scripts/setup`, the wheel build in setup.py, the image build); generated code
is never edited or committed. protoc writes absolute imports (`import dra_v1_pb2`); they are
rewritten to package-relative ones so the stubs live inside this package.
"""

from __future__ import annotations

import re
from pathlib import Path

PROTO_FILES = (
    "pluginregistration_v1.proto",
    "dra_v1.proto",
    "dra_v1beta1.proto",
    "dra_health_v1alpha1.proto",
    "dra_health_v1.proto",
)


def generate(proto_dir: Path, out_dir: Path) -> None:
    from grpc_tools import protoc  # build-time dependency only

    out_dir.mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).parent / "_proto"
    for name in PROTO_FILES:
        args = [
            "protoc",
            f"-I{proto_dir}",
            f"-I{include}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(proto_dir / name),
        ]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed for {proto_dir / name}")
    for path in out_dir.glob("*_pb2*.py"):
        text = path.read_text()
        fixed = re.sub(r"^import (\w+_pb2) as", r"from . import \1 as", text, flags=re.M)
        path.write_text(fixed)
    (out_dir / "__init__.py").write_text(
        '"""Generated gRPC stubs; see dra_gpu/kubeletplugin/gen_protos.py."""\n'
    )


def main() -> None:
    root = Path(__file__).resolve().parents[2]
    generate(root / "protos", Path(__file__).resolve().parent / "_proto")


if __name__ == "__main__":
    main()
