import os

import pytest
import yaml

from megaloom.runtime.errors import ConfigError
from megaloom.scheduler import HardwareProfile, list_profiles, load_profile
from megaloom.scheduler.profile import PACKAGED_DIR, read_profile

PACKAGED = ["ascend-910b", "atlas-a3", "ascend-950", "h100", "h200", "cpu"]


def good() -> dict:
    return yaml.safe_load((PACKAGED_DIR / "ascend-910b.yaml").read_text())


def write(tmp_path, data, name="p.yaml") -> str:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return str(path)


@pytest.mark.parametrize("name", PACKAGED)
def test_packaged_profiles_load_with_sources(name):
    p = load_profile(name)
    assert isinstance(p, HardwareProfile) and p.name == name
    assert set(p.units) >= {"cube", "vector", "comm"}
    assert p.peak("cube", "bf16") >= p.peak("vector", "bf16") > 0
    assert p.mem_bw > 0 and p.link("inter")[1] < p.link("intra")[1]
    assert all(p.sources[k] for k in ("units", "peak.cube", "mem_bw", "links.intra", "task_overhead"))


def test_list_profiles_names_every_packaged_one():
    assert set(PACKAGED) <= set(list_profiles())


def test_figures_of_910b_and_950():
    p = load_profile("ascend-910b")
    assert p.units["cube"] == 24 and p.units["vector"] == 48
    assert p.mem_bw == pytest.approx(1.6e12)
    assert p.unit_peak("cube", "fp16") == pytest.approx(p.peak("cube", "fp16") / 24)
    assert p.unit_mem_bw("vector") == pytest.approx(1.6e12 / 48)
    q = load_profile("ascend-950")
    assert q.peak("cube", "mxfp8") == pytest.approx(1e15)
    assert q.peak("cube", "mxfp8") > q.peak("cube", "bf16")


def test_precision_fallback():
    p = load_profile("ascend-910b")  # no fp8 or mxfp8 figure
    assert p.peak("cube", "mxfp8") == p.peak("cube", "bf16")
    assert load_profile("h100").peak("cube", "mxfp8") == load_profile("h100").peak("cube", "fp8")
    with pytest.raises(ConfigError, match="unknown precision 'int3'"):
        p.peak("cube", "int3")
    with pytest.raises(ConfigError, match="no peak rates for engine 'comm'"):
        p.peak("comm", "fp32")
    with pytest.raises(ConfigError, match="no link 'pcie'"):
        p.link("pcie")


def test_load_by_path_and_user_dir_precedence(tmp_path):
    d = good()
    d["units"]["cube"] = 7
    assert load_profile(write(tmp_path, d)).units["cube"] == 7
    user = tmp_path / "profiles"  # MEGALOOM_PROFILE_DIR (conftest)
    user.mkdir()
    write(user, d, "ascend-910b.yaml")
    assert load_profile("ascend-910b").units["cube"] == 7
    os.unlink(user / "ascend-910b.yaml")
    assert load_profile("ascend-910b").units["cube"] == 24


def _broken(key_path, value):
    d = good()
    node = d
    *head, last = key_path
    for k in head:
        node = node[k]
    if value is KeyError:
        del node[last]
    else:
        node[last] = value
    return d


@pytest.mark.parametrize("key_path,value,message", [
    (("mem_bw",), KeyError, "missing key 'mem_bw'"),
    (("mem_bw",), "fast", "key 'mem_bw' must be a number"),
    (("mem_bw",), -1.0, "key 'mem_bw' must be a positive"),
    (("units", "cube"), 0, "key 'units.cube' must be a positive integer"),
    (("peak", "cube", "fp16"), "x", "key 'peak.cube.fp16' must be a number"),
    (("peak", "cube", "int4"), 1.0, "key 'peak.cube.int4' is not a known precision"),
    (("peak", "dsp"), {"fp32": 1.0}, "key 'peak.dsp' names an engine missing"),
    (("links", "inter"), KeyError, "key 'links.inter' must be a non-empty mapping"),
    (("links", "intra", "beta"), KeyError, "missing key 'links.intra.beta'"),
    (("sources", "mem_bw"), KeyError, "missing source text 'sources.mem_bw'"),
    (("task_overhead",), True, "key 'task_overhead' must be a number"),
])
def test_bad_profile_names_file_and_key(tmp_path, key_path, value, message):
    path = write(tmp_path, _broken(key_path, value))
    with pytest.raises(ConfigError, match=message) as e:
        read_profile(path)
    assert path in str(e.value)


def test_unreadable_or_non_yaml_or_unknown(tmp_path):
    with pytest.raises(ConfigError, match="cannot read profile"):
        load_profile(str(tmp_path / "missing.yaml"))
    with pytest.raises(ConfigError, match="not valid YAML"):
        read_profile(write(tmp_path, "units: [1, 2\n"))
    with pytest.raises(ConfigError, match="must be a non-empty mapping"):
        read_profile(write(tmp_path, "- 1\n"))
    with pytest.raises(ConfigError, match="unknown hardware profile 'tpu9'.*h100"):
        load_profile("tpu9")


def test_to_dict_round_trips(tmp_path):
    p = load_profile("h200")
    q = load_profile(write(tmp_path, p.to_dict()))
    assert (q.units, q.peaks, q.mem_bw, q.links, q.task_overhead, q.sources) == \
        (p.units, p.peaks, p.mem_bw, p.links, p.task_overhead, p.sources)
