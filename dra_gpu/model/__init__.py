"""The shared vocabulary, read by the node side and the controller alike: what discovery found on a
node (inventory), the attributes and capacities a device is published with (attributes), and the
opaque configuration API that claims carry (config).

Nothing here talks to NVML or to the apiserver.

May import: dra_gpu.common, dra_gpu.kube.
"""
