"""Autograd functions of MXFP8 linear layers: dense (``mx_linear``) and grouped over experts.

Forward ``Y = X W^T`` runs on row-wise X and W (layout NT); backward ``dX = dY W`` on
row-wise dY and column-wise W (NN) and ``dW = dY^T X`` on column-wise dY and X (TN).
Backward keeps only what it needs. When W needs a gradient: column-wise X as FP8 payload
plus E8M0 scales (quantised in the same pass as the row-wise X of forward), or X itself
where that is smaller (few tokens: column-wise blocks pad tokens to 32). When X needs one:
the weight itself, the Parameter, no copy; its column-wise quantisation is made again in
backward. dY is quantised once with the dual-axis op when both gradients are needed.
Bias stays in high precision.

Column-wise operands contract over tokens, so tokens are zero-padded to a multiple of 32
(dense) or per group (grouped); zero rows add nothing to the weight gradient. Products
are computed in float32 with autocast disabled (see :mod:`megaloom.ops.mxfp8.matmul`).
"""
from __future__ import annotations

from typing import Sequence

import torch

from megaloom.ops.mxfp8.format import BLOCK, MXTensor, pad_rows, quantize, quantize_dual
from megaloom.ops.mxfp8.grouped import check_offsets, padded_offsets, quantize_grouped
from megaloom.ops.mxfp8.matmul import mx_grouped_matmul, mx_matmul


def _fp8_is_smaller(x: torch.Tensor, padded_rows: int) -> bool:
    """Whether column-wise FP8 ``x`` (``padded_rows`` rows, a scale per 32) takes fewer bytes than ``x``."""
    return padded_rows * 33 < 32 * x.shape[0] * x.element_size()


def _saved_x(xc: MXTensor | None, x: torch.Tensor, need_dw: bool) -> tuple[torch.Tensor | None, ...]:
    """What backward keeps of X for dW: column-wise FP8 ``xc``, else ``x`` itself (when smaller), or nothing."""
    return (xc.data, xc.scales, None) if xc is not None else (None, None, x if need_dw else None)


class MXLinearFunction(torch.autograd.Function):
    """``y = x @ weight.T + bias`` for 2-D ``x`` on MXFP8 operands."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, scale_mode: str):
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        fp8 = need_dw and _fp8_is_smaller(x, -(-x.shape[0] // BLOCK) * BLOCK)
        with torch.autocast(x.device.type, enabled=False):
            xr, xc = quantize_dual(pad_rows(x), scale_mode) if fp8 else (quantize(x, "rows", scale_mode), None)
            y = mx_matmul(xr, quantize(weight, "rows", scale_mode), "NT", torch.float32)[: x.shape[0]]
            if bias is not None:
                y = y + bias.float()
        ctx.save_for_backward(*_saved_x(xc, x, need_dw), weight if need_dx else None)
        ctx.meta = (x.shape[0], x.dtype, weight.dtype, scale_mode)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        m, x_dtype, w_dtype, scale_mode = ctx.meta
        xd, xs, x, weight = ctx.saved_tensors
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        dx = dw = db = None
        with torch.autocast(dy.device.type, enabled=False):
            if need_dx and need_dw:
                dyr, dyc = quantize_dual(pad_rows(dy), scale_mode)
            else:
                dyr = quantize(dy, "rows", scale_mode) if need_dx else None
                dyc = quantize(pad_rows(dy), "cols", scale_mode) if need_dw else None
            if need_dx:
                dx = mx_matmul(dyr, quantize(weight, "cols", scale_mode), "NN", x_dtype)[:m]
            if need_dw:
                xc = MXTensor(xd, xs, "cols") if x is None else quantize(pad_rows(x), "cols", scale_mode)
                dw = mx_matmul(dyc, xc, "TN", w_dtype)
            if need_db:
                db = dy.float().sum(0)
        return dx, dw, db.to(w_dtype) if db is not None else None, None


def mx_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
              scale_mode: str = "floor") -> torch.Tensor:
    """``F.linear`` on MXFP8 operands; ``x`` may have any number of leading dims."""
    y = MXLinearFunction.apply(x.reshape(-1, x.shape[-1]), weight, bias, scale_mode)
    return y.reshape(*x.shape[:-1], weight.shape[0])


class MXGroupedLinearFunction(torch.autograd.Function):
    """Per-group ``y_g = x_g @ W[g].T`` over tokens sorted by group, ``W`` (G, N, K) the
    concatenation along dim 1 of ``weights`` (gate and up: one GEMM, two Parameters kept)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, offsets: list[int], scale_mode: str, *weights: torch.Tensor):
        need_dx, need_dw = ctx.needs_input_grad[0], any(ctx.needs_input_grad[3:])
        fp8 = need_dw and _fp8_is_smaller(x, padded_offsets(offsets)[-1])
        with torch.autocast(x.device.type, enabled=False):
            xc = quantize_grouped(x, offsets, "cols", scale_mode) if fp8 else None
            y = mx_grouped_matmul(quantize(x, "rows", scale_mode), quantize(_cat(weights), "rows", scale_mode), offsets,
                                  "NT", x.dtype)
        ctx.save_for_backward(*_saved_x(xc, x, need_dw), *(weights if need_dx else ()))
        ctx.meta = (offsets, x.dtype, weights[0].dtype, scale_mode, [w.shape[1] for w in weights])
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        offsets, x_dtype, w_dtype, scale_mode, widths = ctx.meta
        xd, xs, x, *weights = ctx.saved_tensors
        dx, dws = None, [None] * len(widths)
        with torch.autocast(dy.device.type, enabled=False):
            if ctx.needs_input_grad[0]:
                wc = quantize(_cat(weights), "cols", scale_mode)
                dx = mx_grouped_matmul(quantize(dy, "rows", scale_mode), wc, offsets, "NN", x_dtype)
            if any(ctx.needs_input_grad[3:]):
                dyc = quantize_grouped(dy, offsets, "cols", scale_mode)
                xc = MXTensor(xd, xs, "cols") if x is None else quantize_grouped(x, offsets, "cols", scale_mode)
                dws = mx_grouped_matmul(dyc, xc, offsets, "TN", w_dtype).split(widths, dim=1)
        return dx, None, None, *dws


def _cat(weights: Sequence[torch.Tensor]) -> torch.Tensor:
    return weights[0] if len(weights) == 1 else torch.cat(list(weights), dim=1)


def as_offsets(group_offsets: Sequence[int] | torch.Tensor, total: int) -> list[int]:
    """Cumulative end offsets as a list of ints (a tensor is read once, on the host)."""
    if isinstance(group_offsets, torch.Tensor):
        group_offsets = group_offsets.tolist()
    return check_offsets(group_offsets, total)


def mx_grouped_linear(x: torch.Tensor, weight: torch.Tensor | Sequence[torch.Tensor],
                      group_offsets: Sequence[int] | torch.Tensor, scale_mode: str = "floor") -> torch.Tensor:
    """Per-expert linear (no bias) on MXFP8 operands; ``x`` (T, K) sorted by group, ``weight``
    (G, N, K) or several such concatenated along N (each kept for backward as it is)."""
    weights = (weight,) if isinstance(weight, torch.Tensor) else tuple(weight)
    return MXGroupedLinearFunction.apply(x, as_offsets(group_offsets, x.shape[0]), scale_mode, *weights)
