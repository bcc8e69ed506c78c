"""Checkpoints both ways with plain torch DCP (get_state_dict layout), and export to a Hugging Face directory."""
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from megaloom.cli import main
from megaloom.comm.checkpoint import CheckpointError
from megaloom.models.hf_moe import build_model
from megaloom.train.data import make_stream
from megaloom.train.interop import load_model, read_metadata
from megaloom.train.optim import make_optimizer
from megaloom.train.trainer import Trainer, causal_lm_loss

from .tiny import max_rel_err, tiny_config, tiny_raw, write_corpus

MOE_GATE = {"rules": [{"match": "model.layers.*.mlp", "with": "mega_moe", "options": {"gate": "mega_gate"}}]}


def _torch_side(cfg):
    """The plain transformers model and optimizer a torch user would build for ``cfg``."""
    model = build_model(cfg["model"], cfg["run"]["seed"])
    return model, make_optimizer(model, cfg["optimizer"])


def test_torch_loads_a_megaloom_checkpoint(tmp_path):
    cfg = tiny_config(tmp_path, steps=2, replace=MOE_GATE)
    trainer = Trainer(cfg)
    trainer.fit()
    model, opt = _torch_side(cfg)
    msd, osd = get_state_dict(model, opt)
    step = os.path.join(tmp_path, "checkpoints", "step_00000002")
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=step, planner=DefaultLoadPlanner(allow_partial_load=True))
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    mine = dict(trainer.model.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p, mine[name]), name
        st, ref = opt.state[p], trainer.optimizer.state[mine[name]]
        assert float(st["step"]) == 2 and torch.equal(st["exp_avg_sq"], ref["exp_avg_sq"]), name


def test_megaloom_resumes_from_a_torch_checkpoint(tmp_path):
    cfg = tiny_config(tmp_path / "torch", steps=4)
    model, opt = _torch_side(cfg)
    data = make_stream(cfg, 128, 0)
    for step in range(2):  # a torch training loop: constant lr, no clipping
        causal_lm_loss(model, data.batch(step, 0, 1)).backward()
        opt.step()
        opt.zero_grad()
    msd, osd = get_state_dict(model, opt)
    ckpt = tmp_path / "torch" / "ckpt"
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)
    with torch.no_grad():
        want = float(causal_lm_loss(model, data.batch(2, 0, 1)))
    logs = []
    resumed = Trainer(tiny_config(tmp_path / "mega", steps=4, replace=MOE_GATE, checkpoint={"resume": str(ckpt)}),
                      log=logs.append)
    assert resumed.step == 2 and any("resumed from" in line for line in logs)
    p = resumed.model.model.layers[0].mlp.experts.gate_up_proj
    assert torch.equal(resumed.optimizer.state[p]["exp_avg"], opt.state[model.model.layers[0].mlp.experts.gate_up_proj]["exp_avg"])
    records = resumed.fit()
    assert [r.step for r in records] == [3, 4] and records[0].loss == pytest.approx(want, rel=1e-5)
    assert torch.equal(load_model(tiny_config(tmp_path / "x"), str(ckpt)).lm_head.weight, model.lm_head.weight)


def test_torch_metadata_is_never_unpickled_freely(tmp_path):
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    (tmp_path / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(CheckpointError, match="posix.system is not a DCP metadata type"):
        read_metadata(str(tmp_path))
    assert not marker.exists()
    with pytest.raises(CheckpointError, match="no checkpoint there|not DCP metadata"):
        Trainer(tiny_config(tmp_path / "run", checkpoint={"resume": str(tmp_path)}))
    assert not marker.exists()


def test_export_hf_loads_with_from_pretrained_and_identical_logits(tmp_path, capsys):
    import yaml
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, tokenizer = write_corpus(tmp_path)
    raw = tiny_raw(tmp_path / "run", "deepseek_v3", steps=2, replace=MOE_GATE, data={"tokenizer": tokenizer})
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump(raw))
    assert main(["train", str(f)]) == 0
    trainer = Trainer(tiny_config(tmp_path / "run", "deepseek_v3", steps=2, replace=MOE_GATE,
                                  checkpoint={"resume": True}))
    assert main(["export", str(f), "--hf", str(tmp_path / "hf")]) == 0
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = trainer.model.eval()(input_ids=ids, use_cache=False).logits
        got = hf(input_ids=ids, use_cache=False).logits
    assert type(hf).__name__ == "DeepseekV3ForCausalLM" and max_rel_err(got, want) < 1e-5
    exported = AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True)  # the tokenizer beside it
    assert exported.encode("the lazy dog") == AutoTokenizer.from_pretrained(tokenizer).encode("the lazy dog")
    with torch.no_grad():  # the plain model on the checkpoint's weights: the very same logits
        assert torch.equal(load_model(trainer.cfg, None)(input_ids=ids, use_cache=False).logits, got)
    assert main(["export", str(f), "--hf", str(tmp_path / "hf")]) == 2  # never over an existing export
    assert "exists and is not an empty directory" in capsys.readouterr().err
