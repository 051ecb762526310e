"""Workloads (Pods, Deployments, Jobs, ...) that ask for GPUs the classic way,
`resources.limits: {nvidia.com/gpu: 1}`. With DRAExtendedResource the scheduler serves such a
request from the DeviceClass whose `extendedResourceName` is that name, so whether the workload
runs on dra-gpu is whether such a class is known and selects the driver's devices.

Only NVIDIA's names are looked at (nvidia.com/gpu and the device plugin's nvidia.com/mig-<profile>):
other extended resources are some other device plugin's business.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from dra_gpu.controller.rules import Problem, Validator, Verdict
from dra_gpu.controller.workload_claims import POD_SPEC_PATHS, pod_spec
from dra_gpu.model.nvidia_compat import GPU_EXTENDED_RESOURCE

MIG_EXTENDED_RESOURCE_PREFIX = "nvidia.com/mig-"
CONTAINER_LISTS = ("initContainers", "containers")


def is_gpu_extended_resource(name: str) -> bool:
    return name == GPU_EXTENDED_RESOURCE or name.startswith(MIG_EXTENDED_RESOURCE_PREFIX)


def gpu_requests(obj: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(field path, resource name) of each NVIDIA extended resource the workload's containers ask
    for in limits or requests; empty for anything else (not a workload, or no such resource)."""
    spec = pod_spec(obj)
    if spec is None:
        return []
    return list(_asked(spec, ".".join(POD_SPEC_PATHS[str(obj.get("kind"))])))


def _asked(spec: Mapping[str, Any], path: str) -> Iterator[tuple[str, str]]:
    for list_name in CONTAINER_LISTS:
        containers = spec.get(list_name)
        for i, c in enumerate(containers if isinstance(containers, list) else []):
            resources = c.get("resources") if isinstance(c, Mapping) else None
            if not isinstance(resources, Mapping):
                continue
            seen: set[str] = set()
            for field in ("limits", "requests"):  # limits first: where an extended resource must be
                amounts = resources.get(field)
                for name in amounts if isinstance(amounts, Mapping) else {}:
                    if isinstance(name, str) and is_gpu_extended_resource(name) and name not in seen:
                        seen.add(name)
                        yield f"{path}.{list_name}[{i}].resources.{field}[{name}]", name


def workload_verdict(validator: Validator, obj: Mapping[str, Any]) -> Verdict:
    """Whether a workload asking for nvidia.com/gpu or nvidia.com/mig-* gets it from dra-gpu: a
    known DeviceClass (validator.classes) has that extendedResourceName and selects the driver's
    devices. Not `concerned` when it asks for no such resource."""
    asked = gpu_requests(obj)
    meta = obj.get("metadata")
    meta = meta if isinstance(meta, Mapping) else {}
    v = Verdict(
        str(obj.get("kind")),
        str(meta.get("name") or meta.get("generateName") or "?"),
        str(meta.get("namespace") or ""),
        concerned=bool(asked),
    )
    driver = validator.driver
    for path, name in asked:
        serving = sorted(
            class_name
            for class_name, cls in validator.classes.items()
            if isinstance(cls.get("spec"), Mapping) and cls["spec"].get("extendedResourceName") == name
        )
        if not serving:
            v.errors.append(
                Problem(
                    path,
                    f"no DeviceClass has extendedResourceName {name}, so the scheduler has no class to "
                    f"serve it from: create one that selects {driver}'s devices with "
                    f"extendedResourceName: {name}"
                    + (
                        f" (the chart's full-GPU class {driver} has it unless "
                        "deviceClasses.gpu.extendedResourceName was changed)"
                        if name == GPU_EXTENDED_RESOURCE
                        else ", e.g. type == 'mig' and that profile"
                    ),
                )
            )
        elif not any(validator.class_concerns_driver(c) for c in serving):
            v.errors.append(
                Problem(
                    path,
                    f"DeviceClass {', '.join(serving)} serves {name} but selects no device of {driver}",
                )
            )
    return v
