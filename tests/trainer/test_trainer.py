"""Single-process training: loss falls, resume is exact, traces and metrics are written."""
import json

import pytest

from megaloom.cli import main
from megaloom.train.config import validate
from megaloom.runtime.errors import ConfigError
from megaloom.runtime.trace import Trace
from megaloom.train.trainer import Trainer, lr_factor

from .tiny import tiny_config, tiny_raw


def _losses(cfg):
    return [r.loss for r in Trainer(cfg).fit()]


def test_loss_decreases_and_metrics_are_logged(tmp_path):
    cfg = tiny_config(tmp_path, steps=10, data={"batch_size": 8}, optimizer={"lr": 1e-2}, trace={"steps": [2]})
    losses = _losses(cfg)
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.5, losses  # measured: -1.0
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(1, 11))
    assert [r["loss"] for r in lines] == losses
    assert all(r["tokens"] == 8 * 16 and r["tokens_per_s"] > 0 and r["peak_mem_mib"] > 0 for r in lines)
    assert all(r["comm_s"] == 0 and 0 < r["mfu"] < 1 for r in lines)  # one process: no collectives
    trace = Trace.load(tmp_path / "traces" / "step2.rank0.trace")
    names = {e.task for e in trace.events}
    assert {"forward", "backward", "optimizer", "model.layers.1.mlp", "model.layers.1.mlp.bwd"} <= names
    mlp = next(e for e in trace.events if e.task == "model.layers.0.mlp")
    assert mlp.tags == {"direction": "fwd", "stage": "mlp", "layer": 0} and mlp.end >= mlp.start
    chrome = json.loads((tmp_path / "traces" / "step2.rank0.json").read_text())
    assert any(ev.get("name") == "model.layers.0.self_attn.bwd" for ev in chrome["traceEvents"])


@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v3"])
def test_resume_reproduces_uninterrupted_losses(tmp_path, kind, umask_027):
    full = _losses(tiny_config(tmp_path / "a", kind, steps=4, checkpoint={"interval": 1}))
    part = tiny_config(tmp_path / "b", kind, steps=4, checkpoint={"interval": 1, "stop_after": 2})
    first = _losses(part)
    assert len(first) == 2
    resumed = tiny_config(tmp_path / "b", kind, steps=4, checkpoint={"interval": 1, "resume": True})
    trainer = Trainer(resumed)
    assert trainer.step == 2
    rest = [r.loss for r in trainer.fit()]
    assert first + rest == full  # bit-exact
    steps = [json.loads(x)["step"] for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    kept = sorted(p.name for p in (tmp_path / "b" / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert kept == ["step_00000003", "step_00000004"]  # checkpoint.keep = 2
    umask_027(tmp_path)  # checkpoint folders and files, metrics, traces: as the umask says


def test_resume_errors(tmp_path):
    from megaloom.comm.checkpoint import EXTRA, CheckpointError

    with pytest.raises(ConfigError, match="not a checkpoint directory"):
        Trainer(tiny_config(tmp_path, checkpoint={"resume": str(tmp_path / "none")}))
    Trainer(tiny_config(tmp_path, steps=1)).fit()
    step_dir = tmp_path / "checkpoints" / "step_00000001"
    data = next(step_dir.glob("*.distcp"))
    good = data.read_bytes()
    data.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    with pytest.raises(CheckpointError, match="does not match its SHA-256"):
        Trainer(tiny_config(tmp_path, checkpoint={"resume": True}))
    data.write_bytes(good)
    (step_dir / EXTRA).write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match=f"file '{EXTRA}' has 7 bytes"):
        Trainer(tiny_config(tmp_path, checkpoint={"resume": str(step_dir)}))


def test_lr_schedule():
    s = validate({"schedule": {"steps": 10, "warmup_steps": 2, "decay": "linear", "min_lr_ratio": 0.1}})["schedule"]
    assert [lr_factor(i, s) for i in (0, 1, 2)] == [0.5, 1.0, 1.0]
    assert lr_factor(10, s) == pytest.approx(0.1)
    assert lr_factor(6, s) == pytest.approx(0.1 + 0.9 * 0.5)


def test_cli_train_and_errors(tmp_path, capsys):
    import yaml

    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump(tiny_raw(tmp_path / "out", steps=2)))
    assert main(["train", str(f), "--optimizer.lr=0.01", "--run.log_interval=2", "--plot"]) == 0
    out = capsys.readouterr().out
    assert "trained steps 1..2" in out and "plot of loss and throughput" in out
    assert (tmp_path / "out" / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["train", str(f), "--optimizer.name=lamb", "--data.seq_len=0"]) == 2
    err = capsys.readouterr().err
    assert "optimizer.name: got 'lamb', expected one of 'adamw', 'sgd'" in err and "data.seq_len: got 0" in err


def test_local_checkpoint_model_and_text_data(tmp_path):
    from megaloom.models.hf_moe import build_model

    from .tiny import QWEN3_MOE

    cfg = tiny_config(tmp_path, model={"config": {**QWEN3_MOE, "vocab_size": 256}})
    build_model(cfg["model"], seed=0).save_pretrained(tmp_path / "ckpt")  # a local "pretrained" model
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    raw = tiny_raw(tmp_path / "run", steps=1, data={"source": "files", "path": str(text)})
    raw["model"] = {"kind": "path", "path": str(tmp_path / "ckpt")}
    local = validate(raw)
    fresh = tiny_config(tmp_path / "run2", steps=1, model={"config": {**QWEN3_MOE, "vocab_size": 256}},
                        data={"source": "files", "path": str(text)})
    assert _losses(local) == _losses(fresh)  # same weights loaded from disk, same text batches
    with pytest.raises(ConfigError, match="is not a local directory"):
        Trainer(validate({**raw, "run": {"out_dir": str(tmp_path / "run3")},
                          "model": {"kind": "path", "path": str(tmp_path / "nope")}}))
    with pytest.raises(ConfigError, match="model.config: not used when model.kind is 'path'"):
        validate({**raw, "model": {"kind": "path", "path": "x", "config": {"hidden_size": 8}}})
