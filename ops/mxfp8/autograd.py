"""Autograd functions of MXFP8 linear layers: dense (``mx_linear``) and grouped over experts.

Forward ``Y = X W^T`` runs on row-wise X and W (layout NT); backward ``dX = dY W`` on
row-wise dY and column-wise W (NN) and ``dW = dY^T X`` on column-wise dY and X (TN).
Only what backward needs is saved, and only as FP8 payload plus E8M0 scales: column-wise
X when W needs a gradient, column-wise W when X needs one. dY is quantised once with the
dual-axis op when both gradients are needed. Bias stays in high precision.

Column-wise operands contract over tokens, so tokens are zero-padded to a multiple of 32
(dense) or per group (grouped); zero rows add nothing to the weight gradient. Products
are computed in float32 with autocast disabled (see :mod:`megaloom.ops.mxfp8.matmul`).
"""
from __future__ import annotations

from typing import Sequence

import torch

from megaloom.ops.mxfp8.format import MXTensor, pad_rows, quantize, quantize_dual
from megaloom.ops.mxfp8.grouped import check_offsets, quantize_grouped
from megaloom.ops.mxfp8.matmul import mx_grouped_matmul, mx_matmul


def _rows_and_cols(x: torch.Tensor, want_cols: bool, scale_mode: str) -> tuple[MXTensor, MXTensor | None]:
    """Row-wise ``x`` and, when wanted, column-wise ``x`` (rows zero-padded to 32) from one dual pass."""
    if not want_cols:
        return quantize(x, "rows", scale_mode), None
    return quantize_dual(pad_rows(x), scale_mode)


def _save(ctx, *qs: MXTensor | None) -> None:
    ctx.save_for_backward(*(t for q in qs for t in ((q.data, q.scales) if q is not None else (None, None))))


def _saved(ctx, axis: str) -> list[MXTensor | None]:
    t = ctx.saved_tensors
    return [MXTensor(t[i], t[i + 1], axis) if t[i] is not None else None for i in range(0, len(t), 2)]


class MXLinearFunction(torch.autograd.Function):
    """``y = x @ weight.T + bias`` for 2-D ``x`` on MXFP8 operands."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, scale_mode: str):
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        with torch.autocast(x.device.type, enabled=False):
            xr, xc = _rows_and_cols(x, need_dw, scale_mode)
            wr, wc = _rows_and_cols(weight, need_dx, scale_mode)
            y = mx_matmul(xr, wr, "NT", torch.float32)[: x.shape[0]]
            if bias is not None:
                y = y + bias.float()
        _save(ctx, xc, wc)
        ctx.meta = (x.shape[0], x.dtype, weight.dtype, scale_mode)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        m, x_dtype, w_dtype, scale_mode = ctx.meta
        xc, wc = _saved(ctx, "cols")
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        dx = dw = db = None
        with torch.autocast(dy.device.type, enabled=False):
            if need_dx and need_dw:
                dyr, dyc = quantize_dual(pad_rows(dy), scale_mode)
            else:
                dyr = quantize(dy, "rows", scale_mode) if need_dx else None
                dyc = quantize(pad_rows(dy), "cols", scale_mode) if need_dw else None
            if need_dx:
                dx = mx_matmul(dyr, wc, "NN", x_dtype)[:m]
            if need_dw:
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
    """Per-group ``y_g = x_g @ weight[g].T`` over tokens sorted by group (``weight``: (G, N, K))."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, offsets: list[int], scale_mode: str):
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        with torch.autocast(x.device.type, enabled=False):
            xr = quantize(x, "rows", scale_mode)
            xc = quantize_grouped(x, offsets, "cols", scale_mode) if need_dw else None
            wr, wc = quantize_dual(weight, scale_mode) if need_dx else (quantize(weight, "rows", scale_mode), None)
            y = mx_grouped_matmul(xr, wr, offsets, "NT", x.dtype)
        _save(ctx, xc, wc)
        ctx.meta = (offsets, x.dtype, weight.dtype, scale_mode)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        offsets, x_dtype, w_dtype, scale_mode = ctx.meta
        xc, wc = _saved(ctx, "cols")
        dx = dw = None
        with torch.autocast(dy.device.type, enabled=False):
            if ctx.needs_input_grad[0]:
                dx = mx_grouped_matmul(quantize(dy, "rows", scale_mode), wc, offsets, "NN", x_dtype)
            if ctx.needs_input_grad[1]:
                dyc = quantize_grouped(dy, offsets, "cols", scale_mode)
                dw = mx_grouped_matmul(dyc, xc, offsets, "TN", w_dtype)
        return dx, dw, None, None


def as_offsets(group_offsets: Sequence[int] | torch.Tensor, total: int) -> list[int]:
    """Cumulative end offsets as a list of ints (a tensor is read once, on the host)."""
    if isinstance(group_offsets, torch.Tensor):
        group_offsets = group_offsets.tolist()
    return check_offsets(group_offsets, total)


def mx_grouped_linear(x: torch.Tensor, weight: torch.Tensor, group_offsets: Sequence[int] | torch.Tensor,
                      scale_mode: str = "floor") -> torch.Tensor:
    """Per-expert linear (no bias) on MXFP8 operands; ``x`` (T, K) sorted by group, ``weight`` (G, N, K)."""
    return MXGroupedLinearFunction.apply(x, weight, as_offsets(group_offsets, x.shape[0]), scale_mode)
