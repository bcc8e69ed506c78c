"""MegaMoE and MegaGate inside torch: autocast, dtype changes, empty micro-batches, double backward,
and torch.compile (custom ops with fake implementations: no graph break, fullgraph works)."""
import pytest
import torch

from megaloom.graphs import MegaGate, MegaMoE, megagate_reference, moe_reference
from megaloom.runtime.errors import ExecutionError
from megaloom.runtime.testing import rel_l2


def _moe(dtype=torch.float32):
    torch.manual_seed(0)
    return MegaMoE(16, 8, 4, 2, dtype=dtype, tile_m=4)


def _inputs(t=10, dtype=torch.float32):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(t, 16, generator=gen).to(dtype).requires_grad_()
    ids = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(t)]) if t else torch.zeros(0, 2, dtype=torch.long)
    w = torch.rand(t, 2, generator=gen).to(dtype).requires_grad_()
    return x, ids, w


def _reference(moe, x, ids, w, dtype):
    ps = [p.detach().to(dtype).requires_grad_() for p in (moe.gate_up, moe.down)]
    xs = [t.detach().to(dtype).requires_grad_() for t in (x, w)]
    out = moe_reference(xs[0], ids, xs[1], *ps)
    return out, xs + ps


def test_autocast_computes_in_the_autocast_dtype_with_float32_parameters():
    moe = _moe()
    x, ids, w = _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = moe(x, ids, w)
    assert y.dtype == torch.bfloat16
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    y.backward(g)
    ref, leaves = _reference(moe, x, ids, w, torch.bfloat16)
    ref.backward(g)
    assert rel_l2(y, ref) < 1e-2
    assert moe.gate_up.grad.dtype == x.grad.dtype == torch.float32  # the casts are differentiable
    for got, want in zip((x.grad, w.grad, moe.gate_up.grad, moe.down.grad), (t.grad for t in leaves)):
        assert rel_l2(got, want) < 2e-2


def test_to_dtype_after_construction():
    moe = _moe().to(torch.bfloat16)
    x, ids, w = _inputs(dtype=torch.bfloat16)
    y = moe(x, ids, w)
    ref, _ = _reference(moe, x, ids, w, torch.bfloat16)
    assert y.dtype == torch.bfloat16 and rel_l2(y, ref) < 1e-2


@pytest.mark.parametrize("shape", [(0, 16), (3, 0, 16)])
def test_a_micro_batch_without_tokens(shape):
    moe = _moe()
    x = torch.zeros(shape, requires_grad=True)
    ids, w = torch.zeros(*shape[:-1], 2, dtype=torch.long), torch.zeros(*shape[:-1], 2, requires_grad=True)
    y = moe(x, ids, w)
    assert y.shape == shape
    y.sum().backward()
    assert x.grad.shape == shape and w.grad.shape == w.shape
    assert torch.count_nonzero(moe.gate_up.grad) == 0 and moe.down.grad.shape == moe.down.shape
    gate = MegaGate(16, 4, 2)
    out = gate(x)
    assert out.weights.shape == (*shape[:-1], 2) and out.logits.shape == (*shape[:-1], 4)
    out.weights.sum().backward()
    assert torch.count_nonzero(gate.weight.grad) == 0


def test_double_backward_differentiates_the_first_order_gradients():
    moe = _moe(torch.float64)
    x, ids, w = _inputs(dtype=torch.float64)

    def penalty(f, x_, w_, params):
        (gx,) = torch.autograd.grad(f(x_, w_, *params).square().sum(), x_, create_graph=True)
        return gx.square().sum()

    p = penalty(lambda a, b, *_: moe(a, ids, b), x, w, ())
    p.backward()
    params = [t.detach().clone().requires_grad_() for t in (moe.gate_up, moe.down)]
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    want = penalty(lambda a, b, gu, dn: moe_reference(a, ids, b, gu, dn), xr, wr, params)
    want.backward()
    assert torch.allclose(p, want)
    for got, ref in ((x.grad, xr.grad), (w.grad, wr.grad), (moe.gate_up.grad, params[0].grad),
                     (moe.down.grad, params[1].grad)):
        assert rel_l2(got, ref) < 1e-10


def test_double_backward_under_expert_parallelism_is_refused():
    moe = _moe()
    x, ids, w = _inputs()
    y = moe(x, ids, w)
    moe.runner.world_size = 2  # what a runner on 2 ranks reports
    with pytest.raises(ExecutionError, match="needs every expert on one rank"):
        torch.autograd.grad(y.sum(), x, create_graph=True)


def test_compiled_fullgraph_without_graph_breaks():
    moe, gate = _moe(), MegaGate(16, 4, 2, score="sigmoid", n_group=2, topk_group=1)

    def block(x):
        out = gate(x)
        return moe(x, out.indices, out.weights).relu().sum()

    x = _inputs(12)[0]
    torch._dynamo.reset()
    assert torch._dynamo.explain(block)(x).graph_break_count == 0
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager", dynamic=True)
    for t in (12, 7):  # another token count: the same compiled graph (dynamic shapes)
        x = _inputs(t)[0]
        want = block(x)
        (gx_want,) = torch.autograd.grad(want, x)
        got = compiled(x)
        (gx,) = torch.autograd.grad(got, x)
        assert torch.equal(got, want) and torch.equal(gx, gx_want)


def test_gate_group_limited_routing_matches_deepseek_v3():
    tf = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = tf.DeepseekV3Config(hidden_size=32, n_routed_experts=64, num_experts_per_tok=8, n_group=8, topk_group=4,
                              routed_scaling_factor=2.5, norm_topk_prob=True)
    router = DeepseekV3TopkRouter(cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        router.weight.normal_(0, 0.3)
        router.e_score_correction_bias.normal_(0, 0.1)
    x = torch.randn(50, 32)
    _, w, idx = router(x)
    gate = MegaGate(32, 64, 8, score="sigmoid", scale=2.5, n_group=8, topk_group=4, tile_tokens=16)
    with torch.no_grad():
        gate.weight.copy_(router.weight)
        gate.bias.copy_(router.e_score_correction_bias)
    out = gate(x)
    dense = [torch.zeros(50, 64).scatter_(1, i, v) for i, v in ((idx, w), (out.indices, out.weights))]
    assert torch.allclose(dense[0], dense[1], atol=1e-6)
    groups = out.indices // 8  # experts from at most 4 of the 8 groups per token
    assert max(len(set(g.tolist())) for g in groups) <= 4
    plain = megagate_reference(x, gate.weight, gate.bias, top_k=8, score="sigmoid", scale=2.5)[2]
    assert not torch.equal(plain.sort(1).values, out.indices.sort(1).values)  # the limit changes the choice
