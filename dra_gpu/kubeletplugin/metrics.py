"""Prometheus metrics of the kubelet plugin (one registry per plugin instance)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class PluginMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "dra_gpu_node_requests",
            "Claims the kubelet asked to prepare or unprepare.",
            ["operation", "result"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "dra_gpu_node_request_duration_seconds",
            "Time to prepare or unprepare one claim.",
            ["operation"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.prepared_devices = Gauge(
            "dra_gpu_prepared_devices", "Devices held by prepared claims.", registry=self.registry
        )
        self.published_devices = Gauge(
            "dra_gpu_published_devices", "Devices in this node's ResourceSlices.", registry=self.registry
        )
        self.dropped_slice_fields = Gauge(
            "dra_gpu_slice_fields_dropped",
            "1 for each ResourceSlice field the apiserver dropped (its feature gate is off); "
            "field: taints, consumesCounters, sharedCounters, allowMultipleAllocations, "
            "bindingConditions, bindingFailureConditions, bindsToNode or other.",
            ["field"],
            registry=self.registry,
        )
        # Every series of the closed label sets exists from the start at 0, so that an alert's
        # increase() sees a claim's first failure (a series born at 1 shows no increase).
        for operation in ("prepare", "unprepare"):
            self.latency.labels(operation)
            for result in ("success", "error"):
                self.requests.labels(operation, result)
        self.slice_restores = Counter(
            "dra_gpu_slice_restores",
            "ResourceSlices re-applied after a deletion or edit.",
            registry=self.registry,
        )
