"""Every transformers MoE family swaps by structure (no block type in the rule) and equals the unmodified
model: logits and every parameter's gradient, with the model's router and with MegaGate; the families
megaloom does not swap train as they are, their FLOPs counted from shapes."""
import copy

import pytest
import torch

from megaloom.models.hf_moe import build_model
from megaloom.models.plan import apply_config_plan
from megaloom.models.swaps import MegaMoEBlock
from megaloom.train.config import validate

from megaloom.runtime.errors import ConfigError
from megaloom.train.trainer import Trainer

from .tiny import FAMILIES, QWEN2_MOE, UNSWAPPED, WIDENED, available, max_rel_err, tiny_config, tiny_raw

TOL = 1e-5  # float32: max |diff| / max |reference|, for logits and for each parameter's gradient


def _rule(gate, match="model.layers.*.mlp"):
    return {"rules": [{"match": match, "with": "mega_moe", "options": {"gate": gate}}]}


def _loss_and_grads(model, tokens):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)  # routers that sample (PhiMoE's in training) draw alike
    logits = model(input_ids=tokens[:, :-1], use_cache=False).logits
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters()}


def _compare(model, swapped, tokens):
    want, want_g = _loss_and_grads(model, tokens)
    got, got_g = _loss_and_grads(swapped, tokens)
    assert max_rel_err(got, want) < TOL
    assert set(got_g) == set(want_g)
    worst = max((max_rel_err(got_g[n], g), n) for n, g in want_g.items() if g is not None and g.abs().max() > 0)
    assert worst[0] < TOL, worst
    assert all((got_g[n] is None) == (g is None) for n, g in want_g.items())


CASES = [(k, g) for k in sorted(FAMILIES) + available(WIDENED) for g in ("hf", "mega_gate")
         if (k, g) != ("phimoe", "mega_gate")]  # PhiMoE's sampled routing is no MegaGate setting


@pytest.mark.parametrize("kind,gate", CASES)
def test_family_matches_the_unmodified_model(tmp_path, kind, gate):
    cfg = tiny_config(tmp_path, kind, replace=_rule(gate, "model.layers.*"))
    model = build_model(cfg["model"], 0)
    with torch.no_grad():  # weights large enough for routing and outputs to matter
        for name, p in model.named_parameters():
            if ".mlp." in name or ".feed_forward." in name:
                p.normal_(0, 0.3)
    swapped = copy.deepcopy(model)
    apply_config_plan(swapped, cfg, log=lambda _: None)
    blocks = [m for m in swapped.modules() if isinstance(m, MegaMoEBlock)]
    assert len(blocks) == (1 if kind == "deepseek_v3" else 2)  # DeepSeek's layer 0 is dense
    assert (type(getattr(blocks[0], blocks[0].router_name)).__name__ == "MegaGateRouter") == (gate == "mega_gate")
    tokens = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(3))
    _compare(model, swapped, tokens)


def test_local_model_swaps_with_a_rule_that_names_no_type(tmp_path):
    src = build_model(tiny_config(tmp_path, "qwen2_moe")["model"], 0)
    src.save_pretrained(tmp_path / "qwen2")
    raw = tiny_raw(tmp_path / "run", "qwen2_moe", replace=_rule("mega_gate"))
    raw["model"] = {"kind": "path", "path": str(tmp_path / "qwen2")}
    cfg = validate(raw)
    model = build_model(cfg["model"], 0)
    logs = []
    done = apply_config_plan(model, cfg, logs.append)
    assert [r.path for r in done] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert all(type(r.old).__name__ == "Qwen2MoeSparseMoeBlock" for r in done)
    assert any("logits after replacing 2 module(s)" in line for line in logs)
    assert QWEN2_MOE["shared_expert_intermediate_size"] == model.model.layers[0].mlp.shared_expert.up_proj.out_features


@pytest.mark.parametrize("kind", available(UNSWAPPED))
def test_families_megaloom_does_not_swap_train_as_they_are(tmp_path, kind):
    """Their FLOPs are counted from shapes; a mega_moe rule is refused naming what is not understood."""
    records = Trainer(tiny_config(tmp_path / "run", kind, steps=2, replace={"rules": []})).fit()
    assert all(torch.isfinite(torch.tensor(r.loss)) and r.mfu > 0 for r in records)
    with pytest.raises(ConfigError, match="replacement plan is invalid") as e:
        Trainer(tiny_config(tmp_path / "swap", kind, replace=_rule("hf", "*")))
    assert "not one megaloom understands" in str(e.value) or "no 'experts' child" in str(e.value) \
        or "are not [E, 2I, H] and [E, H, I]" in str(e.value)
