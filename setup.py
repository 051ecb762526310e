"""Generates the gRPC stubs from protos/ before setuptools collects the packages.

Metadata lives in pyproject.toml; this file only exists so that every build (wheel, sdist,
editable install) produces `dra_gpu/kubeletplugin/_proto/` from `protos/` first.
"""

import importlib.util
from pathlib import Path

from setuptools import setup

here = Path(__file__).parent
gen_protos_py = here / "dra_gpu/kubeletplugin/gen_protos.py"
spec = importlib.util.spec_from_file_location("gen_protos", gen_protos_py)
assert spec and spec.loader
gen_protos = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gen_protos)
gen_protos.generate(here / "protos", here / "dra_gpu/kubeletplugin/_proto")

setup()
