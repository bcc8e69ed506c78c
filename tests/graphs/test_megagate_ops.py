"""MegaGate / shared projection ops: every kernel against its torch reference."""
import pytest
import torch

from megaloom.runtime.testing import check_op, rel_l2
from megaloom.graphs.gate.ops import SCORES, scores
from megaloom.runtime.errors import GraphError
from megaloom.runtime.registry import TensorSpec, get_op


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_proj_ops(dtype):
    a, w = torch.randn(9, 3, 8).to(dtype), torch.randn(5, 24).to(dtype)
    (y,) = check_op("proj", [a, w], {}, grads=True, grad_tol=1e-5 if dtype == torch.float32 else 1e-2)  # + bwd ops
    assert y.dtype == torch.float32
    assert rel_l2(y, a.float().reshape(9, 24) @ w.float().t()) < 1e-6
    g = torch.randn(9, 5)
    (dx,) = check_op("proj_grad_input", [g, w], {"cols": [3, 8], "out_dtype": "float32"})
    assert dx.shape == (9, 3, 8)
    check_op("proj_grad_input", [g, w], {"out_dtype": "bfloat16"})
    acc = torch.randn(5, 24)
    (dw,) = check_op("proj_grad_weight", [g, a, acc], {"out_dtype": "float32"})
    assert rel_l2(dw, acc + g.t() @ a.float().reshape(9, 24)) < 1e-6
    check_op("proj_grad_weight", [g, a], {"out_dtype": "bfloat16"})
    check_op("sum_partials", [torch.randn(4, 3, 5)], {"out_dtype": "bfloat16"})


def test_proj_grad_weight_accumulates_in_place():
    g, a = torch.randn(6, 4), torch.randn(6, 10)
    acc = torch.randn(4, 10)
    want = acc + g.t() @ a
    get_op("proj_grad_weight").kernel([g, a, acc], [acc])  # the chain's in-place link
    assert rel_l2(acc, want) < 1e-6


def test_proj_shape_errors_name_the_op():
    with pytest.raises(GraphError, match="proj"):
        get_op("proj").shape([TensorSpec((4, 6), "float32"), TensorSpec((3, 5), "float32")], {})
    with pytest.raises(GraphError, match="proj_grad_input"):
        get_op("proj_grad_input").shape([TensorSpec((4, 3), "float32"), TensorSpec((3, 6), "float32")], {"cols": [4]})


@pytest.mark.parametrize("score", SCORES)
@pytest.mark.parametrize("top_k,renorm", [(1, True), (3, True), (3, False)])
def test_gate_topk_kernels(score, top_k, renorm):
    logits, bias = torch.randn(11, 8), 0.3 * torch.randn(8)
    attrs = {"top_k": top_k, "score": score, "scale": 2.5, "renorm": renorm}
    w, idx = check_op("gate_topk", [logits, bias], attrs, tol=1e-6, grads=True, grad_tol=1e-5)
    s = scores(logits, score)
    assert torch.equal(idx, torch.topk(s + bias, top_k).indices)  # bias moves the selection ...
    sel = s.gather(-1, idx)  # ... but the weights come from the unbiased scores
    want = 2.5 * (sel / sel.sum(-1, keepdim=True) if renorm and top_k > 1 else sel)
    assert rel_l2(w, want) < 1e-6
    g_w, g_l = torch.randn(11, top_k), torch.randn(11, 8)
    check_op("gate_topk_bwd", [logits, idx, g_w, g_l], attrs, tol=1e-5)


def test_gate_topk_bwd_kernel_is_the_analytic_gradient():
    logits = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    attrs = {"top_k": 2, "score": "sqrtsoftplus", "scale": 1.5, "renorm": True}
    w, idx = get_op("gate_topk").reference(logits, torch.zeros(6, dtype=torch.float64), **attrs)
    g_w = torch.randn(5, 2, dtype=torch.float64)
    (want,) = torch.autograd.grad((w * g_w).sum(), logits)
    out = torch.empty(5, 6, dtype=torch.float64)
    get_op("gate_topk_bwd").kernel([logits.detach(), idx, g_w, torch.zeros(5, 6, dtype=torch.float64)], [out], **attrs)
    assert rel_l2(out, want) < 1e-12


def test_gate_topk_rejects_bad_k_and_score():
    with pytest.raises(GraphError, match="top_k"):
        get_op("gate_topk").shape([TensorSpec((4, 6), "float32"), TensorSpec((6,), "float32")], {"top_k": 7})
    with pytest.raises(GraphError, match="unknown gate score"):
        scores(torch.zeros(2, 3), "tanh")
