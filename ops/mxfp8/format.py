"""MXFP8 E4M3 (OCP Microscaling Formats v1.0): quantisation and dequantisation in plain torch.

A quantised tensor is a pair of buffers: ``data`` (``float8_e4m3fn``, the shape of the input)
and ``scales`` (``float8_e8m0fnu``, one per block of 32 consecutive elements along the
quantisation axis). Axis ``"rows"`` blocks the last dim (scales ``(..., R, C // 32)``),
axis ``"cols"`` blocks the second-to-last dim (scales ``(..., R // 32, C)``).

Scale rules (spec section 6.3 and the common round-up variant):

* ``floor`` (OCP, default): shared exponent ``e = floor(log2(amax)) - 8`` (8 = emax of E4M3);
  elements ``x / 2**e`` may exceed 448 and saturate to +-448.
* ``rceil``: ``2**e`` is the smallest power of two with ``448 * 2**e >= amax``; no element
  saturates unless the exponent was clamped.

``e`` is clamped to the E8M0 range [-127, 127]. Elements are rounded to nearest, ties to
even, and saturated to +-448. A block of zeros gets the smallest scale (code 0, 2**-127)
and zero data. NaN/Inf choice: a block holding any NaN or +-Inf gets the NaN scale (code
0xFF) and NaN data (code 0x7F) in every element; by the spec a NaN scale makes the whole
block decode to NaN, which is what dequantisation returns. The sign of zero is kept.

All arithmetic is exact: exponents come from ``frexp`` (integers), scaling multiplies by
exact powers of two, and torch's cast to E4M3 rounds to nearest even. float32 and bfloat16
inputs are scaled in their own dtype (bfloat16 has float32's exponent range, so the product
is exact wherever it can round to a non-zero E4M3 value); float16 is scaled in float32.

CPU tensors go through the compiled kernels (:mod:`megaloom.ops.mxfp8.kernels`) when they
are built; the torch code here is the fallback and the oracle they are tested against.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from megaloom.ops.mxfp8 import kernels
from megaloom.runtime.errors import GraphError

BLOCK = 32
E4M3_MAX = 448.0
E4M3_EMAX = 8
E8M0_BIAS = 127
E8M0_NAN = 0xFF
E4M3_NAN = 0x7F
AXES = ("rows", "cols")
SCALE_MODES = ("floor", "rceil")
INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# 2**(127 - code) for every scale code 0..254 (the multiplier that maps x to the element grid)
_INV_SCALE = torch.tensor([2.0 ** (E8M0_BIAS - c) for c in range(255)] + [float("nan")], dtype=torch.float32)


class MXTensor(NamedTuple):
    """A quantised tensor: E4M3 payload, E8M0 block scales, and the blocked axis."""

    data: torch.Tensor
    scales: torch.Tensor
    axis: str


def block_dim(axis: str) -> int:
    """The tensor dim (negative index) that ``axis`` blocks."""
    if axis not in AXES:
        raise GraphError(f"MXFP8 axis must be one of {AXES}, got {axis!r}")
    return -1 if axis == "rows" else -2


def scale_shape(shape: tuple[int, ...], axis: str) -> tuple[int, ...]:
    """Shape of the scales of a tensor of ``shape`` blocked along ``axis``; checks divisibility."""
    d = block_dim(axis)
    if len(shape) < 2:
        raise GraphError(f"MXFP8 tensors are at least 2-D, got shape {tuple(shape)}")
    if shape[d] % BLOCK:
        raise GraphError(f"MXFP8 {axis} quantisation needs dim {len(shape) + d} of {tuple(shape)} to be a multiple of {BLOCK}")
    out = list(shape)
    out[d] //= BLOCK
    return tuple(out)


def check_mode(scale_mode: str) -> str:
    if scale_mode not in SCALE_MODES:
        raise GraphError(f"MXFP8 scale_mode must be one of {SCALE_MODES}, got {scale_mode!r}")
    return scale_mode


def _work(x: torch.Tensor) -> torch.Tensor:
    """``x`` in a dtype where scaling by any power of two in [2**-127, 2**127] is exact."""
    return x if x.dtype in (torch.float32, torch.bfloat16) else x.float()


def _amax(xb: torch.Tensor, keep: int) -> torch.Tensor:
    """Absolute maximum per block as float32 (NaN if the block holds one), without an ``abs`` copy."""
    lo, hi = torch.aminmax(xb, dim=keep)
    return torch.maximum(hi, -lo).float()


def _blocked(x: torch.Tensor, axis: str) -> torch.Tensor:
    """View with the blocked dim split into (n_blocks, 32); the 32 is at index -1 (rows) or -2 (cols)."""
    *lead, r, c = x.shape
    return x.reshape(*lead, r, c // BLOCK, BLOCK) if axis == "rows" else x.reshape(*lead, r // BLOCK, BLOCK, c)


def block_view(x: torch.Tensor, axis: str) -> torch.Tensor:
    """View of ``x`` as blocks: shape ``scale_shape(x.shape, axis) + (32,)``."""
    xb = _blocked(x, axis)
    return xb if axis == "rows" else xb.transpose(-1, -2)


def scale_codes(amax: torch.Tensor, scale_mode: str) -> torch.Tensor:
    """E8M0 codes (int32, 0..255) of blocks with float32 absolute maxima ``amax``."""
    mant, ex = torch.frexp(amax)  # amax = mant * 2**ex, mant in [0.5, 1)
    if scale_mode == "floor":
        e = ex - 1 - E4M3_EMAX
    else:  # 448 = 0.875 * 2**9: amax / 448 <= 2**(ex - 9) exactly when mant <= 0.875
        e = ex - 9 + (mant > 0.875).to(torch.int32)
    e = torch.where(amax == 0, -E8M0_BIAS, e).clamp_(-E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS
    return torch.where(torch.isfinite(amax), e, E8M0_NAN)


def _encode(xb: torch.Tensor, codes: torch.Tensor, keep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Payload and scales of blocked ``xb`` (float32 or bfloat16) from per-block codes; ``keep`` is
    the dim of the 32 elements of a block, where the codes are broadcast."""
    inv = _INV_SCALE.to(xb.device, xb.dtype)[codes.long()].unsqueeze(keep)
    data = (xb * inv).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    bad = codes == E8M0_NAN
    if bool(bad.any()):
        data.view(torch.uint8).masked_fill_(bad.unsqueeze(keep).expand_as(data), E4M3_NAN)
    return data, codes.to(torch.uint8).view(torch.float8_e8m0fnu)


def _check_input(x: torch.Tensor) -> None:
    if x.dtype not in INPUT_DTYPES:
        raise GraphError(f"MXFP8 quantisation takes float32/bfloat16/float16, got {x.dtype}")


def empty_quantized(shape: tuple[int, ...], axis: str, device: torch.device | str = "cpu") -> MXTensor:
    """Uninitialised data and scales for a tensor of ``shape`` blocked along ``axis``."""
    return MXTensor(torch.empty(shape, dtype=torch.float8_e4m3fn, device=device),
                    torch.empty(scale_shape(tuple(shape), axis), dtype=torch.float8_e8m0fnu, device=device), axis)


def quantize(x: torch.Tensor, axis: str = "rows", scale_mode: str = "floor") -> MXTensor:
    """Quantise ``x`` (>= 2-D) in blocks of 32 along ``axis``."""
    _check_input(x)
    scale_shape(tuple(x.shape), axis)
    check_mode(scale_mode)
    if kernels.usable(x):
        q = empty_quantized(tuple(x.shape), axis)
        pair = (q.data, q.scales)
        if kernels.quantize_into(x, pair if axis == "rows" else None, pair if axis == "cols" else None, scale_mode):
            return q
    xb = _blocked(_work(x), axis)
    keep = -1 if axis == "rows" else -2
    codes = scale_codes(_amax(xb, keep), scale_mode)
    data, scales = _encode(xb, codes, keep)
    return MXTensor(data.reshape(x.shape), scales, axis)


def quantize_dual(x: torch.Tensor, scale_mode: str = "floor") -> tuple[MXTensor, MXTensor]:
    """Row-wise and column-wise quantisation of one working copy of ``x``."""
    _check_input(x)
    for axis in AXES:
        scale_shape(tuple(x.shape), axis)
    check_mode(scale_mode)
    if kernels.usable(x):
        r, c = empty_quantized(tuple(x.shape), "rows"), empty_quantized(tuple(x.shape), "cols")
        if kernels.quantize_into(x, r[:2], c[:2], scale_mode):
            return r, c
    xw = _work(x)
    out = []
    for axis, keep in (("rows", -1), ("cols", -2)):
        xb = _blocked(xw, axis)
        data, scales = _encode(xb, scale_codes(_amax(xb, keep), scale_mode), keep)
        out.append(MXTensor(data.reshape(x.shape), scales, axis))
    return out[0], out[1]


def dequantize(data: torch.Tensor, scales: torch.Tensor, axis: str = "rows", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``data * 2**(code - 127)`` per block (NaN scale -> NaN block), computed in float32, cast to ``dtype``."""
    want = scale_shape(tuple(data.shape), axis)
    if tuple(scales.shape) != want:
        raise GraphError(f"MXFP8 scales are {tuple(scales.shape)}, data {tuple(data.shape)} blocked by {axis} needs {want}")
    if dtype in kernels.QUANT_DTYPES and data.numel() and kernels.usable(data, scales):  # (kernels need rows)
        y = torch.empty(data.shape, dtype=dtype)
        if kernels.dequantize_into(data, scales, axis, y):
            return y
    keep = -1 if axis == "rows" else -2
    y = _blocked(data.float(), axis) * scales.float().unsqueeze(keep)
    return y.reshape(data.shape).to(dtype)


def pad_rows(x: torch.Tensor, multiple: int = BLOCK) -> torch.Tensor:
    """``x`` with zero rows appended along dim -2 up to a multiple of ``multiple``."""
    extra = -x.shape[-2] % multiple
    return x if not extra else torch.nn.functional.pad(x, (0, 0, 0, extra))
