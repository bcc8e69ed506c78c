"""GPU profiles for imported traces: every figure cited, and the trace's deviceProperties name them."""
import pytest

from megaloom.runtime.errors import ConfigError
from megaloom.scheduler import load_profile
from megaloom.scheduler.profile import match_device, parse_profile

NEW = ["a100", "v100", "h800", "mi250"]


@pytest.mark.parametrize("name", NEW)
def test_gpu_profiles_cite_every_figure(name):
    p = load_profile(name)
    assert set(p.units) == {"cube", "vector", "comm"} and p.units["cube"] == p.units["vector"]
    for key in ("units", "peak.cube", "peak.vector", "mem_bw", "links.intra", "links.inter", "links.host", "task_overhead"):
        assert len(p.sources[key]) > 20, key
    assert p.peak("cube", "bf16") > p.peak("vector", "fp32") and p.link("host")[1] < p.link("intra")[1]


@pytest.mark.parametrize("props, want", [
    ({"name": "NVIDIA A100-PG509-200", "computeMajor": 8, "computeMinor": 0, "numSms": 108, "warpSize": 32}, "a100"),
    ({"name": "NVIDIA A100-SXM4-80GB", "computeMajor": 8, "computeMinor": 0, "numSms": 108, "warpSize": 32}, "a100"),
    ({"name": "Tesla V100-SXM2-32GB", "computeMajor": 7, "computeMinor": 0, "numSms": 80, "warpSize": 32}, "v100"),
    ({"name": "NVIDIA H800", "computeMajor": 9, "computeMinor": 0, "numSms": 132, "warpSize": 32}, "h800"),
    ({"name": "NVIDIA H100 80GB HBM3", "computeMajor": 9, "computeMinor": 0, "numSms": 132, "warpSize": 32}, "h100"),
    ({"name": "NVIDIA H200", "computeMajor": 9, "computeMinor": 0, "numSms": 132, "warpSize": 32}, "h200"),
    ({"name": "AMD Radeon Graphics", "computeMajor": 9, "computeMinor": 0, "numSms": 104, "warpSize": 64}, "mi250"),
    ({"name": "GPU-1234", "computeMajor": 9, "computeMinor": 0, "numSms": 132, "warpSize": 32}, "h100"),  # fingerprint
    ({"name": "Mystery", "computeMajor": 5, "computeMinor": 2, "numSms": 3, "warpSize": 32}, None),
])
def test_device_properties_name_the_profile(props, want):
    got = match_device(props)
    assert (got.name if got else None) == want


def test_device_block_is_checked():
    data = load_profile("a100").to_dict()
    data["device"] = {"names": ["A100"], "fingerprint": {"clock": 1}}
    with pytest.raises(ConfigError, match="device.fingerprint"):
        parse_profile(data, "x.yaml")
    data["device"] = {"names": "A100"}
    with pytest.raises(ConfigError, match="device.names"):
        parse_profile(data, "x.yaml")
    del data["sources"]["links.host"]
    data["device"] = {"names": ["A100"]}
    with pytest.raises(ConfigError, match="links.host"):
        parse_profile(data, "x.yaml")
