"""Quantised matmuls: ``mx_matmul`` (layouts NT / NN / TN) and ``mx_grouped_matmul`` (experts).

Layouts name whether each operand is used as stored (N) or transposed (T); each operand
must be blocked along the contraction dim:

| layout | a        | b        | result      | Linear use          |
|--------|----------|----------|-------------|---------------------|
| NT     | (M,K) rows | (N,K) rows | a @ b.T   | Y = X W^T (forward) |
| NN     | (M,K) rows | (K,N) cols | a @ b     | dX = dY W           |
| TN     | (K,M) cols | (K,N) cols | a.T @ b   | dW = dY^T X         |

Emulation (CPU, and GPUs without MX block scaling): dequantise both operands to float32
and multiply in float32. Products of two E4M3 values and of power-of-two scales are exact
in float32, so this matches FP8 x FP8 -> FP32 accumulation up to summation order. On CPU,
when the result is bfloat16 and every block's scale code lies in [3, 246] or its data is
all zeros (so every dequantised value is exact in bfloat16), the operands are dequantised to bfloat16 instead: the CPU's
bfloat16 GEMM accumulates in float32 and rounds once, so the result is the same up to
summation order, about 3x faster. On CUDA devices with MX block-scaled GEMMs (compute
capability >= 10.0) ``torch._scaled_mm`` runs the product natively.
"""
from __future__ import annotations

from typing import Sequence

import torch

from megaloom.ops.mxfp8.format import MXTensor, block_view, dequantize
from megaloom.ops.mxfp8.grouped import bounds, check_offsets, padded_offsets
from megaloom.runtime.errors import GraphError

LAYOUTS = {"NT": ("rows", "rows"), "NN": ("rows", "cols"), "TN": ("cols", "cols")}
BF16_EXACT_CODES = (3, 246)  # E8M0 codes whose block values are all exact in bfloat16


def layout_axes(layout: str) -> tuple[str, str]:
    """The blocked axis each operand needs under ``layout``."""
    if layout not in LAYOUTS:
        raise GraphError(f"MXFP8 matmul layout must be one of {sorted(LAYOUTS)}, got {layout!r}")
    return LAYOUTS[layout]


def _check_axes(a: MXTensor, b: MXTensor, layout: str) -> None:
    want = layout_axes(layout)
    if (a.axis, b.axis) != want:
        raise GraphError(f"MXFP8 matmul {layout} needs operands blocked by {want}, got ({a.axis!r}, {b.axis!r})")


def _orient(x: torch.Tensor, transposed: bool) -> torch.Tensor:
    return x.transpose(-1, -2) if transposed else x


def _bf16_exact(q: MXTensor) -> bool:
    """True when every block of ``q`` dequantises exactly into bfloat16: its code lies in
    BF16_EXACT_CODES (or is NaN), or the block is all zeros (as padding and zero blocks are)."""
    lo, hi = BF16_EXACT_CODES
    c = q.scales.view(torch.uint8)
    if bool(((c > hi) & (c != 0xFF)).any()):
        return False
    low = c < lo
    return not bool(low.any()) or not bool((block_view(q.data.view(torch.uint8), q.axis)[low] & 0x7F).any())


def emulation_dtype(a: MXTensor, b: MXTensor, out_dtype: torch.dtype) -> torch.dtype:
    """bfloat16 on CPU for a bfloat16 result when both operands dequantise exactly into it, else float32."""
    if out_dtype == torch.bfloat16 and a.data.device.type == "cpu" and _bf16_exact(a) and _bf16_exact(b):
        return torch.bfloat16
    return torch.float32


def native_available(device: torch.device) -> bool:
    """True on CUDA devices whose ``torch._scaled_mm`` takes E8M0 block scales (sm100+)."""
    return (device.type == "cuda" and hasattr(torch, "_scaled_mm")
            and torch.cuda.get_device_capability(device) >= (10, 0))


def to_blocked(scales: torch.Tensor) -> torch.Tensor:
    """(rows, K/32) scales in cuBLAS's swizzled layout: 128x4 tiles, each stored as 32x16."""
    rows, cols = scales.shape
    rp, cp = -(-rows // 128), -(-cols // 4)
    s = torch.nn.functional.pad(scales.view(torch.uint8), (0, cp * 4 - cols, 0, rp * 128 - rows))
    s = s.view(rp, 128, cp, 4).permute(0, 2, 1, 3).reshape(-1, 4, 32, 4).transpose(1, 2).reshape(-1, 32, 16)
    return s.flatten().view(torch.float8_e8m0fnu)


def _native(a: MXTensor, b: MXTensor, layout: str, out_dtype: torch.dtype) -> torch.Tensor:
    # canonical form: A (M,K) and B (N,K), both row-major and blocked along K
    ta, tb = layout[0] == "T", layout[1] == "N"
    ad, asc = (a.data.t().contiguous(), a.scales.t().contiguous()) if ta else (a.data, a.scales)
    bd, bsc = (b.data.t().contiguous(), b.scales.t().contiguous()) if tb else (b.data, b.scales)
    return torch._scaled_mm(ad, bd.t(), to_blocked(asc), to_blocked(bsc), out_dtype=out_dtype)


def mx_matmul(a: MXTensor, b: MXTensor, layout: str = "NT", out_dtype: torch.dtype = torch.float32,
              native: bool | None = None) -> torch.Tensor:
    """The product of two quantised 2-D operands under ``layout``, in ``out_dtype``.

    ``native=None`` uses the device's block-scaled GEMM when available, else emulation.
    """
    _check_axes(a, b, layout)
    if native is None:
        native = native_available(a.data.device)
    if native:
        return _native(a, b, layout, out_dtype)
    work = emulation_dtype(a, b, out_dtype)
    x = _orient(dequantize(a.data, a.scales, a.axis, work), layout[0] == "T")
    y = _orient(dequantize(b.data, b.scales, b.axis, work), layout[1] == "T")
    if x.shape[-1] != y.shape[-2]:
        raise GraphError(f"MXFP8 matmul {layout}: inner dims differ, {tuple(a.data.shape)} x {tuple(b.data.shape)}")
    return (x @ y).to(out_dtype)


def mx_grouped_matmul(a: MXTensor, b: MXTensor, offsets: Sequence[int], layout: str = "NT",
                      out_dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
    """Per-group products over tokens sorted by group (emulated).

    NT: a (T,K) rows, b (G,N,K) rows -> (T,N), rows of group g times b[g]^T.
    NN: a (T,N) rows, b (G,N,K) cols -> (T,K), rows of group g times b[g].
    TN: a (Tp,N), b (Tp,K), both grouped column-wise (padded) -> (G,N,K), a_g^T b_g.
    ``out``: a tensor of the result's shape and ``out_dtype`` to write (and return); each
    group's product goes straight into it when the emulation dtype is ``out_dtype``.
    """
    _check_axes(a, b, layout)
    offs = check_offsets(offsets)
    work = emulation_dtype(a, b, out_dtype)
    x, y = dequantize(a.data, a.scales, a.axis, work), dequantize(b.data, b.scales, b.axis, work)
    if layout == "TN":
        if x.shape[0] != padded_offsets(offs)[-1] or y.shape[0] != x.shape[0]:
            raise GraphError(f"MXFP8 grouped TN: operands {tuple(x.shape)}, {tuple(y.shape)} do not hold "
                             f"{padded_offsets(offs)[-1]} padded rows for offsets {offs}")
        res = _result(out, (len(offs), x.shape[1], y.shape[1]), x)
        for g, (s, e) in enumerate(bounds(padded_offsets(offs))):
            torch.matmul(x[s:e].t(), y[s:e], out=res[g])
        return _finish(res, out, out_dtype)
    if y.dim() != 3 or y.shape[0] != len(offs) or x.shape[0] != offs[-1]:
        raise GraphError(f"MXFP8 grouped {layout}: a {tuple(x.shape)}, b {tuple(y.shape)} do not fit offsets {offs}")
    w = y.transpose(1, 2) if layout == "NT" else y
    res = _result(out, (x.shape[0], w.shape[2]), x)
    for g, (s, e) in enumerate(bounds(offs)):
        torch.matmul(x[s:e], w[g], out=res[s:e])
    return _finish(res, out, out_dtype)


def _result(out: torch.Tensor | None, shape: tuple[int, ...], x: torch.Tensor) -> torch.Tensor:
    """Where the group products go: ``out`` itself when it has the emulation dtype of ``x``."""
    if out is not None and tuple(out.shape) != shape:
        raise GraphError(f"MXFP8 grouped matmul: out has shape {tuple(out.shape)}, the result is {shape}")
    return out if out is not None and out.dtype == x.dtype else x.new_empty(shape)


def _finish(res: torch.Tensor, out: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    if out is None:
        return res.to(out_dtype)
    return out if res is out else out.copy_(res)
