"""The node's model of its GPUs: the backend a node command opens once (backend: NVML of the driver
root, or the node of a profile, `profiles`), where the node's files are (flags, settings), the
devices it publishes (catalog, dynamic_mig) and the ResourceSlices that carry them (slices), the
inventory's human views (inventory_report) and the NVML probe.

May import: dra_gpu.common, dra_gpu.kube, dra_gpu.model, dra_gpu.discovery.
"""
