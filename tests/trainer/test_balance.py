"""MoE load balancing: the auxiliary loss (as transformers computes it) on every router kind, the
aux-loss-free correction-bias update, and the per-expert load in the metrics."""
import copy

import pytest
import torch

from megaloom.models.hf_moe import build_model
from megaloom.models.plan import apply_config_plan
from megaloom.runtime.errors import ConfigError
from megaloom.train.balance import Balance
from megaloom.train.trainer import Trainer

from .tiny import QWEN3_MOE, tiny_config

ROUTED = {"config": {**QWEN3_MOE, "output_router_logits": True, "router_aux_loss_coef": 0.5}}
MEGA_GATE = {"rules": [{"match": "model.layers.*.mlp", "with": "mega_moe", "options": {"gate": "mega_gate"}}]}


@pytest.mark.parametrize("swap", [None, "mega_gate"])
def test_aux_loss_is_transformers_load_balancing_loss(tmp_path, swap):
    cfg = tiny_config(tmp_path, model=ROUTED, **({"replace": MEGA_GATE} if swap else {}))
    model = build_model(cfg["model"], 0)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    want = model(input_ids=tokens, use_cache=False).aux_loss  # transformers' own, unswapped
    balance = Balance(cfg["moe"], model.config)
    if swap:
        apply_config_plan(model, cfg, log=lambda _: None)
    balance.attach(model)
    assert balance.mode == "aux_loss" and balance.coef == 0.5 and not model.config.output_router_logits
    balance.forward()
    model(input_ids=tokens, use_cache=False)  # no IndexError inside transformers with MegaGate routers
    got = balance.aux_loss()
    assert got.item() == pytest.approx(want.item(), rel=1e-5)
    got.backward()  # differentiable through either router kind
    assert all(model.model.layers[i].mlp.gate.weight.grad.abs().sum() > 0 for i in range(2))


def test_aux_loss_trains_and_is_logged_with_the_expert_load(tmp_path):
    plain = Trainer(tiny_config(tmp_path / "a", steps=3, moe={"balance": "none"}, model=ROUTED)).fit()
    aux = Trainer(tiny_config(tmp_path / "b", steps=3, model=ROUTED)).fit()  # auto: output_router_logits
    swapped = Trainer(tiny_config(tmp_path / "c", steps=3, model=ROUTED, replace=MEGA_GATE)).fit()
    assert plain[0].loss == aux[0].loss and plain[1].loss != aux[1].loss  # the aux loss changes the update
    assert [r.loss for r in swapped] == pytest.approx([r.loss for r in aux], rel=1e-5)
    assert plain[0].aux_loss is None and aux[0].aux_loss == pytest.approx(swapped[0].aux_loss, rel=1e-5)
    assert aux[0].aux_loss >= 2  # top-2: 2 when perfectly balanced
    for load in aux[0].expert_load:  # each layer's share of the step's routed tokens, per expert
        assert len(load) == 8 and sum(load) == pytest.approx(1, abs=1e-3)


@pytest.mark.parametrize("gate", ["hf", "mega_gate"])
def test_bias_update_moves_the_correction_bias_towards_balance(tmp_path, gate):
    rules = {"rules": [{"match": "model.layers.*.mlp", "with": "mega_moe", "options": {"gate": gate}}]}
    trainer = Trainer(tiny_config(tmp_path, "deepseek_v3", steps=2, moe={"balance": "bias", "bias_rate": 0.01},
                                  replace=rules))
    router = trainer.base_model.model.layers[1].mlp.gate
    bias = router.e_score_correction_bias
    before = bias.clone()
    rec = trainer.train_step()
    load = torch.tensor(rec.expert_load[0], dtype=torch.float64)
    assert torch.equal(bias - before, (0.01 * torch.sign(1 / 8 - load)).float())  # +rate below the mean load
    if gate == "mega_gate":
        assert router.bias is bias  # MegaGate routes with the very tensor the update moves
    state = copy.deepcopy(trainer.base_model.state_dict())
    assert torch.equal(state["model.layers.1.mlp.gate.e_score_correction_bias"], bias)  # checkpointed


def test_balance_errors(tmp_path):
    with pytest.raises(ConfigError, match="moe.balance: bias needs a correction bias .* Qwen3MoeTopKRouter has none"):
        Trainer(tiny_config(tmp_path / "a", moe={"balance": "bias"}))
    dense = {"config": {**QWEN3_MOE, "mlp_only_layers": [0, 1]}}
    with pytest.raises(ConfigError, match="moe.balance: aux_loss needs MoE blocks"):
        Trainer(tiny_config(tmp_path / "b", moe={"balance": "aux_loss"}, model=dense))
