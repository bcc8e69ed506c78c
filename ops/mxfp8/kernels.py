"""MXFP8 quantisation and dequantisation through the compiled kernels (``megaloom.ops._native``).

One pass over the input per call: a row-wise call streams rows (amax of each 32-element
block, scale code, encode); a column-wise or dual call works on 32-row tiles held as
float32 in L1/L2, so the dual call reads the input once for both axes. Grouped
column-wise quantisation runs the same tiles with each group's last tile topped up with
zero rows, writing the padded layout directly. The results are bit-identical with the
torch implementation in :mod:`megaloom.ops.mxfp8.format` (the oracle; tests compare
them over every E4M3 code and E8M0 scale), which runs when the extension is not built or
is switched off (:mod:`megaloom.ops.native`), or for tensors not on the CPU.

Every function writes into given tensors, which may be views of larger buffers (row
strides are free; elements within a row must be contiguous), so registry kernels can
write a task's output tiles in place.
"""
from __future__ import annotations

from array import array
from typing import Sequence

import torch

from megaloom.ops import native
from megaloom.runtime.errors import GraphError

QUANT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def usable(*tensors: torch.Tensor) -> bool:
    """True when the compiled kernels can take these CPU tensors."""
    return native.enabled() and all(t.device.type == "cpu" for t in tensors)


def _rows2d(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` as a 2-D view (rows, last dim) with unit inner stride, or None if no such view."""
    if t.dim() < 2 or (t.numel() and t.stride(-1) != 1):
        return None
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        return None


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def quantize_into(x: torch.Tensor, rows: tuple[torch.Tensor, torch.Tensor] | None,
                  cols: tuple[torch.Tensor, torch.Tensor] | None, scale_mode: str,
                  tiles: Sequence[tuple[int, int, int]] | None = None) -> bool:
    """Quantise ``x`` (..., R, C) into row-wise and/or column-wise (data, scales) tensors.

    ``tiles``: the column-wise 32-row tiles as (first row of ``x``, rows taken, first row of
    ``cols``), the rest of a tile reading as zeros (grouped quantisation); default: every
    32 rows in place. Returns False, writing nothing, when a tensor's layout does not fit
    the kernels.
    """
    _check(x, rows, cols, tiles)
    x2 = _rows2d(x if x.stride(-1) == 1 or not x.numel() else x.contiguous())
    views = [_rows2d(_u8(t)) for pair in (rows, cols) if pair is not None for t in pair]
    if x2 is None or any(v is None for v in views):
        return False
    rd, rs, cd, cs = (views[:2] if rows is not None else [None, None]) + (views[-2:] if cols is not None else [None, None])
    packed = None if tiles is None else array("q", [v for t in tiles for v in t]).tobytes()
    ptr = lambda v: 0 if v is None else v.data_ptr()  # noqa: E731
    stride = lambda v: 0 if v is None else v.stride(0)  # noqa: E731
    native.ext.mx_quantize(x2.data_ptr(), native.DTYPE_CODES[x.dtype], x2.shape[0], x2.shape[1], x2.stride(0),
                           ptr(rd), stride(rd), ptr(rs), stride(rs), ptr(cd), stride(cd), ptr(cs), stride(cs),
                           int(scale_mode == "rceil"), packed, native.threads())
    return True


def _scales(shape: tuple[int, ...], axis: str) -> tuple[int, ...]:
    """Scale shape of a (..., R, C) tensor: (..., R, C/32) row-wise, (..., R/32, C) column-wise."""
    *lead, r, c = shape
    return (*lead, r, c // 32) if axis == "rows" else (*lead, r // 32, c)


def _check(x: torch.Tensor, rows, cols, tiles) -> None:
    """GraphError unless the outputs have the shapes quantising ``x`` gives (the kernels write
    through raw pointers)."""
    want = {"rows": [tuple(x.shape), _scales(tuple(x.shape), "rows")] if rows is not None else None}
    if cols is not None:
        n = tuple(x.shape)
        if tiles is not None:
            if x.dim() != 2 or any(not (0 <= a and a + k <= n[0] and 0 <= k <= 32 and d >= 0) for a, k, d in tiles):
                raise GraphError(f"MXFP8 grouped tiles {list(tiles)[:4]}... do not fit an input of shape {n}")
            n = (max((d + 32 for _, _, d in tiles), default=0), n[1])
            n = (max(n[0], cols[0].shape[0]), n[1])
        want["cols"] = [n, _scales(n, "cols")]
    for axis, pair in (("rows", rows), ("cols", cols)):
        if pair is not None and [tuple(t.shape) for t in pair] != want[axis]:
            raise GraphError(f"MXFP8 {axis} outputs {[tuple(t.shape) for t in pair]} do not fit an input of shape "
                             f"{tuple(x.shape)} (want {want[axis]})")


def dequantize_into(data: torch.Tensor, scales: torch.Tensor, axis: str, out: torch.Tensor) -> bool:
    """``out`` = data * 2^(scale - 127) per block, rounded to ``out``'s dtype; False (nothing
    written) when a layout does not fit the kernels."""
    if tuple(out.shape) != tuple(data.shape) or tuple(scales.shape) != _scales(tuple(data.shape), axis):
        raise GraphError(f"MXFP8 dequantize: data {tuple(data.shape)}, scales {tuple(scales.shape)} and out "
                         f"{tuple(out.shape)} do not fit together (axis {axis})")
    d, s, y = _rows2d(_u8(data)), _rows2d(_u8(scales)), _rows2d(out)
    if d is None or s is None or y is None or out.dtype not in QUANT_DTYPES or d.shape[1] % 32:
        return False  # (the kernel walks 32 columns at a time, also when blocks run down the columns)
    native.ext.mx_dequantize(d.data_ptr(), d.stride(0), s.data_ptr(), s.stride(0), d.shape[0], d.shape[1],
                             int(axis == "cols"), y.data_ptr(), y.stride(0), native.DTYPE_CODES[out.dtype],
                             native.threads())
    return True
