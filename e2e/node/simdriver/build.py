#!/usr/bin/env python3
"""Build a simulated NVIDIA driver root (CLI over simnode.builder).

    python3 e2e/node/simdriver/build.py --profile NAME|PATH (--out DIR | --cache DIR)
                                   [--version V] [--stale-version V]

Run it with the project's .venv python (it imports dra_gpu). What a root holds and how the
simulated NVML behaves: sim/simnode/README.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # run from a checkout without install

from simnode.builder import (  # noqa: F401 - re-exported for the builder's callers
    DEFAULT_CUDA_VERSION,
    LIBRARIES,
    TOOLS,
    SimDriverError,
    SimGpu,
    _build,
    build_driver_root,
    ensure_driver_root,
    lib_dir,
    multiarch,
    profile_of_gpus,
    profile_versions,
)
from simnode.profiles import ProfileError, load_profile


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--profile", required=True, help="built-in profile name or profile file")
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", type=Path, help="build the root exactly here (replaced if present)")
    where.add_argument("--cache", type=Path, help="build once under CACHE/simdriver/<key>")
    ap.add_argument("--version", help="driver version (default: the profile's driverVersion)")
    ap.add_argument("--stale-version", help="also leave this older driver's libcuda/libnvidia-ml behind")
    args = ap.parse_args(argv)
    try:
        if args.cache is not None:
            root = ensure_driver_root(args.cache, args.profile, args.version, args.stale_version)
        else:
            profile = load_profile(args.profile)
            version, cuda = profile_versions(profile)
            root = build_driver_root(
                args.out,
                args.version or version,
                profile,
                stale_version=args.stale_version,
                cuda_version=cuda,
            )
    except (SimDriverError, ProfileError) as exc:
        print(f"simdriver: {exc}", file=sys.stderr)
        return 1
    print(root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
