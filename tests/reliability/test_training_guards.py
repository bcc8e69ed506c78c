"""Training never keeps only NaN checkpoints, and never wipes a previous run: a non-finite loss or
gradient stops the run (or skips the update), a non-finite state is never saved, an out_dir holding a
run is refused unless resumed or overwritten, and a resume after a kill leaves no duplicate records."""
import json
import time

import pytest
import torch
import yaml

from megaloom.cli import main
from megaloom.runtime.errors import ConfigError, ExecutionError
from megaloom.train.trainer import Trainer
from tests.trainer.tiny import tiny_config, tiny_raw


def _checkpoints(out):
    return sorted(p.name for p in (out / "checkpoints").glob("step_*"))


def _finite_checkpoint(step_dir) -> bool:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(step_dir), str(step_dir.parent / "full.pt"))
    state = torch.load(step_dir.parent / "full.pt", weights_only=True)
    return all(torch.isfinite(t).all() for t in _tensors(state))


def _tensors(state):
    for v in state.values():
        yield from (_tensors(v) if isinstance(v, dict) else [v] if torch.is_tensor(v) and v.is_floating_point() else [])


def _metric_steps(out):
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_nan_loss_stops_the_run_before_anything_is_saved(tmp_path, capsys):
    """lr 1e30 without clipping: the weights reach 1e30 at step 1 (finite, saved), the loss is NaN at step 2."""
    raw = tiny_raw(tmp_path / "out", steps=4, optimizer={"lr": 1e30, "grad_clip": 0},
                   schedule={"warmup_steps": 0}, checkpoint={"interval": 1})
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    assert main(["train", str(tmp_path / "c.yaml")]) == 2
    err = capsys.readouterr().err
    assert "step 2: loss nan" in err and "not finite; stopped before the update" in err
    assert _checkpoints(tmp_path / "out") == ["step_00000001"]
    assert _finite_checkpoint(tmp_path / "out" / "checkpoints" / "step_00000001")


def test_skip_mode_skips_non_finite_steps_and_saves_finite_states(tmp_path):
    cfg = tiny_config(tmp_path, steps=4, optimizer={"lr": 1e30, "grad_clip": 0}, schedule={"warmup_steps": 0},
                      run={"on_nonfinite": "skip"}, checkpoint={"interval": 1})
    records = Trainer(cfg).fit()
    assert [r.skipped for r in records] == [False, True, True, True]
    assert _checkpoints(tmp_path) == ["step_00000003", "step_00000004"]
    assert all(_finite_checkpoint(tmp_path / "checkpoints" / name) for name in _checkpoints(tmp_path))


def test_a_non_finite_state_is_never_saved_and_good_checkpoints_stay(tmp_path):
    """An update that overflows a weight to inf (finite loss and gradients): that state is refused, the last
    good checkpoint kept."""
    Trainer(tiny_config(tmp_path, steps=4, checkpoint={"interval": 1, "stop_after": 2})).fit()
    bad = Trainer(tiny_config(tmp_path, steps=4, checkpoint={"interval": 1, "resume": True}))
    update = bad.optimizer.step

    def overflowing_update():
        update()
        with torch.no_grad():
            bad.model.lm_head.weight[0, 0] = float("inf")

    bad.optimizer.step = overflowing_update
    with pytest.raises(ExecutionError, match=r"step 3: the model or optimizer state holds NaN or inf values; not saved"):
        bad.fit()
    assert _checkpoints(tmp_path) == ["step_00000001", "step_00000002"]
    assert json.loads((tmp_path / "checkpoints" / "latest.json").read_text())["step"] == 2
    resumed = Trainer(tiny_config(tmp_path, steps=4, checkpoint={"interval": 1, "resume": True}))
    assert resumed.step == 2  # the run goes on from the last good checkpoint


def test_a_second_run_into_an_out_dir_is_refused_unless_resumed_or_overwritten(tmp_path):
    Trainer(tiny_config(tmp_path, steps=3, checkpoint={"interval": 1})).fit()
    with pytest.raises(ConfigError, match="run.out_dir: .* holds a previous run .*resume it .*overwrite it"):
        Trainer(tiny_config(tmp_path, steps=2))
    assert _metric_steps(tmp_path) == [1, 2, 3] and _checkpoints(tmp_path) == ["step_00000002", "step_00000003"]
    Trainer(tiny_config(tmp_path, steps=1, run={"overwrite": True})).fit()
    assert _metric_steps(tmp_path) == [1] and _checkpoints(tmp_path) == ["step_00000001"]
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 1


def test_a_resume_after_a_kill_leaves_no_duplicate_records(tmp_path, monkeypatch):
    """Killed after step 3 (checkpoint at 2): the resumed run writes 3 again, once, in metrics and TensorBoard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = tiny_config(tmp_path, steps=5, checkpoint={"interval": 2})
    trainer = Trainer(cfg)
    step = Trainer.train_step

    def killed(self):
        if self.step == 3:
            raise KeyboardInterrupt
        return step(self)

    monkeypatch.setattr(Trainer, "train_step", killed)
    with pytest.raises(KeyboardInterrupt):
        trainer.fit()
    monkeypatch.undo()
    assert _metric_steps(tmp_path) == [1, 2, 3]
    time.sleep(1.1)  # TensorBoard orders event files by name: the second's first, then pid and a counter
    records = Trainer(tiny_config(tmp_path, steps=5, checkpoint={"interval": 2, "resume": True})).fit()
    assert [r.step for r in records] == [3, 4, 5]
    assert _metric_steps(tmp_path) == [1, 2, 3, 4, 5]
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3, 4, 5]
    assert events.Scalars("loss")[2].value == pytest.approx(records[0].loss)
