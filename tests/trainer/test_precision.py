"""Precision of swapped models: bfloat16 runs with default settings, .to(dtype) after the swap, autocast."""
import copy

import pytest
import torch

from megaloom.models.hf_moe import build_model
from megaloom.models.plan import apply_config_plan, probe_logits
from megaloom.train.trainer import Trainer

from .tiny import QWEN3_MOE, max_rel_err, tiny_config

MOE_GATE = [{"match": "model.layers.*.mlp", "with": "mega_moe", "options": {"gate": "mega_gate"}}]


@pytest.mark.slow
def test_bfloat16_training_tracks_the_transformers_model_with_default_settings(tmp_path):
    bf16 = {"dtype": "bfloat16"}
    base = [r.loss for r in Trainer(tiny_config(tmp_path / "a", steps=20, model=bf16)).fit()]
    logs = []
    swapped = Trainer(tiny_config(tmp_path / "b", steps=20, model=bf16, replace={"rules": MOE_GATE}), log=logs.append)
    assert any("bound 0.02 in bfloat16" in line for line in logs)  # the default check, passed
    losses = [r.loss for r in swapped.fit()]
    assert losses[-1] < 0.9 * losses[0]  # it learns
    assert max(abs(a - b) / a for a, b in zip(base, losses)) < 0.01  # measured 4e-4


def _swapped(tmp_path):
    cfg = tiny_config(tmp_path, replace={"rules": MOE_GATE})
    model = build_model(cfg["model"], 0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".mlp." in name:
                p.normal_(0, 0.3)
    swapped = copy.deepcopy(model)
    apply_config_plan(swapped, cfg, log=lambda _: None)
    return model, swapped


def test_to_bfloat16_after_the_swap(tmp_path):
    model, swapped = _swapped(tmp_path)
    model.to(torch.bfloat16)
    swapped.to(torch.bfloat16)
    assert max_rel_err(probe_logits(swapped, 128, 16, 0), probe_logits(model, 128, 16, 0)) < 2e-2


def test_autocast_on_a_float32_model(tmp_path):
    model, swapped = _swapped(tmp_path)
    exact = probe_logits(model, 128, 16, 0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, theirs = probe_logits(swapped, 128, 16, 0), probe_logits(model, 128, 16, 0)
    # autocast's own error: the transformers model measured 3.9e-2 off its float32 logits, the swapped one 1.9e-2
    assert 1e-3 < max_rel_err(got, exact) < max_rel_err(theirs, exact)


@pytest.mark.slow
def test_autocast_and_compile_keys(tmp_path):
    """``model.autocast`` trains under torch.autocast; ``model.compile`` compiles every decoder layer (aot_eager
    and dense layers here: inductor builds C++ for minutes on a CPU, and the routing of transformers' MoE
    blocks recompiles) and trains like eager."""
    dense = {"config": {**QWEN3_MOE, "mlp_only_layers": [0, 1]}}
    eager = [r.loss for r in Trainer(tiny_config(tmp_path / "a", steps=2, model=dense)).fit()]
    compiled = Trainer(tiny_config(tmp_path / "b", steps=2, model={**dense, "compile": "aot_eager"}))
    layers = compiled.base_model.model.layers
    assert all(layer._compiled_call_impl is not None for layer in layers)
    assert [r.loss for r in compiled.fit()] == pytest.approx(eager, rel=1e-5)
    autocast = [r.loss for r in Trainer(tiny_config(tmp_path / "c", steps=2, model={**dense, "autocast": "bfloat16"})).fit()]
    assert autocast != eager and autocast == pytest.approx(eager, rel=2e-2)
