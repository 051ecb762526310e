"""Helm post-renderer: the chart's rendered YAML on stdin, the same YAML on stdout with the kubelet
plugin's DaemonSet changed as test_real_node.py's install changes it (Installs.simulate_only_the_kernel:
the simulated NVML's device and proc directories and the device root; support.reach_apiserver: host
network and the apiserver's address, the e2e cluster having no kube-proxy), so that `helm install`,
`helm upgrade` and `helm rollback` (which reuses the stored, post-rendered manifest) run the
real-node DaemonSet on the e2e cluster.

    helm install ... --post-renderer PYTHON --post-renderer-args THIS_FILE \\
        --post-renderer-args DEV_ROOT --post-renderer-args APISERVER_PORT
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml
from support import reach_apiserver
from test_real_node import Installs


def main(argv: list[str]) -> int:
    dev_root, port = Path(argv[0]), int(argv[1])
    docs = [d for d in yaml.safe_load_all(sys.stdin) if d]
    plugins = [
        d
        for d in docs
        if d.get("kind") == "DaemonSet"
        and d["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "kubelet-plugin"
    ]
    if len(plugins) != 1:
        print(
            f"post-renderer: {len(plugins)} kubelet-plugin DaemonSets rendered, expected 1", file=sys.stderr
        )
        return 1
    Installs.simulate_only_the_kernel(plugins[0], dev_root)
    reach_apiserver(plugins[0], port)
    yaml.safe_dump_all(docs, sys.stdout, sort_keys=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
