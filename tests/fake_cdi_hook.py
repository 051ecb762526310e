"""A stand-in for NVIDIA's nvidia-cdi-hook: a shell script that answers `--version` and `--help` as
the real program does (urfave/cli's formats of toolkit 1.17 and 1.20), for the probe's tests."""

from __future__ import annotations

from pathlib import Path

# urfave/cli v3 (toolkit 1.18 and later): a usage wraps onto lines indented deeper, and the
# VERSION section has an unindented "commit:" line before COMMANDS.
HELP_V3 = """NAME:
   NVIDIA CDI Hook - Command to structure files

USAGE:
   NVIDIA CDI Hook [global options] [command [command options]]

VERSION:
   1.20.2
commit: module

COMMANDS:
   update-ldcache                    Update ldcache in a container by running ldconfig
   create-symlinks                   A hook to create symlinks in the container.
   enable-cuda-compat                This hook ensures that the folder is on the search path if
                                     required
   disable-device-node-modification  Ensure that the params file does not allow modifications.
   apply-cuda-memory-limits          Set the limits. It reads the environment variables:
                                     1) NVIDIA_GPU_MEMORY_REQUEST
                                     2) NVIDIA_GPU_MEMORY_LIMIT
   help, h                           Shows a list of commands or help for one command

GLOBAL OPTIONS:
   --debug, -d    Enable debug-level logging [$NVIDIA_CTK_DEBUG, $NVIDIA_CDI_DEBUG]
   --help, -h     show help
"""

# urfave/cli v2 (toolkit 1.17): tab-aligned, an alias on one command.
HELP_V2 = """NAME:
   NVIDIA CDI Hook - Command to structure files

USAGE:
   NVIDIA CDI Hook [global options] command [command options]

VERSION:
   1.17.8
commit: module

COMMANDS:
   update-ldcache      Update ldcache in a container by running ldconfig
   create-symlinks     A hook to create symlinks in the container.
   chmod               Set the permissions of folders in the container by running chmod.
   enable-cuda-compat  This hook ensures that the folder is on the search path.
   help, h             Shows a list of commands or help for one command

GLOBAL OPTIONS:
   --debug, -d  Enable debug-level logging (default: false) [$NVIDIA_CTK_DEBUG, $NVIDIA_CDI_DEBUG]
"""


def fake_hook(
    directory: Path,
    help_text: str,
    version: str = "NVIDIA CDI Hook version 1.17.8\ncommit: module",
    name: str = "nvidia-cdi-hook",
    body: str = "",
) -> Path:
    """A program answering --version and --help (after `hook` when named nvidia-ctk) like NVIDIA's;
    `body` runs first (to fail or hang)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "help.txt").write_text(help_text)
    (directory / "version.txt").write_text(version + "\n")
    help_args = '"hook --help"' if name == "nvidia-ctk" else '"--help"'
    script = directory / name
    script.write_text(
        "#!/bin/sh\n"
        f"{body}\n"
        f'case "$*" in\n'
        f'  "--version") cat "{directory}/version.txt" ;;\n'
        f'  {help_args}) cat "{directory}/help.txt" ;;\n'
        '  *) echo "unexpected arguments: $*" >&2; exit 3 ;;\n'
        "esac\n"
    )
    script.chmod(0o755)
    return script
