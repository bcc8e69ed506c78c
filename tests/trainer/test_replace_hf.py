"""Replacement plans on real transformers classes: identity, parity, training parity, errors."""
import pytest
import torch

from megaloom.models.hf_moe import build_model
from megaloom.models.plan import apply_config_plan, probe_logits
from megaloom.runtime.errors import ConfigError
from megaloom.models.swaps import MegaMoEBlock
from megaloom.train.trainer import Trainer

from .tiny import max_rel_err, tiny_config

MOE_GATE = [{"match": "model.layers.*.mlp", "with": "mega_moe", "options": {"gate": "mega_gate"}}]


def _snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}, [type(m) for m in model.modules()]


@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v3"])
def test_moe_blocks_become_megamoe_with_the_models_own_tensors(tmp_path, kind):
    cfg = tiny_config(tmp_path, kind, replace={"rules": MOE_GATE})
    model = build_model(cfg["model"], 0)
    with torch.no_grad():  # weights large enough for routing and outputs to matter
        for name, p in model.named_parameters():
            if ".mlp." in name:
                p.normal_(0, 0.3)
    params = {n: p for n, p in model.named_parameters()}
    keys = list(model.state_dict())
    want = probe_logits(model, 128, 16, seed=0)
    logs = []
    done = apply_config_plan(model, cfg, logs.append)
    blocks = [m for m in model.modules() if isinstance(m, MegaMoEBlock)]
    assert len(done) == len(blocks) == (2 if kind == "qwen3_moe" else 1)  # DeepSeek's layer 0 is dense
    assert {n: p for n, p in model.named_parameters()} == params  # same names, same Parameter objects
    assert all(params[n] is p for n, p in model.named_parameters())
    assert list(model.state_dict()) == keys
    assert type(blocks[0].gate).__name__ == "MegaGateRouter"
    assert max_rel_err(probe_logits(model, 128, 16, seed=0), want) < 1e-5
    assert any("transposed views, no copy" in line for line in logs)


def test_router_alone_becomes_megagate(tmp_path):
    cfg = tiny_config(tmp_path, replace={"rules": [{"match": "*.mlp.gate", "with": "mega_gate"}]})
    model = build_model(cfg["model"], 0)
    with torch.no_grad():
        model.model.layers[0].mlp.gate.weight.normal_(0, 1.0)
    weight = model.model.layers[0].mlp.gate.weight
    want = probe_logits(model, 128, 16, seed=0)
    apply_config_plan(model, cfg)
    gate = model.model.layers[0].mlp.gate
    assert type(gate).__name__ == "MegaGateRouter" and gate.weight is weight
    assert type(model.model.layers[0].mlp).__name__ == "Qwen3MoeSparseMoeBlock"  # the block itself stays
    assert max_rel_err(probe_logits(model, 128, 16, seed=0), want) < 1e-5


def test_plan_errors_are_all_listed_and_leave_the_model_untouched(tmp_path):
    rules = [
        {"match": "model.layers.*.mlpp", "with": "mega_moe"},                         # glob matches nothing
        {"match": "model.layers.*.self_attn", "with": "mega_moe"},                    # wrong module type
        {"match": "*.mlp.gate", "type": "DeepseekV3MoE", "with": "mega_gate"},      # type the target can't take
        {"match": "*.mlp", "type": "Qwen3MoeSparseMoeBlock", "with": "mega_moe"},    # type the model lacks
        {"match": "*.mlp", "with": "mega_moe", "options": {"gates": 1}, "extra": 1},  # unknown option / key
        {"match": "*.mlp", "with": "megamoe"},                                        # unknown target
        {"match": "*.self_attn", "with": "mega_gate"},                                # no router there
    ]
    cfg = tiny_config(tmp_path, "deepseek_v3", replace={"rules": rules},
                      low_precision={"format": "mxfp8", "include": ["*.self_attn.*"]})
    model = build_model(cfg["model"], 0)
    state, types = _snapshot(model)
    with pytest.raises(ConfigError) as e:
        apply_config_plan(model, cfg)
    msg = str(e.value)
    for part in ["include glob 'model.layers.*.mlpp' matches no DeepseekV3MoE module",
                 "include glob 'model.layers.*.self_attn' matches no DeepseekV3MoE module",
                 "replace.rules[2].type: 'DeepseekV3MoE' cannot become MegaGate (router as graphs): it is not an MoE router",
                 "replace.rules[3]: the model has no module of type Qwen3MoeSparseMoeBlock for mega_moe",
                 "replace.rules[4].options: unknown option 'gates' for mega_moe; allowed: gate,",
                 "replace.rules[4]: unknown key 'extra'",
                 "replace.rules[5].with: got 'megamoe', expected one of 'mega_moe', 'mega_gate'",
                 "include glob '*.self_attn' matches no DeepseekV3TopkRouter module"]:
        assert part in msg, part
    after, after_types = _snapshot(model)
    assert after_types == types and all(torch.equal(state[k], after[k]) for k in state)


def test_odd_sized_linears_are_skipped_and_listed_not_refused(tmp_path):
    cfg = tiny_config(tmp_path, "deepseek_v3", low_precision={"format": "mxfp8", "include": ["*.self_attn.*"]})
    model = build_model(cfg["model"], 0)
    logs = []
    apply_config_plan(model, cfg, logs.append)
    attn = model.model.layers[0].self_attn
    assert type(attn.q_proj).__name__ == "MXFP8Linear" and type(attn.kv_a_proj_with_mqa).__name__ == "Linear"
    kept = next(line for line in logs if "kept in high precision" in line)
    assert "model.layers.0.self_attn.kv_a_proj_with_mqa (out_features=24 is not a multiple of 32)" in kept


def test_training_with_replace_matches_training_without(tmp_path):
    base = [r.loss for r in Trainer(tiny_config(tmp_path / "a", steps=3)).fit()]
    swapped = [r.loss for r in Trainer(tiny_config(tmp_path / "b", steps=3, replace={"rules": MOE_GATE})).fit()]
    assert swapped == pytest.approx(base, rel=1e-5)


@pytest.mark.slow
def test_mxfp8_training_stays_within_the_documented_bound(tmp_path):
    base = [r.loss for r in Trainer(tiny_config(tmp_path / "a", steps=2)).fit()]
    logs = []
    mx = Trainer(tiny_config(tmp_path / "b", steps=2, low_precision={"format": "mxfp8"}), log=logs.append)
    assert any("8 Linear now MXFP8" in line for line in logs)
    losses = [r.loss for r in mx.fit()]
    assert losses == pytest.approx(base, rel=1e-2) and losses != base  # documented: 1% on the tiny model


def test_low_precision_selects_megamoe_experts(tmp_path):
    base = [r.loss for r in Trainer(tiny_config(tmp_path / "a", steps=3)).fit()]
    logs = []
    lp = {"format": "mxfp8", "include": ["*.mlp.experts"]}  # only the routed experts' GEMMs
    mx = Trainer(tiny_config(tmp_path / "b", steps=3, replace={"rules": MOE_GATE}, low_precision=lp), log=logs.append)
    assert any("2 FusedExperts now MXFP8" in line for line in logs)
    block = mx.model.model.layers[0].mlp
    assert block.experts.mx == "floor" and any(p is block.experts.gate_up_proj for p in mx.model.parameters())
    losses = [r.loss for r in mx.fit()]
    ops = {e.tags.get("kernel", e.op) for t in block.runner.last_trace.values() for e in t.events}  # moe_dyn: its op
    assert "mx_grouped_matmul" in ops and "moe_gmm" not in ops and "moe_wgrad" not in ops
    assert losses == pytest.approx(base, rel=1e-2) and losses != base  # measured 1.1e-4 over 8 steps
