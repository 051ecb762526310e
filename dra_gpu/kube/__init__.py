"""The Kubernetes edge: the API calls the driver makes on the official async client (api), the
parts of that client it loads (official_client), list responses decoded as they arrive
(list_decoder), the bounds every object read from the apiserver passes (bounds), and Kubernetes'
value vocabulary: names, quantities, semantic versions (values).

Nothing here knows about GPUs; everything above it reaches the apiserver through it.

May import: dra_gpu.common.
"""
