"""MoE blocks read by structure: parts by identity, the rebuilt forward, and refusals that name the part."""
import copy

import pytest
import torch
from torch import nn

from megaloom.train.config import validate
from megaloom.graphs.moe import moe_reference
from megaloom.models.hf_moe import (behaviour_problems, block_forward, block_parts, build_model, expert_weights,
                                    is_moe_block, read_block)
from megaloom.runtime.errors import ConfigError

from .tiny import FAMILIES, max_rel_err

BLOCKS = {"qwen3_moe": "Qwen3MoeSparseMoeBlock", "qwen2_moe": "Qwen2MoeSparseMoeBlock", "deepseek_v3": "DeepseekV3MoE",
          "mixtral": "MixtralSparseMoeBlock", "olmoe": "OlmoeSparseMoeBlock"}


def _model(kind, cfg=None):
    return build_model(validate({"model": {"kind": kind, "config": FAMILIES[kind] if cfg is None else cfg}})["model"], seed=0)


def _block(kind):
    b = next(m for m in _model(kind).modules() if is_moe_block(m))
    with torch.no_grad():  # larger weights than the init so the comparison is not trivially ~0
        for p in b.parameters():
            p.normal_(0, 0.3)
    return b


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_parts_are_the_models_tensors_and_forward_matches(kind):
    b = _block(kind)
    assert type(b).__name__ == BLOCKS[kind]
    parts = block_parts(b)
    assert parts.experts is b.experts and parts.router is b.gate  # identity, no copy
    gate_up, down = expert_weights(parts.experts)
    assert gate_up._base is b.experts.gate_up_proj and down._base is b.experts.down_proj  # views
    assert (parts.num_experts, parts.hidden, parts.inter, parts.top_k) == (8, 64, 32, 2)
    assert (parts.shared is not None) == (kind in ("qwen2_moe", "deepseek_v3"))
    assert (parts.shared_gate is not None) == (kind == "qwen2_moe")
    assert behaviour_problems(b, parts) == []
    x = torch.randn(2, 16, 64, requires_grad=True)
    want = b(x)
    got = block_forward(parts, x)
    assert max_rel_err(got, want) < 1e-5
    gw, = torch.autograd.grad(want.square().sum(), b.experts.gate_up_proj)
    gg, = torch.autograd.grad(got.square().sum(), b.experts.gate_up_proj)
    assert max_rel_err(gg, gw) < 1e-5


def test_reference_on_transformers_layout_views_matches_dense_loop():
    torch.manual_seed(1)
    x, gu, down = torch.randn(5, 4), torch.randn(3, 6, 4), torch.randn(3, 4, 3)
    idx, w = torch.tensor([[0, 2], [1, 0], [2, 1], [0, 1], [2, 0]]), torch.rand(5, 2)
    want = torch.zeros(5, 4)
    for t in range(5):
        for k in range(2):
            e = idx[t, k]
            g, u = (gu[e] @ x[t]).chunk(2)
            want[t] += w[t, k] * (down[e] @ (torch.nn.functional.silu(g) * u))
    got = moe_reference(x, idx, w, gu.transpose(1, 2), down.transpose(1, 2), torch.nn.functional.silu)
    torch.testing.assert_close(got, want)


class Router(nn.Module):
    """A user's own softmax top-k router, in the transformers >= 5 convention."""

    def __init__(self, hidden, experts, top_k):
        super().__init__()
        self.weight, self.top_k = nn.Parameter(0.3 * torch.randn(experts, hidden)), top_k

    def forward(self, x):
        logits = x @ self.weight.t()
        w, idx = logits.softmax(-1).topk(self.top_k, -1)
        return logits, w / w.sum(-1, keepdim=True), idx


class MLP(nn.Module):
    def __init__(self, hidden, inter):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(hidden, inter, bias=False), nn.Linear(hidden, inter, bias=False)
        self.down_proj, self.act_fn = nn.Linear(inter, hidden, bias=False), nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class ListMoE(nn.Module):
    """An MoE block of a shape no transformers class has: ModuleList experts and an ungated shared MLP."""

    def __init__(self, hidden=32, inter=16, experts=4, top_k=2):
        super().__init__()
        self.router = Router(hidden, experts, top_k)
        self.experts = nn.ModuleList(MLP(hidden, inter) for _ in range(experts))
        self.shared_experts = MLP(hidden, inter)

    def forward(self, h):
        x = h.reshape(-1, h.shape[-1])
        _, w, idx = self.router(x)
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for j in range(idx.shape[1]):
                out[t] += w[t, j] * self.experts[int(idx[t, j])](x[t])
        return out.view(h.shape) + self.shared_experts(h)


def test_a_modulelist_block_of_any_class_is_read_by_structure():
    torch.manual_seed(0)
    b = ListMoE()
    parts = block_parts(b)
    assert not parts.fused and parts.router_name == "router" and parts.shared is b.shared_experts
    assert behaviour_problems(b, parts) == []
    gate_up, down = expert_weights(parts.experts)
    assert gate_up.shape == (4, 32, 32) and down.shape == (4, 16, 32)
    x = torch.randn(3, 32, requires_grad=True)
    got = block_forward(parts, x)
    assert max_rel_err(got, b(x)) < 1e-5
    got.sum().backward()  # stacked weights: gradients reach every Linear
    assert all(p.grad is not None for p in b.experts.parameters())


def test_blocks_with_parts_megaloom_does_not_understand_are_refused_naming_the_part():
    b = _block("qwen3_moe")
    b.norm = nn.LayerNorm(64)
    assert "part 'norm' (LayerNorm) is not one megaloom understands" in read_block(b)[1][0]
    lin = ListMoE()
    lin.router = nn.Linear(32, 4)
    assert any("router 'router' is a plain Linear" in p for p in read_block(lin)[1])
    biased = ListMoE()
    biased.experts[1].up_proj = nn.Linear(32, 16)
    assert any("experts.1.up_proj: has a bias" in p for p in read_block(biased)[1])
    mix = _model("mixtral", {**FAMILIES["mixtral"], "router_jitter_noise": 0.1})
    blk = next(m for m in mix.modules() if is_moe_block(m))
    assert any("jitter noise (jitter_noise=0.1)" in p for p in read_block(blk)[1])
    with pytest.raises(ConfigError, match="Linear is not an MoE block"):
        block_parts(nn.Linear(2, 2))


def test_a_forward_that_does_something_else_is_refused():
    b = _block("qwen3_moe")
    odd = copy.deepcopy(b)
    odd.forward = lambda h: 2 * type(b).forward(odd, h)  # same parts, another forward
    (problem,) = behaviour_problems(odd, block_parts(odd))
    assert "its forward differs from router -> experts -> shared expert" in problem
    qwen2 = _block("qwen2_moe")
    parts = block_parts(qwen2)
    parts.shared_gate = None  # forgetting the shared expert's gate is caught, not silently wrong
    assert behaviour_problems(qwen2, parts)


def test_model_config_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"model.config: unknown key\(s\) hiden_size for Qwen3MoeConfig; allowed: .*hidden_size"):
        _model("qwen3_moe", {"hiden_size": 64})
    with pytest.raises(ConfigError, match="'qwen9' is not a transformers causal-LM model type"):
        _model("qwen9", {})
