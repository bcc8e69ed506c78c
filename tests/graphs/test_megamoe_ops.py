"""MoE tile ops: kernel vs torch reference vs autograd, shape rules, costs."""
import pytest
import torch
import torch.nn.functional as F

from megaloom.graphs.moe import ops as ops_moe
from megaloom.runtime.errors import GraphError
from megaloom.runtime.registry import TensorSpec, get_op
from megaloom.runtime.testing import check_grads


def check(name, ins, attrs=None, expect=None):
    """Kernel writes into strided views of a bigger buffer; result equals reference (and ``expect``)."""
    attrs = attrs or {}
    op = get_op(name)
    specs = [TensorSpec(tuple(t.shape), str(t.dtype).removeprefix("torch.")) for t in ins]
    want = op.shape(specs, attrs)
    ref = op.reference(*ins, **attrs)
    ref = ref if isinstance(ref, tuple) else (ref,)
    outs = []
    for w, r in zip(want, ref):
        assert tuple(r.shape) == tuple(w.shape) and str(r.dtype).removeprefix("torch.") == w.dtype
        big = torch.full((*w.shape[:-1], w.shape[-1] + 3), float("nan"), dtype=r.dtype)
        outs.append(big[..., 1:1 + w.shape[-1]])  # a non-contiguous view, as a column tile
    op.kernel(ins, outs, **attrs)
    for o, r in zip(outs, ref):
        torch.testing.assert_close(o, r, rtol=1e-6, atol=1e-6)
    if expect is not None:
        torch.testing.assert_close(ref[0], expect, rtol=1e-6, atol=1e-6)
    cost = op.cost(specs, want, attrs)
    assert cost.bytes > 0 and cost.flops >= 0
    return ref


def test_gather_picks_and_scales_rows():
    src = torch.randn(10, 6)
    idx = torch.tensor([7, 0, 7, 3])
    check("moe_gather", [src, idx], expect=src[[7, 0, 7, 3]])
    scale = torch.rand(4, 1)
    check("moe_gather", [src, idx, scale], expect=src[[7, 0, 7, 3]] * scale)


def test_gmm_plain_and_transposed_expert_slice():
    x, w = torch.randn(5, 8), torch.randn(3, 8, 6)
    check("moe_gmm", [x, w[1:2]], expect=x @ w[1])
    check("moe_gmm", [torch.randn(5, 6), w[2:3]], {"trans_w": True})
    assert get_op("moe_gmm").cost([TensorSpec((5, 8), "bfloat16"), TensorSpec((1, 8, 6), "bfloat16")],
                                  [TensorSpec((5, 6), "bfloat16")], {}).flops == 2 * 5 * 8 * 6


def test_wgrad_matches_autograd_and_idle_expert_gives_zeros():
    a, b = torch.randn(7, 4), torch.randn(7, 5)
    check("moe_wgrad", [a, b], expect=(a.t() @ b)[None])
    check("moe_wgrad", [torch.randn(0, 4), torch.randn(0, 5)], expect=torch.zeros(1, 4, 5))


def test_swiglu_and_its_gradient_match_autograd():
    gu = torch.randn(6, 10, dtype=torch.float64, requires_grad=True)
    y = F.silu(gu[:, :5]) * gu[:, 5:]
    da = torch.randn(6, 5, dtype=torch.float64)
    (grad,) = torch.autograd.grad(y, gu, da)
    check("swiglu", [gu.detach()], expect=y.detach())
    check("swiglu_grad", [gu.detach(), da], expect=grad)
    assert check_grads("swiglu", [gu.detach()], {}, tol=1e-12) == ["swiglu_grad"]


def test_unpermute_sum_and_topk_grad_match_autograd():
    rows = torch.randn(12, 4, dtype=torch.float64, requires_grad=True)
    pos = torch.randperm(12).view(6, 2)
    w = torch.rand(6, 2, dtype=torch.float64, requires_grad=True)
    out = sum(w[:, j:j + 1] * rows[pos[:, j]] for j in range(2))
    check("moe_unpermute_sum", [rows.detach(), pos, w.detach()], expect=out.detach())
    check("moe_unpermute_sum", [rows.detach(), pos], expect=(rows[pos[:, 0]] + rows[pos[:, 1]]).detach())
    dout = torch.randn(6, 4, dtype=torch.float64)
    (dw,) = torch.autograd.grad(out, w, dout)
    check("moe_topk_grad", [dout, rows.detach(), pos], expect=dw)
    assert check_grads("moe_unpermute_sum", [rows.detach(), pos, w.detach()], {}, tol=1e-12) == ["moe_topk_grad"]


@pytest.mark.parametrize("name, shapes", [
    ("moe_gather", [((4, 3), "float32"), ((2,), "float32")]),
    ("moe_gmm", [((4, 3), "float32"), ((1, 5, 2), "float32")]),
    ("moe_gmm", [((4, 3), "float32"), ((2, 3, 2), "float32")]),
    ("moe_wgrad", [((4, 3), "float32"), ((5, 2), "float32")]),
    ("swiglu", [((4, 3), "float32")]),
    ("swiglu_grad", [((4, 6), "float32"), ((4, 2), "float32")]),
    ("moe_unpermute_sum", [((4, 3), "float32"), ((2, 2), "float32")]),
    ("moe_topk_grad", [((2, 3), "float32"), ((4, 4), "float32"), ((2, 2), "int64")]),
])
def test_shape_rules_reject_bad_operands(name, shapes):
    with pytest.raises(GraphError, match=name):
        get_op(name).shape([TensorSpec(s, d) for s, d in shapes], {})


def test_module_table_lists_every_registered_op():
    for name in ("moe_gather", "moe_gmm", "moe_wgrad", "swiglu", "swiglu_grad", "moe_unpermute_sum", "moe_topk_grad"):
        assert f"| {name}" in ops_moe.__doc__
        get_op(name)
