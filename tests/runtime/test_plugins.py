"""The one registry and the one ``name:k=v`` spec syntax."""
import pytest

from megaloom.runtime.errors import ConfigError, GraphError
from megaloom.runtime.plugins import Registry, parse_options, parse_spec


def test_registry_registers_gets_and_names_unknowns():
    reg: Registry[int] = Registry("widget")
    reg.register("b", 2)

    @reg.register("a")
    def a():
        return 1

    assert reg.get("a") is a and reg.get("b") == 2 and reg.names() == ["a", "b"] and "a" in reg
    with pytest.raises(ConfigError, match="unknown widget 'c'; known: a, b"):
        reg.get("c")
    with pytest.raises(ConfigError, match="widget 'b' is already registered"):
        reg.register("b", 3)
    reg.register("b", 3, replace=True)
    assert reg.get("b") == 3


def test_registry_loads_entry_point_plugins_and_uses_its_error():
    builders = Registry("graph builder", "megaloom.graph_builders", error=GraphError)
    assert {"megamoe", "megagate", "megamhc"} <= set(builders.names())
    assert callable(builders.get("megamoe"))
    with pytest.raises(GraphError, match="unknown graph builder 'nope'"):
        builders.get("nope")


def test_parse_spec():
    assert parse_spec("megamoe:tokens=64, ep=2,x=1.5,on=true,name=a") == (
        "megamoe", {"tokens": 64, "ep": 2, "x": 1.5, "on": True, "name": "a"})
    assert parse_spec("fifo") == ("fifo", {})
    assert parse_options("0=1.5,1=2") == {"0": 1.5, "1": 2}
    for bad in ("", ":a=1", "x:a", "x:=1"):
        with pytest.raises(ConfigError):
            parse_spec(bad)


def test_executors_by_name():
    from megaloom.runtime.executors import EXECUTORS, ReferenceExecutor, ThreadExecutor

    assert EXECUTORS.get("reference") is ReferenceExecutor
    assert EXECUTORS.get("threaded") is EXECUTORS.get("thread") is ThreadExecutor
    with pytest.raises(ConfigError, match="unknown executor 'cuda'; known: reference, thread, threaded"):
        EXECUTORS.get("cuda")


def test_ops_and_policies_use_the_registry_error():
    from megaloom.runtime.registry import get_op
    from megaloom.scheduler import make_policy

    with pytest.raises(GraphError, match="unknown op 'nope'; known: .*matmul"):
        get_op("nope")
    with pytest.raises(ConfigError, match="unknown policy 'lifo'; known: critical_path, expert_interleave, fifo"):
        make_policy("lifo")


def test_profiles_are_a_registry_view_of_the_folders(tmp_path, monkeypatch):
    from megaloom.scheduler.profile import PACKAGED_DIR, load_profile, profile_files

    monkeypatch.setenv("MEGALOOM_PROFILE_DIR", str(tmp_path))
    (tmp_path / "cpu.yaml").write_text((PACKAGED_DIR / "cpu.yaml").read_text().replace("name: cpu", "name: mycpu"))
    files = profile_files()
    assert files.get("cpu") == tmp_path / "cpu.yaml" and files.get("h100") == PACKAGED_DIR / "h100.yaml"
    assert load_profile("cpu").name == "mycpu"
    with pytest.raises(ConfigError, match="unknown hardware profile 'tpu9'; known: .*h100"):
        load_profile("tpu9")
