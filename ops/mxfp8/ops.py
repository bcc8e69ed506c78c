"""Registry entries of the MXFP8 ops. A quantised operand is two buffers: E4M3 data + E8M0 scales.

| op                  | engine | inputs                      | outputs                          | attrs                                   |
|---------------------|--------|-----------------------------|----------------------------------|-----------------------------------------|
| mx_quantize         | vector | x                           | data, scales                     | axis, scale_mode                        |
| mx_quantize_dual    | vector | x                           | row data/scales, col data/scales | scale_mode                              |
| mx_quantize_grouped | vector | x (T,K)                     | data (Tp,K), scales              | group_offsets, axis, scale_mode         |
| mx_dequantize       | vector | data, scales                | y                                | axis, out_dtype                         |
| mx_matmul           | cube   | a data/scales, b data/scales | y                               | layout, out_dtype                       |
| mx_grouped_matmul   | cube   | a data/scales, b data/scales | y                               | group_offsets, layout, out_dtype        |

Costs count the 1-byte payload plus the scale bytes; matmuls use precision ``mxfp8`` so a
simulator picks the profile's MXFP8 cube rate. Every op has a tile kernel that writes the
task's output tiles in place (quantisation and dequantisation through the compiled
kernels when built, :mod:`megaloom.ops.mxfp8.kernels`).
"""
from __future__ import annotations

from typing import Any

import torch

from megaloom.ops.basic import precision
from megaloom.ops.mxfp8.format import (
    MXTensor, check_mode, dequantize, quantize, quantize_dual, scale_shape,
)
from megaloom.ops.mxfp8 import kernels
from megaloom.ops.mxfp8.grouped import check_offsets, group_tiles, padded_offsets, quantize_grouped
from megaloom.ops.mxfp8.matmul import layout_axes, mx_grouped_matmul, mx_matmul
from megaloom.runtime.dtypes import dtype_name, torch_dtype
from megaloom.runtime.errors import GraphError
from megaloom.runtime.registry import Cost, OpDef, TensorSpec, register

DATA, SCALES = "float8_e4m3fn", "float8_e8m0fnu"
QUANT_FLOPS_PER_ELEMENT = 4.0  # abs, max, scale, round
_FLOAT_INPUTS = ("float32", "bfloat16", "float16")


def _n_inputs(ins: list[TensorSpec], n: int, op: str) -> None:
    if len(ins) != n:
        raise GraphError(f"{op} takes {n} inputs, got {len(ins)}")


def _float_input(x: TensorSpec, op: str) -> None:
    if x.dtype not in _FLOAT_INPUTS:
        raise GraphError(f"{op} quantises {'/'.join(_FLOAT_INPUTS)}, got {x.dtype}")


def _quantized(data: TensorSpec, scales: TensorSpec, axis: str, what: str) -> None:
    if data.dtype != DATA or scales.dtype != SCALES:
        raise GraphError(f"{what} must be {DATA} data + {SCALES} scales, got {data.dtype} + {scales.dtype}")
    want = scale_shape(data.shape, axis)
    if tuple(scales.shape) != want:
        raise GraphError(f"{what}: scales {scales.shape} do not match data {data.shape} blocked by {axis} ({want})")


def _qspecs(shape: tuple[int, ...], axis: str) -> list[TensorSpec]:
    return [TensorSpec(tuple(shape), DATA), TensorSpec(scale_shape(tuple(shape), axis), SCALES)]


def _out_dtype(attrs: dict[str, Any]) -> str:
    return dtype_name(attrs.get("out_dtype", "float32"))


# -- quantisation ---------------------------------------------------------------------------
def _quantize_shape(ins: list[TensorSpec], attrs: dict) -> list[TensorSpec]:
    _n_inputs(ins, 1, "mx_quantize")
    _float_input(ins[0], "mx_quantize")
    check_mode(attrs.get("scale_mode", "floor"))
    return _qspecs(ins[0].shape, attrs.get("axis", "rows"))


def _quantize_dual_shape(ins: list[TensorSpec], attrs: dict) -> list[TensorSpec]:
    _n_inputs(ins, 1, "mx_quantize_dual")
    _float_input(ins[0], "mx_quantize_dual")
    check_mode(attrs.get("scale_mode", "floor"))
    return _qspecs(ins[0].shape, "rows") + _qspecs(ins[0].shape, "cols")


def _quantize_grouped_shape(ins: list[TensorSpec], attrs: dict) -> list[TensorSpec]:
    _n_inputs(ins, 1, "mx_quantize_grouped")
    _float_input(ins[0], "mx_quantize_grouped")
    check_mode(attrs.get("scale_mode", "floor"))
    if len(ins[0].shape) != 2:
        raise GraphError(f"mx_quantize_grouped takes a 2-D (tokens, features) input, got {ins[0].shape}")
    offs = check_offsets(attrs.get("group_offsets", []), ins[0].shape[0])
    axis = attrs.get("axis", "cols")
    rows = padded_offsets(offs)[-1] if axis == "cols" else ins[0].shape[0]
    return _qspecs((rows, ins[0].shape[1]), axis)


def _quantize_cost(ins: list[TensorSpec], outs: list[TensorSpec], attrs: dict) -> Cost:
    return Cost(flops=QUANT_FLOPS_PER_ELEMENT * ins[0].numel * (len(outs) // 2),
                bytes=ins[0].nbytes + sum(o.nbytes for o in outs), precision=precision(ins[0].dtype))


def _quantize_ref(x: torch.Tensor, axis: str = "rows", scale_mode: str = "floor"):
    return tuple(quantize(x, axis, scale_mode)[:2])


def _quantize_dual_ref(x: torch.Tensor, scale_mode: str = "floor"):
    r, c = quantize_dual(x, scale_mode)
    return r.data, r.scales, c.data, c.scales


def _quantize_grouped_ref(x: torch.Tensor, group_offsets=(), axis: str = "cols", scale_mode: str = "floor"):
    return tuple(quantize_grouped(x, group_offsets, axis, scale_mode)[:2])


# Tile kernels: write a task's (possibly strided) output tiles in place through the compiled
# kernels; without them, or for layouts they do not take, copy the torch results in.
def _copy_into(outs, results) -> None:
    for o, r in zip(outs, results):
        o.copy_(r)


def _quantize_kernel(ins, outs, axis: str = "rows", scale_mode: str = "floor") -> None:
    pair = (outs[0], outs[1])
    if not (kernels.usable(ins[0], *outs) and kernels.quantize_into(
            ins[0], pair if axis == "rows" else None, pair if axis == "cols" else None, scale_mode)):
        _copy_into(outs, _quantize_ref(ins[0], axis, scale_mode))


def _quantize_dual_kernel(ins, outs, scale_mode: str = "floor") -> None:
    if not (kernels.usable(ins[0], *outs) and kernels.quantize_into(ins[0], outs[:2], outs[2:], scale_mode)):
        _copy_into(outs, _quantize_dual_ref(ins[0], scale_mode))


def _quantize_grouped_kernel(ins, outs, group_offsets=(), axis: str = "cols", scale_mode: str = "floor") -> None:
    cols = axis == "cols"
    tiles = group_tiles(check_offsets(group_offsets, ins[0].shape[0])) if cols else None
    if not (kernels.usable(ins[0], *outs) and kernels.quantize_into(
            ins[0], None if cols else outs[:2], outs[:2] if cols else None, scale_mode, tiles)):
        _copy_into(outs, _quantize_grouped_ref(ins[0], group_offsets, axis, scale_mode))


# -- dequantisation -------------------------------------------------------------------------
def _dequantize_shape(ins: list[TensorSpec], attrs: dict) -> list[TensorSpec]:
    _n_inputs(ins, 2, "mx_dequantize")
    _quantized(ins[0], ins[1], attrs.get("axis", "rows"), "mx_dequantize input")
    return [TensorSpec(ins[0].shape, _out_dtype(attrs))]


def _dequantize_cost(ins: list[TensorSpec], outs: list[TensorSpec], attrs: dict) -> Cost:
    return Cost(flops=float(outs[0].numel), bytes=sum(s.nbytes for s in ins) + outs[0].nbytes,
                precision=precision(outs[0].dtype))


def _dequantize_ref(data, scales, axis: str = "rows", out_dtype: str = "float32"):
    return dequantize(data, scales, axis, torch_dtype(out_dtype))


def _dequantize_kernel(ins, outs, axis: str = "rows", out_dtype: str = "float32") -> None:
    if not (kernels.usable(*ins, *outs) and kernels.dequantize_into(ins[0], ins[1], axis, outs[0])):
        outs[0].copy_(_dequantize_ref(ins[0], ins[1], axis, out_dtype))


# -- matmuls ----------------------------------------------------------------------------------
def _operands(ins: list[TensorSpec], attrs: dict, op: str) -> str:
    """Check ``op``'s inputs (a data, a scales, b data, b scales) against its layout; return the layout."""
    _n_inputs(ins, 4, op)
    layout = attrs.get("layout", "NT")
    ax_a, ax_b = layout_axes(layout)
    _quantized(ins[0], ins[1], ax_a, f"{op} operand a")
    _quantized(ins[2], ins[3], ax_b, f"{op} operand b")
    return layout


def _matmul_shape(ins: list[TensorSpec], attrs: dict) -> list[TensorSpec]:
    layout = _operands(ins, attrs, "mx_matmul")
    a, b = ins[0].shape, ins[2].shape
    if len(a) != 2 or len(b) != 2:
        raise GraphError(f"mx_matmul takes 2-D operands, got {a} and {b}")
    (m, k) = a[::-1] if layout[0] == "T" else a
    (kb, n) = b[::-1] if layout[1] == "T" else b
    if k != kb:
        raise GraphError(f"mx_matmul {layout}: inner dims differ, {a} x {b}")
    return [TensorSpec((m, n), _out_dtype(attrs))]


def _grouped_shape(ins: list[TensorSpec], attrs: dict) -> list[TensorSpec]:
    layout = _operands(ins, attrs, "mx_grouped_matmul")
    offs = check_offsets(attrs.get("group_offsets", []))
    a, b = ins[0].shape, ins[2].shape
    if layout == "TN":
        rows = padded_offsets(offs)[-1]
        if len(a) != 2 or len(b) != 2 or a[0] != rows or b[0] != rows:
            raise GraphError(f"mx_grouped_matmul TN: operands {a}, {b} must be 2-D with {rows} padded rows")
        return [TensorSpec((len(offs), a[1], b[1]), _out_dtype(attrs))]
    if len(a) != 2 or len(b) != 3 or a[0] != offs[-1] or b[0] != len(offs):
        raise GraphError(f"mx_grouped_matmul {layout}: a {a} must be ({offs[-1]}, K), b {b} must be ({len(offs)}, N, K)")
    k, n = (b[2], b[1]) if layout == "NT" else (b[1], b[2])
    if a[1] != k:
        raise GraphError(f"mx_grouped_matmul {layout}: inner dims differ, {a} x {b}")
    return [TensorSpec((a[0], n), _out_dtype(attrs))]


def _matmul_cost(ins: list[TensorSpec], outs: list[TensorSpec], attrs: dict) -> Cost:
    a, out = ins[0].shape, outs[0].shape
    inner = a[0] if attrs.get("layout", "NT")[0] == "T" else a[1]
    return Cost(flops=2.0 * inner * out[-2] * out[-1],  # grouped TN: (G, N, K) out, Tp tokens contracted
                bytes=sum(s.nbytes for s in ins) + outs[0].nbytes, precision="mxfp8")


def _mx(data, scales, axis) -> MXTensor:
    return MXTensor(data, scales, axis)


def _matmul_ref(ad, asc, bd, bsc, layout: str = "NT", out_dtype: str = "float32"):
    ax_a, ax_b = layout_axes(layout)
    return mx_matmul(_mx(ad, asc, ax_a), _mx(bd, bsc, ax_b), layout, torch_dtype(out_dtype), native=False)


def _matmul_kernel(ins, outs, layout: str = "NT", out_dtype: str = "float32") -> None:
    ax_a, ax_b = layout_axes(layout)
    outs[0].copy_(mx_matmul(_mx(ins[0], ins[1], ax_a), _mx(ins[2], ins[3], ax_b), layout, torch_dtype(out_dtype)))


def _grouped_ref(ad, asc, bd, bsc, group_offsets=(), layout: str = "NT", out_dtype: str = "float32", out=None):
    ax_a, ax_b = layout_axes(layout)
    return mx_grouped_matmul(_mx(ad, asc, ax_a), _mx(bd, bsc, ax_b), group_offsets, layout, torch_dtype(out_dtype),
                             out=out)


def _grouped_kernel(ins, outs, group_offsets=(), layout: str = "NT", out_dtype: str = "float32") -> None:
    _grouped_ref(*ins, group_offsets=group_offsets, layout=layout, out_dtype=out_dtype, out=outs[0])


register(OpDef("mx_quantize", ("vector",), _quantize_ref, _quantize_shape, _quantize_cost, _quantize_kernel,
               doc="MXFP8 quantisation along rows (last dim) or cols (dim -2)"))
register(OpDef("mx_quantize_dual", ("vector",), _quantize_dual_ref, _quantize_dual_shape, _quantize_cost,
               _quantize_dual_kernel, doc="row-wise and column-wise MXFP8 quantisation in one pass"))
register(OpDef("mx_quantize_grouped", ("vector",), _quantize_grouped_ref, _quantize_grouped_shape, _quantize_cost,
               _quantize_grouped_kernel, doc="MXFP8 quantisation per token group, each group zero-padded to 32 rows"))
register(OpDef("mx_dequantize", ("vector",), _dequantize_ref, _dequantize_shape, _dequantize_cost, _dequantize_kernel,
               doc="MXFP8 to a float dtype"))
register(OpDef("mx_matmul", ("cube",), _matmul_ref, _matmul_shape, _matmul_cost, _matmul_kernel,
               doc="quantised matmul, layouts NT/NN/TN (native block-scaled GEMM where available)"))
register(OpDef("mx_grouped_matmul", ("cube",), _grouped_ref, _grouped_shape, _matmul_cost, _grouped_kernel,
               doc="quantised per-group matmul over tokens sorted by group"))
