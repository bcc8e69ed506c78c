"""MegaMHC ops: every kernel against its torch reference (backward references are autograd VJPs)."""
import pytest
import torch

from megaloom.runtime.testing import check_grads, check_op, rel_l2
from megaloom.graphs.mhc.ops import sinkhorn, split_logits
from megaloom.runtime.errors import GraphError
from megaloom.runtime.registry import TensorSpec, get_op

T, N, H = 7, 4, 6
M = N * N + 2 * N


def _fwd_inputs(dtype=torch.float32):
    return dict(y=torch.randn(T, H).to(dtype), h=torch.randn(T, N, H).to(dtype), pre=0.1 + torch.rand(T, N),
                post=2 * torch.rand(T, N), res=torch.softmax(torch.randn(T, N, N), -1),
                phi=0.3 * torch.randn(M, N * H), alpha=torch.tensor([0.8, 1.2, 0.9]), bias=0.5 * torch.randn(M),
                norm_w=(1 + 0.1 * torch.randn(H)).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_ops(dtype):
    x = _fwd_inputs(dtype)
    eps = {"rms_eps": 1e-6}
    gtol = 1e-5 if dtype == torch.float32 else 1e-2
    new, inv = check_op("mhc_mix_norm", [x[k] for k in ("y", "h", "post", "res")], eps, grads=True, grad_tol=gtol)
    assert new.dtype == dtype and inv.dtype == torch.float32
    want = torch.einsum("tji,tjh->tih", x["res"], x["h"].float()) + x["post"][..., None] * x["y"].float()[:, None]
    assert rel_l2(new, want) < (1e-6 if dtype == torch.float32 else 1e-2)
    (block,) = check_op("mhc_block_in", [new, x["pre"], x["norm_w"]], eps, grads=True, grad_tol=gtol)
    assert block.dtype == dtype
    z = (x["pre"][..., None] * new.float()).sum(1)
    want = z / z.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * x["norm_w"].float()
    assert rel_l2(block, want) < (1e-6 if dtype == torch.float32 else 1e-2)
    raw = torch.randn(T, M)
    pre, post, res = check_op("mhc_coeff", [raw, inv, x["alpha"], x["bias"]], {"n": N, "iters": 20, "pre_eps": 1e-6},
                              grads=True)
    assert (pre > 0).all() and (post > 0).all() and (post < 2).all()
    assert torch.allclose(res.sum(-2), torch.ones(T, N), atol=1e-6)  # columns normalised last
    assert torch.allclose(res.sum(-1), torch.ones(T, N), atol=1e-3)  # rows close after 20 rounds


def test_logit_layout():
    l = torch.arange(M).float()
    p, q, r = split_logits(l, N)
    assert p.tolist() == [0, 1, 2, 3] and q.tolist() == [4, 5, 6, 7]
    assert r[1].tolist() == [12, 13, 14, 15]  # row-major: entry 2n + n*i + j is row i, column j


@pytest.mark.parametrize("iters", [0, 3, 20])
def test_coeff_bwd(iters):
    attrs = {"n": N, "iters": iters, "pre_eps": 1e-6}
    raw, inv = torch.randn(T, M), 0.5 + torch.rand(T, 1)
    alpha, bias = torch.tensor([0.8, 1.2, 0.9]), 0.5 * torch.randn(M)
    grads = [torch.randn(T, N), torch.randn(T, N), torch.randn(T, N, N)]
    g_raw, g_inv, g_a, g_b = check_op("mhc_coeff_bwd", [raw, inv, alpha, bias, *grads], attrs, tol=1e-5)
    assert g_a.shape == (1, 3) and g_b.shape == (1, M)
    assert check_grads("mhc_coeff", [raw, inv, alpha, bias], attrs) == ["mhc_coeff_bwd"]


def test_mix_norm_and_block_in_bwd():
    x = _fwd_inputs()
    eps = {"rms_eps": 1e-6}
    fwd_in = [x[k] for k in ("y", "h", "post", "res")]
    new, inv = get_op("mhc_mix_norm").reference(*fwd_in)
    grads = [torch.randn(T, N, H), torch.randn(T, N, H), torch.randn(T, N, H), torch.randn(T, 1)]
    g_y, g_h, g_post, g_res = check_op("mhc_mix_norm_bwd", fwd_in + [new, inv] + grads, eps)
    assert g_res.shape == (T, N, N)
    g_new, g_pre, g_w = check_op("mhc_block_in_bwd", [new, x["pre"], x["norm_w"], torch.randn(T, H),
                                                      torch.randn(T, N)], eps)
    assert g_new.shape == (T, N, H) and g_pre.shape == (T, N) and g_w.shape == (1, H)


def test_sinkhorn_reaches_doubly_stochastic():
    m = sinkhorn(torch.softmax(torch.randn(3, N, N), -1), 200)
    assert torch.allclose(m.sum(-1), torch.ones(3, N), atol=1e-5)
    assert torch.allclose(m.sum(-2), torch.ones(3, N), atol=1e-5)


def test_shape_rules_reject_mismatches():
    with pytest.raises(GraphError, match="mhc_mix_norm"):
        get_op("mhc_mix_norm").shape([TensorSpec((T, H), "float32"), TensorSpec((T, N, H), "float32"),
                                      TensorSpec((T, N), "float32"), TensorSpec((T, N, N + 1), "float32")], {})
    with pytest.raises(GraphError, match="mhc_coeff"):
        get_op("mhc_coeff").shape([TensorSpec((T, M), "float32"), TensorSpec((T, 1), "float32"),
                                   TensorSpec((3,), "float32"), TensorSpec((M,), "float32")], {"n": 3})
