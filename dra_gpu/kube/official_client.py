"""The parts of the official Kubernetes client the driver uses, loaded without the rest of it.

`import kubernetes.aio.client` first runs the `kubernetes` package's `__init__`, which imports the
whole synchronous client (every API class, requests, urllib3, oauthlib, websocket-client), then
`kubernetes.aio`'s (dynamic client, stream, watch, leader election): ~260 modules and ~9 MB of
the kubelet plugin's resident memory (bench/RESULTS.md), none of which `dra_gpu.kube.api` calls. It
needs `Configuration`, `ApiClient` (its generic request path; no generated API class or model),
and the kubeconfig and in-cluster loaders.

So the packages on the way to those modules are registered without running their `__init__`, and
only the modules named here are imported. A deferred package keeps its real spec and `__path__`;
the first attribute it lacks runs its real `__init__` there and then, so any other code in the
process (tests, the e2e helpers, the synchronous client `dra_gpu.controller.inputs` uses) still
gets the whole package when it asks for something outside this set. Import this module before anything else
imports `kubernetes`: a package already imported is left as it is.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
from typing import Any

# Parents of the modules below whose `__init__` imports far more than the driver uses.
_DEFERRED_PACKAGES = (
    "kubernetes",
    "kubernetes.aio",
    "kubernetes.aio.client",
    "kubernetes.aio.utils",  # kubernetes.aio.client.rest needs only its `retry` module
    "kubernetes.utils",  # the synchronous utils import urllib3 and create_from_yaml
)


def _defer_init(name: str) -> None:
    """Register package `name` with its `__init__` not yet run (see the module's docstring)."""
    if name in sys.modules:
        return
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None or spec.submodule_search_locations is None:
        raise ImportError(f"{name}: not an importable package")
    loader = spec.loader
    module = importlib.util.module_from_spec(spec)
    lock = threading.RLock()
    ran = False

    def run_init_then_get(attribute: str) -> Any:
        # A module-level __getattr__ (PEP 562) is consulted only for names the module lacks, so
        # `__path__`, `__spec__` and the submodules imported below never get here.
        nonlocal ran
        with lock:  # another thread waits here until the real __init__ has run
            if not ran:
                ran = True
                loader.exec_module(module)
                if module.__dict__.get("__getattr__") is run_init_then_get:
                    del module.__dict__["__getattr__"]
        if attribute in module.__dict__:
            return module.__dict__[attribute]
        # A lazy package (kubernetes.aio.client) defines a __getattr__ of its own in its __init__.
        own = module.__dict__.get("__getattr__")
        if own is not None and own is not run_init_then_get:
            return own(attribute)
        # Here also when the real __init__, while it runs, probes for a submodule it then imports.
        raise AttributeError(f"module {name!r} has no attribute {attribute!r}")

    module.__dict__["__getattr__"] = run_init_then_get
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, module)


for _package in _DEFERRED_PACKAGES:
    _defer_init(_package)

# The client is untyped (mypy ignores kubernetes.*), so these names are Any as they were before.
_configuration: Any = importlib.import_module("kubernetes.aio.client.configuration")
_api_client: Any = importlib.import_module("kubernetes.aio.client.api_client")
Configuration: Any = _configuration.Configuration
ApiClient: Any = _api_client.ApiClient
# kubernetes.aio.config's loaders import these two names from the package itself.
for _attribute, _value in (("Configuration", Configuration), ("ApiClient", ApiClient)):
    vars(sys.modules["kubernetes.aio.client"]).setdefault(_attribute, _value)
_config: Any = importlib.import_module("kubernetes.aio.config")
load_kube_config: Any = _config.load_kube_config
load_incluster_config: Any = _config.load_incluster_config
