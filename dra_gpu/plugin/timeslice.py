"""GPU time-slice levels, set with the driver installation's `nvidia-smi compute-policy`.

NVML has no public setter for the compute time slice, so both NVIDIA drivers run
`nvidia-smi compute-policy -i <uuid> --set-timeslice <0..3>`; so does this one, with the
driver's own nvidia-smi given the driver's NVML by full path (`driver_programs`: never the
driver's library directory on a search path). Level 0 is the driver default.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable

from dra_gpu.plugin.driver_programs import DriverProgram, DriverProgramError

LEVELS = {"Default": 0, "Short": 1, "Medium": 2, "Long": 3}
NVIDIA_SMI = "nvidia-smi"


class TimeSliceError(RuntimeError):
    """nvidia-smi could not set a time slice; the message has what it said."""


class TimeSlices:
    def __init__(
        self,
        locate: Callable[[], DriverProgram],
        extra_env: dict[str, str] | None = None,
        timeout: float = 10.0,
    ) -> None:
        self.locate = locate  # nvidia-smi and how it runs, found late
        self.extra_env = extra_env or {}
        self.timeout = timeout

    def set(self, uuid: str, level: int) -> None:
        program = self.locate()
        if program.binary is None:
            raise TimeSliceError(f"device {uuid}: {NVIDIA_SMI} not found in the driver installation")
        try:
            env = {**program.env(), **self.extra_env}
        except DriverProgramError as exc:
            raise TimeSliceError(f"device {uuid}: {NVIDIA_SMI}: {exc}") from exc
        cmd = [str(program.binary), "compute-policy", "-i", uuid, "--set-timeslice", str(level)]
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=self.timeout)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise TimeSliceError(f"device {uuid}: {' '.join(cmd[1:])} failed: {exc}") from exc
        if proc.returncode != 0:
            said = (proc.stdout + proc.stderr).strip()
            raise TimeSliceError(f"device {uuid}: {' '.join(cmd[1:])} exited {proc.returncode}: {said}")
