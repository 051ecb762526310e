"""DRA device selectors in CEL: checked against the driver's attributes and evaluated on devices.

`schema` (what selectors may name), `functions` (the Kubernetes quantity/semver library),
`environment` (compile, check, evaluate) and `compat` (where Kubernetes' CEL and cel-cpp differ).
"""

from dra_gpu.controller.cel.environment import CelEnvironment, CelError, SelectorEvalError
from dra_gpu.controller.cel.schema import Schema

__all__ = ["CelEnvironment", "CelError", "Schema", "SelectorEvalError"]
