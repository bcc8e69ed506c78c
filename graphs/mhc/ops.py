"""Vector tile ops of MegaMHC (manifold-constrained hyper-connections, ``n`` residual streams).

| op                | engine | what it computes (one token tile)                                          |
|-------------------|--------|----------------------------------------------------------------------------|
| mhc_mix_norm      | vector | new residual ``R^T h + post (x) y`` and the inverse RMS of its flattening  |
| mhc_coeff         | vector | next pre / post / residual mix from the projected logits (Sinkhorn on the mix) |
| mhc_block_in      | vector | the block input ``RMSNorm(sum_j pre_j new_j) * norm_w`` with the *next* pre |
| mhc_block_in_bwd  | vector | gradient of mhc_block_in: new, pre (plus pre's own gradient), norm-weight partial |
| mhc_coeff_bwd     | vector | gradient of mhc_coeff: logits, inverse RMS, and per-tile alpha / bias partials |
| mhc_mix_norm_bwd  | vector | gradient of mhc_mix_norm (new's gradient from every reader summed in)       |

The forward graph runs ``mhc_coeff`` as a ``dvm.fused`` task by default: :func:`fused_coeff` gives
its operands, one ``[t, 1]`` column per logit, bias and alpha entry and per output entry (the
mix's ``[t, 1, 1]`` entries viewed as ``[t, 1]``), so the softmax and Sinkhorn rounds over each
token's ``n x n`` mix run in registers (:func:`megaloom.ops.dvm.library.mhc_coeff`).

Logit layout (``m = n*n + 2n``; 24 for n = 4): ``l[:, 0:n]`` pre, ``l[:, n:2n]`` post,
``l[:, 2n:]`` the mix, row-major ``[n, n]`` (mix entry ``n*i + j`` is row i, column j). The bias
splits the same way; alpha is ``(a_pre, a_post, a_mix)``. ``l = raw * inv_rms``, where
``raw = flat(new) @ phi^T`` (the RMS normalisation commutes with the projection, so it is
applied after the cube stage as one scale per token).

The backward references are the ``torch.autograd.functional.vjp`` of the forward
references; the kernels are the analytic gradients (the Sinkhorn iterations are
reversed step by step from stored row and column sums). Tests check one against the other.
``mhc_mix_norm_bwd`` reads the saved ``new`` and ``inv_rms``, which must be mhc_mix_norm's
outputs for the same inputs (its reference recomputes them).
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from megaloom.graphs.common.ops import acc_dtype, io_bytes, up
from megaloom.ops import dvm
from megaloom.runtime.errors import GraphError
from megaloom.runtime.graph import Region
from megaloom.runtime.registry import VECTOR, Cost, GradOf, OpDef, TensorSpec, register


def _check(name: str, ins: list[TensorSpec], want: list[tuple[int, ...] | None]) -> None:
    got = [s.shape for s in ins]
    if len(ins) != len(want) or any(w is not None and g != w for g, w in zip(got, want)):
        raise GraphError(f"{name}: operand shapes {got} do not match {want}")


def _cost(flops_per_elem: float, elem_operand: int = 0):
    def cost(ins: list[TensorSpec], outs: list[TensorSpec], attrs: dict) -> Cost:
        return Cost(flops_per_elem * ins[elem_operand].numel, io_bytes(ins, outs))
    return cost


# -- forward references ------------------------------------------------------------------
def mix_norm_ref(y, h, post, res, rms_eps: float = 1e-6):
    """(new, inv_rms): ``new_i = sum_j res[j, i] h_j + post_i y`` stored in h's dtype, and the inverse
    RMS of flat(new) (from the stored new)."""
    new = (torch.einsum("tji,tjh->tih", res, up(h)) + post.unsqueeze(-1) * up(y).unsqueeze(1)).to(h.dtype)
    inv = torch.rsqrt(up(new).flatten(1).pow(2).mean(-1, keepdim=True) + rms_eps)
    return new, inv


def block_in_ref(new, pre, norm_w, rms_eps: float = 1e-6):
    """``RMSNorm(sum_j pre_j new_j) * norm_w`` in new's dtype."""
    z = (pre.unsqueeze(-1) * up(new)).sum(1)
    return (z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + rms_eps) * up(norm_w)).to(new.dtype)


def sinkhorn(m: torch.Tensor, iters: int) -> torch.Tensor:
    """``iters`` rounds of row then column normalisation of positive [..., n, n] matrices."""
    for _ in range(iters):
        m = m / m.sum(-1, keepdim=True)
        m = m / m.sum(-2, keepdim=True)
    return m


def split_logits(l: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pre [.., n], post [.., n], mix [.., n, n]) parts of logits laid out as the module docstring says."""
    return l[..., :n], l[..., n:2 * n], l[..., 2 * n:].unflatten(-1, (n, n))


def coeff_ref(raw, inv_rms, alpha, bias, n: int = 4, iters: int = 20, pre_eps: float = 1e-6):
    """Next (pre, post, res) from the projected logits ``raw * inv_rms``."""
    lp, lq, lr = split_logits(raw * inv_rms, n)
    bp, bq, br = split_logits(bias, n)
    pre = torch.sigmoid(alpha[0] * lp + bp) + pre_eps
    post = 2 * torch.sigmoid(alpha[1] * lq + bq)
    return pre, post, sinkhorn(torch.softmax(alpha[2] * lr + br, -1), iters)


def coeff_attrs(rows: int, n: int, iters: int, pre_eps: float) -> dict:
    """``dvm.fused`` attrs of the float32 coefficients of a tile of ``rows`` tokens (operands: :func:`fused_coeff`)."""
    m = n * n + 2 * n
    shapes = [[rows, 1]] * (m + 1) + [[1]] * (m + 3) + [[rows, 1]] * (2 * n) + [[rows, 1, 1]] * (n * n)
    return {"program": dvm.library.mhc_coeff(rows, n, iters, pre_eps).to_attrs(), "operand_shapes": shapes}


def fused_coeff(ins: list[Region], outs: list[Region]) -> tuple[list[Region], list[Region]]:
    """The ``mhc_coeff`` operands ``(raw, inv_rms, alpha, bias), (pre, post, res)`` of one tile (regions, or
    tensors alike) as the fused program's: a column per logit, the alpha and bias entries, a column per
    pre / post entry and a ``[t, 1, 1]`` per mix entry."""
    raw, inv, alpha, bias = ins
    pre, post, res = outs
    m, n = raw.shape[1], pre.shape[1]
    return ([raw[:, k:k + 1] for k in range(m)] + [inv] + [alpha[j:j + 1] for j in range(3)]
            + [bias[k:k + 1] for k in range(m)],
            [x[:, i:i + 1] for x in (pre, post) for i in range(n)]
            + [res[:, i:i + 1, j:j + 1] for i in range(n) for j in range(n)])


# -- forward kernels ---------------------------------------------------------------------
def _mix_norm_kernel(ins, outs, rms_eps: float = 1e-6) -> None:
    y, h, post, res = ins
    new, inv = outs
    new.copy_(torch.matmul(res.transpose(1, 2), up(h)).addcmul_(post.unsqueeze(-1), up(y).unsqueeze(1)))
    nw = up(new)  # the stored (rounded) values, as a later reader sees them
    torch.rsqrt(nw.flatten(1).square().mean(-1, keepdim=True).add_(rms_eps), out=inv)


def _block_in_kernel(ins, outs, rms_eps: float = 1e-6) -> None:
    new, pre, w = ins
    z = torch.bmm(pre.unsqueeze(1), up(new)).squeeze(1)
    outs[0].copy_(F.rms_norm(z, (z.shape[-1],), up(w), rms_eps))


def _coeff_kernel(ins, outs, n: int = 4, iters: int = 20, pre_eps: float = 1e-6) -> None:
    raw, inv, alpha, bias = ins
    pre, post, res = outs
    lp, lq, lr = split_logits(raw * inv, n)
    bp, bq, br = split_logits(bias, n)
    torch.sigmoid(torch.addcmul(bp, lp, alpha[0]), out=pre).add_(pre_eps)
    torch.sigmoid(torch.addcmul(bq, lq, alpha[1]), out=post).mul_(2)
    res.copy_(torch.softmax(torch.addcmul(br, lr, alpha[2]), -1))
    for _ in range(iters):
        res.div_(res.sum(-1, keepdim=True))
        res.div_(res.sum(-2, keepdim=True))


# -- backward references: VJPs of the forward references ---------------------------------
def _coeff_bwd_ref(raw, inv_rms, alpha, bias, g_pre, g_post, g_res, n: int = 4, iters: int = 20, pre_eps: float = 1e-6):
    f = partial(coeff_ref, n=n, iters=iters, pre_eps=pre_eps)
    _, (gr, gi, ga, gb) = torch.autograd.functional.vjp(f, (raw, inv_rms, alpha, bias), (g_pre, g_post, g_res))
    return gr, gi, ga.unsqueeze(0), gb.unsqueeze(0)


def _block_in_bwd_ref(new, pre, norm_w, g_block, g_pre, rms_eps: float = 1e-6):
    f = partial(block_in_ref, rms_eps=rms_eps)
    _, (gn, gp, gw) = torch.autograd.functional.vjp(f, (up(new), pre, up(norm_w)), up(g_block))
    return gn, gp + g_pre, gw.unsqueeze(0)


def _mix_norm_bwd_ref(y, h, post, res, new, inv_rms, g_new, g_flat, g_block_new, g_inv, rms_eps: float = 1e-6):
    f = partial(mix_norm_ref, rms_eps=rms_eps)
    g = (up(g_new) + g_flat + g_block_new, g_inv)
    _, (gy, gh, gpost, gres) = torch.autograd.functional.vjp(f, (up(y), up(h), post, res), g)
    return gy.to(y.dtype), gh.to(h.dtype), gpost, gres


# -- backward kernels: analytic gradients ------------------------------------------------
def _coeff_bwd_kernel(ins, outs, n: int = 4, iters: int = 20, pre_eps: float = 1e-6) -> None:
    raw, inv, alpha, bias, g_pre, g_post, g_res = ins
    g_raw, g_inv, g_alpha, g_bias = outs
    lp, lq, lr = split_logits(raw * inv, n)
    bp, bq, br = split_logits(bias, n)
    sp = torch.sigmoid(alpha[0] * lp + bp)
    sq = torch.sigmoid(alpha[1] * lq + bq)
    g_zp = g_pre * sp * (1 - sp)
    g_zq = 2 * g_post * sq * (1 - sq)
    m0 = torch.softmax(alpha[2] * lr + br, -1)
    steps, m = [], m0  # (row sums, row-normalised, column sums, column-normalised) per round
    for _ in range(iters):
        r = m.sum(-1, keepdim=True)
        a = m / r
        c = a.sum(-2, keepdim=True)
        m = a / c
        steps.append((r, a, c, m))
    g = g_res
    for r, a, c, m in reversed(steps):
        g = (g - (g * m).sum(-2, keepdim=True)) / c
        g = (g - (g * a).sum(-1, keepdim=True)) / r
    g_zr = m0 * (g - (g * m0).sum(-1, keepdim=True))
    g_z = torch.cat([g_zp, g_zq, g_zr.flatten(1)], -1)
    g_l = torch.cat([g_zp * alpha[0], g_zq * alpha[1], g_zr.flatten(1) * alpha[2]], -1)
    torch.mul(g_l, inv, out=g_raw)
    torch.sum(g_l * raw, -1, keepdim=True, out=g_inv)
    g_alpha.copy_(torch.stack([(g_zp * lp).sum(), (g_zq * lq).sum(), (g_zr * lr).sum()]).unsqueeze(0))
    torch.sum(g_z, 0, keepdim=True, out=g_bias)


def _block_in_bwd_kernel(ins, outs, rms_eps: float = 1e-6) -> None:
    new, pre, w, g_block, g_pre_in = ins
    g_new, g_pre, g_w = outs
    nw, gb = up(new), up(g_block)
    # z = sum_j pre_j new_j, out = z r w with r = (mean z^2 + eps)^-1/2
    z = torch.bmm(pre.unsqueeze(1), nw).squeeze(1)
    r = torch.rsqrt(z.square().mean(-1, keepdim=True) + rms_eps)
    torch.sum(gb * z * r, 0, keepdim=True, out=g_w)
    u = gb * up(w)
    g_z = r * u - z * r.pow(3) * (u * z).mean(-1, keepdim=True)
    torch.add(torch.sum(nw * g_z.unsqueeze(1), -1), g_pre_in, out=g_pre)
    torch.mul(pre.unsqueeze(-1), g_z.unsqueeze(1), out=g_new)


def _mix_norm_bwd_kernel(ins, outs, rms_eps: float = 1e-6) -> None:
    y, h, post, res, new, inv, g_new, g_flat, g_block_new, g_inv = ins
    g_y, g_h, g_post, g_res = outs
    nw = up(new)
    # total gradient of new: its own, the projection's, the block input's, the inverse RMS's
    g = (up(g_new) + g_flat).add_(g_block_new)
    g.addcmul_(nw, (g_inv * inv.pow(3) / -(nw.shape[1] * nw.shape[2])).unsqueeze(-1))
    # new_i = sum_j res[j, i] h_j + post_i y
    g_h.copy_(torch.bmm(res, g))
    torch.bmm(up(h), g.transpose(1, 2), out=g_res)
    torch.sum(g * up(y).unsqueeze(1), -1, out=g_post)
    g_y.copy_(torch.bmm(post.unsqueeze(1), g).squeeze(1))


# -- shape rules -------------------------------------------------------------------------
def _dims(ins: list[TensorSpec], k: int) -> tuple[int, int, int]:
    """(t, n, H) from operand ``k``: the streams h or the new residual, [t, n, H]."""
    return (ins[k].shape + (0, 0, 0))[:3] if len(ins) > k else (0, 0, 0)


def _mix_norm_shape(ins: list[TensorSpec], attrs: dict) -> list[TensorSpec]:
    t, n, hd = _dims(ins, 1)
    _check("mhc_mix_norm", ins, [(t, hd), (t, n, hd), (t, n), (t, n, n)])
    return [ins[1], TensorSpec((t, 1), acc_dtype(ins[1].dtype))]


def _block_in_shape(ins: list[TensorSpec], attrs: dict) -> list[TensorSpec]:
    t, n, hd = _dims(ins, 0)
    _check("mhc_block_in", ins, [(t, n, hd), (t, n), (hd,)])
    return [TensorSpec((t, hd), ins[0].dtype)]


def _block_in_bwd_shape(ins: list[TensorSpec], attrs: dict) -> list[TensorSpec]:
    t, n, hd = _dims(ins, 0)
    _check("mhc_block_in_bwd", ins, [(t, n, hd), (t, n), (hd,), (t, hd), (t, n)])
    acc = acc_dtype(ins[0].dtype)
    return [TensorSpec((t, n, hd), acc), TensorSpec((t, n), acc), TensorSpec((1, hd), acc)]


def _coeff_dims(ins: list[TensorSpec], attrs: dict) -> tuple[int, int, int]:
    """(t, n, m) of the coefficient ops: tokens from the logits operand, streams and logits from ``n``."""
    n = int(attrs.get("n", 4))
    return (ins[0].shape[0] if ins and ins[0].shape else 0), n, n * n + 2 * n


def _coeff_shape(ins: list[TensorSpec], attrs: dict) -> list[TensorSpec]:
    t, n, m = _coeff_dims(ins, attrs)
    _check("mhc_coeff", ins, [(t, m), (t, 1), (3,), (m,)])
    dt = ins[0].dtype
    return [TensorSpec((t, n), dt), TensorSpec((t, n), dt), TensorSpec((t, n, n), dt)]


def _coeff_bwd_shape(ins: list[TensorSpec], attrs: dict) -> list[TensorSpec]:
    t, n, m = _coeff_dims(ins, attrs)
    _check("mhc_coeff_bwd", ins, [(t, m), (t, 1), (3,), (m,), (t, n), (t, n), (t, n, n)])
    dt = ins[0].dtype
    return [TensorSpec((t, m), dt), TensorSpec((t, 1), dt), TensorSpec((1, 3), dt), TensorSpec((1, m), dt)]


def _mix_norm_bwd_shape(ins: list[TensorSpec], attrs: dict) -> list[TensorSpec]:
    t, n, hd = _dims(ins, 1)
    _check("mhc_mix_norm_bwd", ins, [(t, hd), (t, n, hd), (t, n), (t, n, n), (t, n, hd), (t, 1),
                                     (t, n, hd), (t, n, hd), (t, n, hd), (t, 1)])
    return [ins[0], ins[1], ins[2], ins[3]]


SINKHORN_FLOPS = 4.0  # per matrix entry and round: a sum and a divide, rows then columns

register(OpDef("mhc_mix_norm", (VECTOR,), mix_norm_ref, _mix_norm_shape, _cost(12.0, 1), _mix_norm_kernel,
               doc="new residual R^T h + post (x) y and the inverse RMS of its flattening"))
register(OpDef("mhc_block_in", (VECTOR,), block_in_ref, _block_in_shape, _cost(4.0, 0), _block_in_kernel,
               doc="block input RMSNorm(sum_j pre_j new_j) * norm_w, with the pre computed from new"))
register(OpDef("mhc_block_in_bwd", (VECTOR,), _block_in_bwd_ref, _block_in_bwd_shape, _cost(10.0, 0),
               _block_in_bwd_kernel, doc="gradient of mhc_block_in, plus the per-tile norm-weight partial",
               grad_of=GradOf("mhc_block_in", "x0 x1 x2 dy0 dx1", "dx0 dx1 dx2")))
register(OpDef("mhc_coeff", (VECTOR,), coeff_ref, _coeff_shape,
               lambda i, o, a: Cost(i[0].numel * (8.0 + SINKHORN_FLOPS * a.get("iters", 20)), io_bytes(i, o)),
               _coeff_kernel, doc="next pre / post / Sinkhorn residual mix from the projected logits"))
register(OpDef("mhc_coeff_bwd", (VECTOR,), _coeff_bwd_ref, _coeff_bwd_shape,
               lambda i, o, a: Cost(i[0].numel * (16.0 + 3 * SINKHORN_FLOPS * a.get("iters", 20)), io_bytes(i, o)),
               _coeff_bwd_kernel, doc="gradient of mhc_coeff (analytic, Sinkhorn reversed step by step)",
               grad_of=GradOf("mhc_coeff", "x0 x1 x2 x3 dy0 dy1 dy2", "dx0 dx1 dx2 dx3")))
register(OpDef("mhc_mix_norm_bwd", (VECTOR,), _mix_norm_bwd_ref, _mix_norm_bwd_shape, _cost(22.0, 1),
               _mix_norm_bwd_kernel, doc="gradient of mhc_mix_norm",
               grad_of=GradOf("mhc_mix_norm", "x0 x1 x2 x3 y0 y1 dy0 dy0 dy0 dy1", "dx0 dx1 dx2 dx3")))
