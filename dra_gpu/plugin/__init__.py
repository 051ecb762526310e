"""The GPU kubelet plugin's driver: how an allocated claim becomes a working GPU in a container.
A NodePrepareResources call reaches `gpu_driver` through the kubelet-plugin layer; `plan` turns the
claim's allocation and opaque config into what to do, `prepare` does it (MIG instances, compute
modes, MPS daemons and time slices through `sharing`, device nodes, the driver's files) and records
it in the journal and checkpoint before `cdi` writes the claim's CDI spec; `server` is the
composition root of `dra-gpu kubelet-plugin`.

May import: dra_gpu.common, dra_gpu.kube, dra_gpu.model, dra_gpu.discovery, dra_gpu.node,
dra_gpu.kubeletplugin, dra_gpu.health.
"""
