"""Bad trainer configs and CLI options are named megaloom errors, before any work is done."""
from __future__ import annotations

import os

import pytest

from megaloom.cli import main
from megaloom.train.config import load_config, validate
from megaloom.runtime.errors import ConfigError
from megaloom.train.trainer import Trainer

from .tiny import tiny_config, tiny_raw


def test_non_utf8_config_file(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_bytes(b"run:\n  seed: \xff\xfe\n")
    with pytest.raises(ConfigError, match="not UTF-8 text"):
        load_config(p)


@pytest.mark.parametrize("section, key, value, needle", [
    ("run", "seed", 2**70, "run.seed: got 1180591620717411303424, must be within"),
    ("run", "seed", -1, "run.seed"),
    ("optimizer", "lr", float("inf"), "optimizer.lr: got inf, numbers must be finite"),
    ("optimizer", "weight_decay", float("nan"), "numbers must be finite"),
    ("parallel", "timeout_s", float("inf"), "parallel.timeout_s"),
    ("model", "config", {"hidden_size": 64, "rope_theta": float("inf")}, "rope_theta is inf"),
])
def test_non_finite_and_out_of_range_numbers(tmp_path, section, key, value, needle):
    with pytest.raises(ConfigError, match=needle):
        validate(tiny_raw(tmp_path, **{section: {key: value}}))


def test_model_config_value_of_the_wrong_type(tmp_path):
    with pytest.raises(ConfigError, match="model.config: Qwen3MoeConfig rejected the values"):
        Trainer(tiny_config(tmp_path, model={"config": {"hidden_size": "abc"}}))


def test_empty_data_file(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ConfigError, match="has no documents with tokens in it"):
        Trainer(tiny_config(tmp_path, data={"source": "files", "path": str(empty)}, model={"config": {"vocab_size": 256}}))


def test_unwritable_out_dir_before_any_work(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="run.out_dir: cannot create directory"):
        Trainer(tiny_config(tmp_path / "file" / "run"))
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(ConfigError, match="not writable"):
            Trainer(tiny_config(ro))


def test_calibrate_refuses_escaping_names_and_unwritable_outputs(tmp_path, capsys):
    import dataclasses

    from megaloom.scheduler.calibrate import write_profile
    from megaloom.scheduler.profile import load_profile

    for name in ("../../escape", "/etc/cron.d/x", ".hidden"):
        with pytest.raises(ConfigError, match="not a plain file name"):
            write_profile(dataclasses.replace(load_profile("cpu"), name=name))
    (tmp_path / "file").write_text("")
    assert main(["calibrate", "--seconds", "0", "--matmul-size", "8", "--copy-mib", "1",
                 "--out", str(tmp_path / "file" / "p.yaml")]) == 2
    assert "cannot write profile" in capsys.readouterr().err


def test_simulate_refuses_absurd_unit_counts(tmp_path, capsys):
    from megaloom.runtime import TaskGraph

    g = TaskGraph("g")
    g.task("noop")
    g.save(tmp_path / "g.mlg")
    assert main(["simulate", str(tmp_path / "g.mlg"), "--units", "cube=1000000000"]) == 2
    assert "at most 65536" in capsys.readouterr().err
