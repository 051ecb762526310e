"""`node/cdi-hook`: the hook program of `--cdi-hook-path`, asked what the plugin asks it at start
(its version and hooks, `plugin.cdi_hook`), and what a claim's spec gets or loses with it."""

from __future__ import annotations

from collections.abc import Iterable

from dra_gpu.doctor.report import Result, fail, ok, warn
from dra_gpu.doctor.settings import NodeCheckSettings
from dra_gpu.plugin.cdi_hook import APPLY_CUDA_MEMORY_LIMITS, OPTIONAL, CdiHookError, probe

NAME = "node/cdi-hook"
UPGRADE = (
    "install NVIDIA's container toolkit 1.18.0 or newer (1.20.1 or newer for memory shares) and "
    "restart the plugin"
)


def check_cdi_hook(settings: NodeCheckSettings) -> Iterable[Result]:
    path = settings.cdi_hook_path
    if not path:
        # Nothing to check, nothing wrong: the specs then bind-mount the driver's files as they are.
        yield ok(NAME, "no --cdi-hook-path ($NVIDIA_CDI_HOOK_PATH): claims' specs name no NVIDIA hook")
        return
    try:
        hook = probe(path)
    except CdiHookError as exc:
        yield fail(
            NAME,
            f"{exc}; the plugin does not start with it",
            "fix --cdi-hook-path or install the program there",
        )
        return
    detail = f"{path}: version {hook.version}, hooks {', '.join(sorted(hook.subcommands))}"
    required = hook.missing_required()
    if required:
        yield fail(NAME, f"{detail}; lacks {', '.join(required)}: the plugin does not start with it", UPGRADE)
        return
    lost = [f"without {name} {OPTIONAL[name]}" for name in hook.missing_optional()]
    if settings.memory_shares and not hook.supports(APPLY_CUDA_MEMORY_LIMITS):
        lost.append(
            f"without {APPLY_CUDA_MEMORY_LIMITS} memory shares are held only by their MPS daemon "
            "(toolkit 1.20.1 or newer has it)"
        )
    if lost:
        yield warn(NAME, f"{detail}; left out of claims' specs: {'; '.join(lost)}", UPGRADE)
        return
    yield ok(NAME, detail)
