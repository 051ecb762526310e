# Pinned versions of the upstream programs the e2e cluster runs (sourced by build.sh and cluster).
# Changing a pin makes build.sh build that component again into a new cache directory.
K8S_VERSION=v1.37.2
ETCD_VERSION=v3.6.16
CONTAINERD_VERSION=v2.2.9
# KWOK simulates nodes without kubelets for bench/scale_bench.py; built only on request
# (`build.sh kwok`), not by `all`, as CI's e2e does not use it.
KWOK_VERSION=v0.8.0

# NVIDIA's container toolkit (Go module github.com/NVIDIA/nvidia-container-toolkit): nvidia-ctk
# (its CDI spec generator, the reference tests/test_nvidia_spec_reference.py compares ours with)
# and nvidia-cdi-hook (the CDI hooks runc runs); built only on request (`build.sh toolkit`).
NVIDIA_CTK_VERSION=v1.20.2
# An older release's nvidia-cdi-hook alone (built by `build.sh toolkit` too): it lacks
# disable-device-node-modification (1.18.0) and apply-cuda-memory-limits (1.20.1), the hook a
# node may still have that the plugin must give only the subcommands it knows.
NVIDIA_CTK_OLD_VERSION=v1.17.8

# NVIDIA's DRA driver (Go module sigs.k8s.io/dra-driver-nvidia-gpu; the only version the proxy
# serves), its gpu-kubelet-plugin: the driver dra-gpu is a drop-in for and is measured against;
# built only on request (`build.sh nvidia-dra`), with the harness's patch (see build.sh).
NVIDIA_DRA_VERSION=v0.5.0

# Programs built from the k8s.io/kubernetes module in one `go build` (packages shared).
# test/e2e/dra/test-driver is upstream's own DRA test driver (kubelet plugin + CDI), used as the
# peer driver that proves the DRA path (sigs.k8s.io/dra-example-driver is not served by the proxy).
K8S_PKGS=(
  k8s.io/kubernetes/cmd/kube-apiserver
  k8s.io/kubernetes/cmd/kube-controller-manager
  k8s.io/kubernetes/cmd/kube-scheduler
  k8s.io/kubernetes/cmd/kubelet
  k8s.io/kubernetes/cmd/kubectl
  k8s.io/kubernetes/test/e2e/dra/test-driver
)

# The kind path (e2e/kind/): kind itself, and what its node image holds besides Kubernetes.
KIND_VERSION=v0.33.0
CRICTL_VERSION=v1.37.0
# The CoreDNS that kubeadm of K8S_VERSION deploys (cmd/kubeadm/app/constants: CoreDNSVersion).
COREDNS_VERSION=v1.14.6
