"""`dra-gpu doctor`: the GPU troubleshooting tables as checks of a node and of a cluster.

Nothing else in dra_gpu imports this package: the plugin and the controller stay free of it.
"""
