"""Hugging Face MoE block adapters against the blocks' own forward (real transformers classes)."""
import pytest
import torch

from megaloom.train.config import validate
from megaloom.graphs.moe import moe_reference
from megaloom.models.hf_moe import block_forward, block_parts, build_model, is_moe_block
from megaloom.runtime.errors import ConfigError

from .tiny import DEEPSEEK_V3, QWEN3_MOE, max_rel_err


def _model(kind, cfg):
    return build_model(validate({"model": {"kind": kind, "config": cfg}})["model"], seed=0)


@pytest.mark.parametrize("kind,cfg,block", [("qwen3_moe", QWEN3_MOE, "Qwen3MoeSparseMoeBlock"),
                                            ("deepseek_v3", DEEPSEEK_V3, "DeepseekV3MoE")])
def test_parts_are_the_models_tensors_and_forward_matches(kind, cfg, block):
    model = _model(kind, cfg)
    blocks = [m for m in model.modules() if is_moe_block(m)]
    assert blocks and type(blocks[0]).__name__ == block
    b = blocks[0]
    parts = block_parts(b)
    assert parts.gate_up is b.experts.gate_up_proj and parts.down is b.experts.down_proj  # identity, no copy
    assert (parts.num_experts, parts.hidden, parts.inter, parts.top_k) == (8, 64, 32, 2)
    with torch.no_grad():  # larger weights than the init so the comparison is not trivially ~0
        parts.gate_up.normal_(0, 0.3)
        parts.down.normal_(0, 0.3)
        parts.router.weight.normal_(0, 0.3)
    x = torch.randn(2, 16, 64, requires_grad=True)
    want = b(x)
    got = block_forward(parts, x)
    assert max_rel_err(got, want) < 1e-5
    gw, = torch.autograd.grad(want.square().sum(), parts.gate_up)
    gg, = torch.autograd.grad(got.square().sum(), parts.gate_up)
    assert max_rel_err(gg, gw) < 1e-5
    assert (parts.shared is not None) == (kind == "deepseek_v3")


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


def test_model_config_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"model.config: unknown key\(s\) hiden_size for Qwen3MoeConfig; allowed: .*hidden_size"):
        _model("qwen3_moe", {"hiden_size": 64})
    with pytest.raises(ConfigError, match="not a supported MoE block"):
        block_parts(torch.nn.Linear(2, 2))
