"""NVML failures per call and per GPU, malformed profiles, and the fake's fidelity to real NVML."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import yaml
from conftest import DATA, discover_doc
from simnode.profiles import ProfileError, load_profile, parse_profile

from dra_gpu.discovery import NvmlUnavailableError
from dra_gpu.node.nvml_probe import probe
from dra_gpu.node.slices import build_slices


def test_nvlink_not_supported_keeps_the_gpu(base_doc: dict) -> None:
    base_doc["gpus"][0]["nvlinks"] = [{"remote": base_doc["gpus"][1]["pciBusId"], "links": 4}]
    base_doc["gpus"][1]["nvlinks"] = [{"remote": base_doc["gpus"][0]["pciBusId"], "links": 4}]
    base_doc["gpus"][0]["nvmlErrors"] = {"nvmlDeviceGetNvLinkState": "NotSupported"}
    inv = discover_doc(base_doc)
    assert len(inv.gpus) == 4
    assert inv.gpus[0].nvlinks == []
    # GPU 1 still sees its link to GPU 0, and one side is enough to connect them.
    assert inv.gpus[0].nvlink_domain == inv.gpus[1].nvlink_domain


def test_lost_gpu_is_left_out_and_the_others_published(
    base_doc: dict, caplog: pytest.LogCaptureFixture
) -> None:
    base_doc["gpus"][2]["nvmlErrors"] = {"*": "GpuIsLost"}
    with caplog.at_level(logging.ERROR):
        inv = discover_doc(base_doc)
    assert [g.index for g in inv.gpus] == [0, 1, 3]
    assert len(inv.skipped) == 1 and "GPU 2" in inv.skipped[0] and "GPU is lost" in inv.skipped[0]
    assert "gpu skipped index=2" in caplog.text
    assert len(build_slices(inv)[0]["spec"]["devices"]) == 3


def test_unknown_error_on_a_core_call_leaves_the_gpu_out(base_doc: dict) -> None:
    base_doc["gpus"][0]["nvmlErrors"] = {"nvmlDeviceGetUUID": "Unknown"}
    inv = discover_doc(base_doc)
    assert [g.index for g in inv.gpus] == [1, 2, 3]
    assert "Unknown Error" in inv.skipped[0]


def test_optional_calls_failing_drop_only_their_attribute(base_doc: dict) -> None:
    base_doc["gpus"][0]["nvmlErrors"] = {
        "nvmlDeviceGetMemoryInfo": "NotSupported",
        "nvmlDeviceGetBrand": "Unknown",
        "nvmlDeviceGetNumaNodeId": "NotSupported",
        "nvmlDeviceGetArchitecture": "NoPermission",
    }
    inv = discover_doc(base_doc)
    dev = build_slices(inv)[0]["spec"]["devices"][0]
    assert "memory" not in dev["capacity"]
    assert not {"brand", "numaNode", "architecture"} & set(dev["attributes"])
    assert dev["attributes"]["uuid"] == {"string": inv.gpus[0].uuid}


def test_nvml_init_failure_says_nvml_is_unavailable(base_doc: dict) -> None:
    base_doc["nvmlErrors"] = {"nvmlInit": "DriverNotLoaded"}
    with pytest.raises(NvmlUnavailableError, match="Driver Not Loaded"):
        discover_doc(base_doc)


def dump(doc: dict) -> str:
    return yaml.safe_dump(doc)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d["gpus"][1].pop("uuid"), "GPU 1: field 'uuid' is required"),
        (lambda d: d["gpus"][2].update(memoryMiB="lots"), "GPU 2: field 'memoryMiB' must be an integer"),
        (lambda d: d["gpus"][0].update(memoryMiB=-1), "GPU 0: memoryMiB: must be positive"),
        (lambda d: d["gpus"][3].update(uuid="not-a-uuid"), "GPU 3: uuid: 'not-a-uuid' is not a GPU UUID"),
        (lambda d: d["gpus"][1].update(brand="acme"), "GPU 1: brand: unknown brand 'acme'"),
        (lambda d: d["gpus"][1].update(pciBusId="18:00"), "GPU 1: pciBusId"),
        (lambda d: d["gpus"][1].update(colour="green"), "GPU 1: unknown field 'colour'"),
        (lambda d: d["gpus"][3].update(uuid=d["gpus"][0]["uuid"]), "GPU 3: uuid: duplicate"),
        (
            lambda d: d["gpus"][0].update(nvlinks=[{"remote": "0000:99:00.0", "links": 2}]),
            "GPU 0: nvlinks[0].remote",
        ),
        (
            lambda d: d["gpus"][0].update(nvlinks=[{"remote": "00000000:11:00.0", "links": 19}]),
            "GPU 0: nvlinks: uses 19 links but nvlinkCount is 18",
        ),
        (
            lambda d: d["gpus"][0].update(
                mig={"enabled": True, "instances": [{"profile": "9g.99gb", "placement": 0}]}
            ),
            "GPU 0: mig.instances[0]: profile: unknown MIG profile '9g.99gb'",
        ),
        (
            lambda d: d["gpus"][0].update(nvmlErrors={"nvmlDeviceGetName": "Exploded"}),
            "GPU 0: nvmlErrors.nvmlDeviceGetName: unknown NVML error 'Exploded'",
        ),
        (lambda d: d.update(driverVersion="latest"), "driverVersion: 'latest' is not a driver version"),
        (lambda d: d.pop("gpus"), "top level: field 'gpus' is required"),
    ],
)
def test_malformed_profile_names_file_gpu_and_field(base_doc: dict, edit, message: str) -> None:
    edit(base_doc)
    with pytest.raises(ProfileError) as err:
        parse_profile(dump(base_doc), source="my-node.yaml")
    assert str(err.value).startswith("my-node.yaml: ")
    assert message in str(err.value)


def test_overlapping_mig_placements_are_rejected() -> None:
    text = (Path(__file__).parents[1] / "sim/simnode/profiles/dgx-a100-mig.yaml").read_text()
    doc = yaml.safe_load(text)
    doc["gpus"][0]["mig"]["instances"].append({"profile": "1g.10gb", "placement": 1})
    with pytest.raises(ProfileError, match=r"GPU 0: mig.instances: 1g.10gb at 1 overlaps 3g.40gb"):
        parse_profile(yaml.safe_dump(doc), source="x.yaml")


def test_unparseable_and_missing_profiles(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("gpus: [unclosed\n")
    with pytest.raises(ProfileError, match=r"bad.yaml: not valid YAML"):
        load_profile(str(bad))
    with pytest.raises(ProfileError, match="not a built-in profile"):
        load_profile(str(tmp_path / "absent.yaml"))
    unquoted = tmp_path / "unquoted.yaml"
    unquoted.write_text((DATA / "h200.yaml").read_text().replace("'00000000:00:06.0'", "00000000:00:06.0"))
    with pytest.raises(ProfileError, match=r"GPU 0: field 'pciBusId' .* quote it"):
        load_profile(str(unquoted))


def _comparable(line: str) -> str:
    """Drop what differs between two machines of one kind: handle types, free memory, PCI ids."""
    label, sep, value = line.partition(" = ")
    if not sep or label.endswith("nvmlDeviceGetHandleByIndex"):
        return label if sep else line
    data = json.loads(value)
    if isinstance(data, dict):
        for key in ("free", "used", "pciDeviceId", "pciSubSystemId"):
            data.pop(key, None)
    return f"{label} = {json.dumps(data)}"


def test_fake_answers_like_the_real_h200(capsys: pytest.CaptureFixture[str]) -> None:
    """The probe's output on a real H200 and on its simulated copy agree call by call."""
    from simnode.fake import simulated_nvml

    nvml, _ = simulated_nvml(load_profile(str(DATA / "h200.yaml")))
    probe(nvml)
    fake = capsys.readouterr().out.splitlines()
    real = (DATA / "h200-nvml-probe.txt").read_text().splitlines()
    assert [_comparable(x) for x in fake] == [_comparable(x) for x in real]
