"""`dra-gpu doctor`: the GPU troubleshooting tables as checks of a node and of a cluster.

Nothing else in dra_gpu imports this package: the plugin and the controller stay free of it.

May import: dra_gpu.common, dra_gpu.kube, dra_gpu.model, dra_gpu.discovery, dra_gpu.node,
dra_gpu.kubeletplugin, dra_gpu.plugin, dra_gpu.controller.
"""
