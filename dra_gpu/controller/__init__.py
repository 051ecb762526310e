"""The controller: the validating admission webhook (`webhook`, with its review pool and workers)
and the offline `validate` / `explain` commands. An object is decoded at the edge against its
schema (`schemas`), judged by the rules (`rules`, CEL in `cel`) against the cluster's published
devices (`cluster_state`, `published_devices`), and a claim is placed by the allocator the way the
scheduler would (`allocator`, `explain`, `diagnosis`), which gives the verdict and its reasons.

It shares the vocabulary and the Kubernetes edge with the node side, never the node side itself.

May import: dra_gpu.common, dra_gpu.kube, dra_gpu.model.
"""
