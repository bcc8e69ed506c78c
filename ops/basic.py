"""The built-in op set: matmul, element-wise add/mul/silu, copy and noop.

| op     | engine      | what it computes                                   |
|--------|-------------|----------------------------------------------------|
| matmul | cube        | ``a @ b`` (each transposed when ``trans_a``/``trans_b``) |
| add    | vector      | ``a + b`` (broadcasting)                           |
| mul    | vector      | ``a * b`` (broadcasting)                           |
| silu   | vector      | ``x * sigmoid(x)``                                 |
| copy   | vector/comm | ``x`` (a copy into another region)                 |
| noop   | any         | nothing: for control tasks and dispatch benchmarks |
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megaloom.runtime.errors import GraphError
from megaloom.runtime.registry import Cost, OpDef, TensorSpec, register

PRECISION = {"float32": "fp32", "float64": "fp64", "bfloat16": "bf16", "float16": "fp16",
             "float8_e4m3fn": "fp8"}


def precision(dtype: str) -> str:
    """The rate class of a compute dtype in hardware profiles."""
    return PRECISION.get(dtype, "fp32")


def elementwise_cost(ins: list[TensorSpec], outs: list[TensorSpec], attrs: dict, flops_per: float = 1.0) -> Cost:
    n = max((o.numel for o in outs), default=0)
    return Cost(flops=flops_per * n, bytes=sum(s.nbytes for s in ins) + sum(o.nbytes for o in outs),
                precision=precision(outs[0].dtype if outs else "float32"))


def broadcast_shape(ins: list[TensorSpec], attrs: dict) -> list[TensorSpec]:
    if not ins:
        raise GraphError("expects at least 1 input, got none")
    try:
        shape = tuple(torch.broadcast_shapes(*(s.shape for s in ins)))
    except RuntimeError as e:
        raise GraphError(f"shapes {[s.shape for s in ins]} do not broadcast") from e
    dtypes = {s.dtype for s in ins}
    if len(dtypes) != 1:
        raise GraphError(f"operands have different dtypes {sorted(dtypes)}")
    return [TensorSpec(shape, ins[0].dtype)]


def binary_shape(ins: list[TensorSpec], attrs: dict) -> list[TensorSpec]:
    """Two operands broadcast together."""
    if len(ins) != 2:
        raise GraphError(f"expects 2 inputs, got {len(ins)}")
    return broadcast_shape(ins, attrs)


def same_shape(ins: list[TensorSpec], attrs: dict) -> list[TensorSpec]:
    if len(ins) != 1:
        raise GraphError(f"expects 1 input, got {len(ins)}")
    return [ins[0]]


def _mnk(ins: list[TensorSpec], attrs: dict) -> tuple[int, int, int, int]:
    """(m, k, k of b, n) of ``op(a) @ op(b)``, op transposing when ``trans_a``/``trans_b``."""
    a, b = ins[0].shape, ins[1].shape
    m, k = (a[1], a[0]) if attrs.get("trans_a") else a
    kb, n = (b[1], b[0]) if attrs.get("trans_b") else b
    return m, k, kb, n


def _matmul_shape(ins: list[TensorSpec], attrs: dict) -> list[TensorSpec]:
    if len(ins) != 2 or len(ins[0].shape) != 2 or len(ins[1].shape) != 2:
        raise GraphError(f"matmul takes two 2-D operands, got {[s.shape for s in ins]}")
    m, k, kb, n = _mnk(ins, attrs)
    if k != kb:
        flags = "".join(f" ({f})" for f in ("trans_a", "trans_b") if attrs.get(f))
        raise GraphError(f"matmul inner dims differ: {ins[0].shape} x {ins[1].shape}{flags}")
    if ins[0].dtype != ins[1].dtype:
        raise GraphError(f"matmul operand dtypes differ: {ins[0].dtype} vs {ins[1].dtype}")
    return [TensorSpec((m, n), attrs.get("out_dtype", ins[0].dtype))]


def _matmul_cost(ins: list[TensorSpec], outs: list[TensorSpec], attrs: dict) -> Cost:
    m, k, _, n = _mnk(ins, attrs)
    return Cost(flops=2.0 * m * n * k, bytes=sum(s.nbytes for s in ins) + outs[0].nbytes,
                precision=precision(ins[0].dtype))


def _matmul_ref(a: torch.Tensor, b: torch.Tensor, trans_a: bool = False, trans_b: bool = False,
                out_dtype: str | None = None) -> torch.Tensor:
    y = (a.t() if trans_a else a) @ (b.t() if trans_b else b)
    return y if out_dtype is None else y.to(getattr(torch, out_dtype))


def _matmul_kernel(ins, outs, trans_a: bool = False, trans_b: bool = False, out_dtype: str | None = None) -> None:
    a, b = ins
    a, b = a.t() if trans_a else a, b.t() if trans_b else b
    if (out_dtype is None or outs[0].dtype == a.dtype) and outs[0].is_contiguous():
        torch.mm(a, b, out=outs[0])
    else:
        outs[0].copy_(a @ b)


def _binary_kernel(fn):
    def kernel(ins, outs, **attrs) -> None:
        fn(ins[0], ins[1], out=outs[0])
    return kernel


def _silu_kernel(ins, outs) -> None:
    torch.ops.aten.silu.out(ins[0], out=outs[0])


def _copy_kernel(ins, outs) -> None:
    outs[0].copy_(ins[0])


def _noop_shape(ins: list[TensorSpec], attrs: dict) -> list[TensorSpec]:
    return [TensorSpec(tuple(s), d) for s, d in attrs.get("out_specs", [])]


def _noop_ref(*ins, out_specs=(), **attrs):
    return tuple(torch.zeros(tuple(s), dtype=getattr(torch, d)) for s, d in out_specs)


def _noop_kernel(ins, outs, **attrs) -> None:
    for o in outs:
        o.zero_()


_IN_PLACE = {"in_place": True}  # element-wise: an output may be the very region an input is

register(OpDef("matmul", ("cube",), _matmul_ref, _matmul_shape, _matmul_cost, _matmul_kernel,
               doc="a @ b, a or b transposed when trans_a or trans_b; out_dtype casts the result"))
register(OpDef("add", ("vector",), torch.add, binary_shape, elementwise_cost, _binary_kernel(torch.add),
               doc="a + b with broadcasting", extra=_IN_PLACE))
register(OpDef("mul", ("vector",), torch.mul, binary_shape, elementwise_cost, _binary_kernel(torch.mul),
               doc="a * b with broadcasting", extra=_IN_PLACE))
register(OpDef("silu", ("vector",), F.silu, same_shape, lambda i, o, a: elementwise_cost(i, o, a, 4.0),
               _silu_kernel, doc="x * sigmoid(x)", extra=_IN_PLACE))
register(OpDef("copy", ("vector", "comm"), lambda x: x.clone(), same_shape,
               lambda i, o, a: Cost(bytes=2 * i[0].nbytes, precision=precision(i[0].dtype)), _copy_kernel,
               doc="copy a region into another", extra=_IN_PLACE))
register(OpDef("noop", ("vector", "cube", "comm"), _noop_ref, _noop_shape, lambda i, o, a: Cost(),
               _noop_kernel, doc="does nothing; attrs['out_specs'] declares (zeroed) outputs"))
