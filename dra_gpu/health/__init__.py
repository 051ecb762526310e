"""GPU health: NVML events and liveness become device taints and kubelet health, and clear again
after recovery. classification (event -> effect), monitor (NVML, in threads), taint_book (the
per-device taint state, hold-down, persistence), manager (ties them to slices and the health
stream), control (the plugin's control socket: operator overrides, simulated events).

May import: dra_gpu.common, dra_gpu.kube, dra_gpu.model, dra_gpu.node.
"""
