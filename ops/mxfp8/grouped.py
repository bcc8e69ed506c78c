"""Per-expert groups along the token axis: offsets, padding, grouped quantisation.

Groups are given as cumulative end offsets ``[e_0, e_1, ..., e_{G-1}]`` (as ``offs`` of
``torch._grouped_mm``): group ``g`` holds rows ``e_{g-1}:e_g`` (``e_{-1} = 0``); empty groups
repeat an offset. Column-wise (token-axis) quantisation pads each group with zero rows up to
a multiple of 32, so no 32-row block crosses a group boundary; the padded tensor has
``padded_offsets(offsets)[-1]`` rows and group ``g`` starts at the padded offset of ``g - 1``.
Zero rows change neither scales (amax) nor products that contract over tokens.
"""
from __future__ import annotations

from typing import Sequence

import torch

from megaloom.ops.mxfp8 import kernels
from megaloom.ops.mxfp8.format import BLOCK, MXTensor, check_mode, empty_quantized, quantize
from megaloom.runtime.errors import GraphError


def check_offsets(offsets: Sequence[int], total: int | None = None) -> list[int]:
    """Offsets as a list of ints; non-decreasing, non-negative, ending at ``total`` when given."""
    offs = [int(o) for o in offsets]
    if not offs:
        raise GraphError("group_offsets is empty: give one cumulative end offset per group")
    if offs[0] < 0 or any(b < a for a, b in zip(offs, offs[1:])):
        raise GraphError(f"group_offsets must be non-decreasing and non-negative, got {offs}")
    if total is not None and offs[-1] != total:
        raise GraphError(f"group_offsets end at {offs[-1]} but the tensor has {total} rows")
    return offs


def bounds(offsets: Sequence[int]) -> list[tuple[int, int]]:
    """(start, end) rows of each group."""
    return list(zip([0, *offsets[:-1]], offsets))


def padded_offsets(offsets: Sequence[int]) -> list[int]:
    """Cumulative ends after padding each group to a multiple of 32 rows."""
    out, acc = [], 0
    for a, b in bounds(offsets):
        acc += -(-(b - a) // BLOCK) * BLOCK
        out.append(acc)
    return out


def pad_groups(x: torch.Tensor, offsets: Sequence[int]) -> torch.Tensor:
    """``x`` (T, ...) with each group's rows followed by zero rows up to a multiple of 32."""
    offs = check_offsets(offsets, x.shape[0])
    padded = padded_offsets(offs)
    if padded == offs:
        return x
    dest = torch.cat([torch.arange(p, p + (b - a)) for (a, b), p in zip(bounds(offs), [0, *padded[:-1]])])
    out = x.new_zeros((padded[-1], *x.shape[1:]))
    out[dest.to(x.device)] = x
    return out


def group_tiles(offsets: Sequence[int]) -> list[tuple[int, int, int]]:
    """The 32-row tiles of column-wise grouped quantisation: (first row of the input, rows
    taken from it, first row of the padded output); a tile's other rows are zeros."""
    starts = [0, *padded_offsets(offsets)[:-1]]
    return [(a + t, min(BLOCK, b - a - t), p + t) for (a, b), p in zip(bounds(offsets), starts)
            for t in range(0, b - a, BLOCK)]


def quantize_grouped(x: torch.Tensor, offsets: Sequence[int], axis: str = "cols", scale_mode: str = "floor") -> MXTensor:
    """Quantise ``x`` (T, K) per group. ``cols``: blocks along tokens, groups padded to 32 rows
    (output has the padded row count); ``rows``: blocks along K, which never cross groups."""
    offs = check_offsets(offsets, x.shape[0])
    if axis != "cols":
        return quantize(x, axis, scale_mode)
    if x.dim() == 2 and x.dtype in kernels.QUANT_DTYPES and kernels.usable(x):
        check_mode(scale_mode)
        q = empty_quantized((padded_offsets(offs)[-1], x.shape[1]), "cols")
        if kernels.quantize_into(x, None, q[:2], scale_mode, group_tiles(offs)):
            return q
    return quantize(pad_groups(x, offs), axis, scale_mode)
