"""Every NVML call the product can make resolves in NVIDIA's real libnvidia-ml of each supported driver.

1. The calls: dra_gpu's source is walked with `ast` for attribute accesses named `nvml[A-Z]\\w*`
   that are functions of `pynvml` (the product reaches pynvml through module objects named
   `pynvml`, `nvml`, `nv`, `self.nvml`, `self.nv`, ...), and for string constants naming one
   (`getattr(nv, name)` in the NVML probe). The pynvml-shaped simulated node (`fake_*.py`) is left
   out: its `nvml*` names are its own methods; so are the symbol names in nvml_compat's registry.
2. The C symbols: each pynvml wrapper's source (`inspect`) is read for the names it passes to
   `_nvmlGetFunctionPointer`, following the pynvml functions it calls (`nvmlDeviceGetCount` ->
   `nvmlDeviceGetCount_v2`, `nvmlInit` -> `nvmlInitWithFlags`). A wrapper with version branches
   gives all of its symbols (a superset of what one call needs).
3. The libraries: NVIDIA's real `libnvidia-ml.so.<version>` from Debian's packages, in the driver
   roots of `e2e/node/debian_driver_root.py` (bookworm 535.261.03, trixie 550.163.01; built once and
   cached, which needs root, mmdebstrap and Debian's archive; skipped when a root is neither cached
   nor buildable here). Symbols are read from the ELF dynamic symbol table with pyelftools: the
   library is never loaded, so none of its code runs (run as root without a driver, NVIDIA's
   libraries create /dev/nvidiactl in the host's /dev).

A symbol missing in a supported version fails, naming the call, where the product makes it and the
version, unless `dra_gpu/discovery/nvml_compat.py` FALLBACKS declares what the product does
instead, with the driver branch that introduced it (checked against the libraries both ways) and
a test that runs the fallback (checked to exist).
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from functools import cache
from pathlib import Path

import pynvml
import pytest
from elftools.elf.elffile import ELFFile

import dra_gpu
from dra_gpu.discovery.nvml_compat import FALLBACKS, driver_branch
from tests.driver_root import debian_driver_roots, debian_root
from tests.simnode_support import (
    libcache,  # noqa: F401 - fixture
    library,
    needs_toolchain,
    nvml_h,  # noqa: F401 - fixture
)

REPO = Path(__file__).resolve().parents[1]
PRODUCT = Path(dra_gpu.__file__).resolve().parent
NVML_NAME = re.compile(r"nvml[A-Z]\w*")
# The simulator (the C library's builder and the pynvml-shaped fake, whose nvml* names are its own
# methods) lives outside the product, in sim/simnode; under the product, what it names would be
# what it serves, not what the product calls.
NOT_CALLS = re.compile(r"simnode/.*\.py")
REGISTRY = "discovery/nvml_compat.py"  # its strings are C symbol names, not calls


DRIVER_ROOTS = debian_driver_roots()
VERSIONS = [s.driver_version for s in DRIVER_ROOTS.SUITES.values()]


def _is_pynvml_function(name: str) -> bool:
    return inspect.isfunction(getattr(pynvml, name, None))


@cache
def product_calls() -> dict[str, tuple[str, ...]]:
    """pynvml function -> where the product names it ("discovery/nvml_discovery.py:111", ...)."""
    sites: dict[str, set[str]] = {}
    for path in sorted(PRODUCT.rglob("*.py")):
        rel = path.relative_to(PRODUCT).as_posix()
        if NOT_CALLS.fullmatch(rel):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Attribute):
                name = node.attr
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and rel != REGISTRY:
                name = node.value
            else:
                continue
            if NVML_NAME.fullmatch(name) and _is_pynvml_function(name):
                sites.setdefault(name, set()).add(f"{rel}:{node.lineno}")
    return {name: tuple(sorted(s)) for name, s in sorted(sites.items())}


@cache
def c_symbols(wrapper: str) -> frozenset[str]:
    """The C symbols a pynvml function resolves, following the pynvml functions it calls."""
    out: set[str] = set()
    seen = {wrapper}
    todo = [wrapper]
    while todo:
        name = todo.pop()
        fn = inspect.unwrap(getattr(pynvml, name))
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                continue
            callee = node.func.id
            if callee == "_nvmlGetFunctionPointer":
                arg = node.args[0] if node.args else None
                if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)):
                    raise AssertionError(
                        f"pynvml.{name} resolves a symbol whose name is not a constant: "
                        f"{ast.unparse(node)}; teach this test to follow it"
                    )
                out.add(arg.value)
            elif callee not in seen and _is_pynvml_function(callee):
                seen.add(callee)
                todo.append(callee)
    return frozenset(out)


def exported_functions(library: Path) -> frozenset[str]:
    """Defined function symbols of an ELF shared object's dynamic symbol table (not loaded)."""
    with library.open("rb") as f:
        dynsym = ELFFile(f).get_section_by_name(".dynsym")
        assert dynsym is not None, f"{library}: no .dynsym"
        return frozenset(
            sym.name
            for sym in dynsym.iter_symbols()
            if sym["st_shndx"] != "SHN_UNDEF" and sym["st_info"]["type"] in ("STT_FUNC", "STT_GNU_IFUNC")
        )


@cache
def real_nvml(version: str) -> Path:
    """NVIDIA's libnvidia-ml.so.<version> from Debian's packages: the cached root, else built."""
    library: Path = DRIVER_ROOTS.root_nvml(debian_root(version), DRIVER_ROOTS.suite_for(version))
    assert library.is_file(), f"{library} missing from the driver root"
    return library


def missing_symbols(version: str) -> dict[str, list[str]]:
    """C symbol -> the product's calls that need it, for the symbols the version's library lacks."""
    exported = exported_functions(real_nvml(version))
    out: dict[str, list[str]] = {}
    for call in product_calls():
        for symbol in sorted(c_symbols(call)):
            if symbol not in exported:
                out.setdefault(symbol, []).append(call)
    return out


# -- the enumeration ---------------------------------------------------------------------------

# Calls known to be in the product, through each way it names the module: `nv.` (discovery),
# `self.nvml.` (health, compute mode), `self.nv.` (MIG lifecycle), `nvml.` (sharing), and
# getattr by name (probe).
KNOWN_CALLS = {
    "nvmlInit": "discovery/nvml_discovery.py",
    "nvmlDeviceGetCount": "discovery/nvml_discovery.py",
    "nvmlDeviceGetGpuInstanceProfileInfoById": "discovery/nvml_compat.py",
    "nvmlEventSetWait": "health/monitor.py",
    "nvmlDeviceSetComputeMode": "plugin/compute_mode.py",
    "nvmlDeviceCreateGpuInstanceWithPlacement": "plugin/mig_lifecycle.py",
    "nvmlGpuInstanceCreateComputeInstance": "plugin/mig_lifecycle.py",
    "nvmlDeviceIsMigDeviceHandle": "node/nvml_probe.py",
}

KNOWN_SYMBOLS = {
    "nvmlInit": {"nvmlInitWithFlags"},
    "nvmlDeviceGetCount": {"nvmlDeviceGetCount_v2"},
    "nvmlDeviceGetHandleByIndex": {"nvmlDeviceGetHandleByIndex_v2"},
    "nvmlDeviceGetPciInfo": {"nvmlDeviceGetPciInfo_v3"},
    "nvmlEventSetWait": {"nvmlEventSetWait_v2"},
    "nvmlDeviceGetGpuInstanceProfileInfoById": {"nvmlDeviceGetGpuInstanceProfileInfoByIdV"},
    "nvmlDeviceGetGpuInstanceProfileInfo": {
        "nvmlDeviceGetGpuInstanceProfileInfo",
        "nvmlDeviceGetGpuInstanceProfileInfoV",
    },
}


def test_enumeration_finds_the_calls_known_to_be_there() -> None:
    calls = product_calls()
    assert len(calls) >= 40, sorted(calls)
    for call, module in KNOWN_CALLS.items():
        assert call in calls, f"{call} not found in the product (known in {module})"
        assert any(site.startswith(module + ":") for site in calls[call]), (call, calls[call])
    assert not any(NOT_CALLS.fullmatch(site.split(":")[0]) for sites in calls.values() for site in sites)


def test_wrappers_map_to_their_c_symbols() -> None:
    for call, symbols in KNOWN_SYMBOLS.items():
        assert c_symbols(call) == symbols, call
    unresolved = [call for call in product_calls() if not c_symbols(call)]
    assert not unresolved, f"pynvml functions that resolve no C symbol: {unresolved}"


# -- the real libraries ------------------------------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
def test_every_nvml_call_resolves_in_the_real_library(version: str) -> None:
    library = real_nvml(version)
    exported = exported_functions(library)
    assert {"nvmlInit_v2", "nvmlDeviceGetCount_v2", "nvmlShutdown"} <= exported, library
    assert len(exported) > 200, (library, len(exported))
    calls = product_calls()
    problems = []
    for symbol, needed_by in sorted(missing_symbols(version).items()):
        fallback = FALLBACKS.get(symbol)
        where = "; ".join(f"{c} at {', '.join(calls[c])}" for c in needed_by)
        if fallback is None:
            problems.append(
                f"{symbol} is missing in NVIDIA's libnvidia-ml {version} and the product needs it "
                f"({where}): add a fallback to nvml_compat.FALLBACKS or stop calling it"
            )
        elif driver_branch(version) >= fallback.since:
            problems.append(
                f"{symbol} is missing in libnvidia-ml {version}, but FALLBACKS says it ships from "
                f"{fallback.since} ({where})"
            )
    for symbol, fallback in FALLBACKS.items():
        if symbol in exported and driver_branch(version) < fallback.since:
            problems.append(
                f"FALLBACKS says {symbol} ships from {fallback.since}, but libnvidia-ml {version} has it"
            )
    assert not problems, "\n".join(problems)


def test_every_fallback_is_needed_and_tested() -> None:
    needed = {symbol for call in product_calls() for symbol in c_symbols(call)}
    for symbol, fallback in FALLBACKS.items():
        assert symbol in needed, f"FALLBACKS.{symbol}: no product call resolves it any more"
        path, _, test = fallback.test.partition("::")
        source = REPO / path
        assert source.is_file(), f"FALLBACKS.{symbol}: {path} missing"
        tree = ast.parse(source.read_text(encoding="utf-8"))
        tests = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert test in tests, f"FALLBACKS.{symbol}: no test {test} in {path}"


def test_symbol_findings_per_version() -> None:
    """What each supported version lacks (printed with -s), all of it declared in FALLBACKS."""
    lines = []
    for version in VERSIONS:
        missing = missing_symbols(version)
        assert set(missing) <= set(FALLBACKS), (version, missing)
        listed = ", ".join(f"{s} ({', '.join(c)})" for s, c in sorted(missing.items())) or "none"
        count = len(exported_functions(real_nvml(version)))
        lines.append(f"libnvidia-ml {version}: {count} functions; missing: {listed}")
    print("\n" + "\n".join(lines))


@needs_toolchain
@pytest.mark.parametrize("version", VERSIONS)
def test_the_simulated_library_exports_only_what_the_real_one_does(
    version: str,
    libcache: Path,  # noqa: F811
) -> None:
    """A simulated node reporting `version` must not offer a function NVIDIA's library of that
    version lacks: the product's fallbacks would go untested where a real node needs them."""
    simulated = {f for f in exported_functions(library(libcache, "hgx-2x4", version)) if f.startswith("nvml")}
    real = exported_functions(real_nvml(version))
    assert simulated, "the simulated library exports no NVML function"
    assert not simulated - real, (
        f"simulated {version} exports what NVIDIA's {version} lacks: {sorted(simulated - real)}"
    )
