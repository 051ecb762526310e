"""The GPU-agnostic kubelet-plugin layer (Python counterpart of Go's
k8s.io/dynamic-resource-allocation/kubeletplugin).

Registration, the DRA node service (v1, v1beta1), the health stream and the ResourceSlice publisher
live here; a driver plugs in by implementing `driver.Driver` and is run by `helper.KubeletPluginHelper`.
Nothing here knows about GPUs: it imports nothing of the GPU driver (plugin, discovery, model, node).

May import: dra_gpu.common, dra_gpu.kube.
"""
