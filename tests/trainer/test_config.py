"""Config schema: defaults, every problem reported at once, overrides, files."""
import pytest

from megaloom.train.config import SCHEMA, load_config, parse_overrides, validate
from megaloom.runtime.errors import ConfigError


def test_defaults_fill_every_key():
    cfg = validate({})
    assert set(cfg) == set(SCHEMA)
    for section, keys in SCHEMA.items():
        assert set(cfg[section]) == set(keys)
    assert cfg["optimizer"]["name"] == "adamw" and cfg["parallel"]["ep_size"] == 1


def test_all_problems_listed_with_allowed_values():
    with pytest.raises(ConfigError) as e:
        validate({"optimizer": {"name": "lamb", "lr": -1, "betaz": 1}, "data": {"source": "web"},
                  "parallel": {"fsdp": "yes"}, "bogus": {}})
    msg = str(e.value)
    assert "optimizer.name: got 'lamb', expected one of 'adamw', 'sgd'" in msg
    assert "optimizer.lr: got -1, must be > 0" in msg
    assert "unknown key optimizer.betaz; allowed: name, lr," in msg
    assert "data.source: got 'web', expected one of 'synthetic', 'files'" in msg
    assert "parallel.fsdp: got 'yes', expected true/false" in msg
    assert "unknown section 'bogus'" in msg


def test_types_and_cross_checks():
    with pytest.raises(ConfigError, match=r"schedule.steps: got 2.5, expected an integer"):
        validate({"schedule": {"steps": 2.5}})
    with pytest.raises(ConfigError, match=r"run.log_interval: got True, expected an integer"):
        validate({"run": {"log_interval": True}})
    with pytest.raises(ConfigError, match=r"data.path: required when data.source is 'files'"):
        validate({"data": {"source": "files"}})
    with pytest.raises(ConfigError, match=r"trace.steps\[0\]: step 9 outside 1..5"):
        validate({"schedule": {"steps": 5}, "trace": {"steps": [9]}})
    assert validate({"optimizer": {"lr": 1}})["optimizer"]["lr"] == 1  # ints are numbers


def test_overrides_parse_yaml_and_nest():
    over = parse_overrides(["--optimizer.lr=0.01", "--model.config.hidden_size=32", "--trace.steps=[1, 2]",
                            "--checkpoint.resume=true"])
    assert over == {"optimizer": {"lr": 0.01}, "model": {"config": {"hidden_size": 32}},
                    "trace": {"steps": [1, 2]}, "checkpoint": {"resume": True}}
    for bad in ["optimizer.lr=1", "--lr=1", "--optimizer.lr"]:
        with pytest.raises(ConfigError, match="expected --section.key=value"):
            parse_overrides([bad])


def test_load_file_with_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("model:\n  config: {hidden_size: 64, num_experts: 8}\nreplace:\n  - {match: 'a.*', with: mega_moe}\n")
    cfg = load_config(f, ["--model.config.num_experts=4", "--schedule.steps=3"])
    assert cfg["model"]["config"] == {"hidden_size": 64, "num_experts": 4}
    assert cfg["schedule"]["steps"] == 3
    assert cfg["replace"]["rules"] == [{"match": "a.*", "with": "mega_moe"}]  # list shorthand
    with pytest.raises(ConfigError, match="unknown key schedule.step;"):
        load_config(f, ["--schedule.step=3"])
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("model: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(tmp_path / "bad.yaml")
