"""The kubelet-plugin layer stays GPU-free: it imports nothing of the GPU driver or its model."""

from __future__ import annotations

import ast
from pathlib import Path

import dra_gpu.kubeletplugin

GPU_SPECIFIC = (
    "dra_gpu.plugin",
    "dra_gpu.discovery",
    "dra_gpu.model",
    "dra_gpu.node",
    "dra_gpu.health",
    "simnode",
)


def test_the_layer_imports_nothing_gpu_specific() -> None:
    package = Path(dra_gpu.kubeletplugin.__file__).parent
    found = []
    for source in sorted(package.glob("*.py")):
        for node in ast.walk(ast.parse(source.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            found += [f"{source.name}: {n}" for n in names if n.startswith(GPU_SPECIFIC)]
    assert found == []
