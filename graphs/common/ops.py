"""Tile ops shared by MegaGate and MegaMHC: small projections accumulated in float32.

| op                | engine | what it computes                                                     |
|-------------------|--------|----------------------------------------------------------------------|
| proj              | cube   | ``a.flat @ w^T`` accumulated (``a`` [m, ...] flattened to [m, k])     |
| proj_grad_input   | cube   | ``g @ w`` reshaped to [m, *cols], cast to ``out_dtype``               |
| proj_grad_weight  | cube   | ``[acc +] g^T @ a.flat`` accumulated, cast to ``out_dtype`` (chains)  |
| sum_partials      | vector | ``p.sum(0)`` accumulated, cast to ``out_dtype`` (per-tile partials)   |

"Accumulated" means in float32 (float64 for float64 operands): bfloat16 operands are
multiplied as float32 copies, as a cube unit accumulates in float32.
"""
from __future__ import annotations

import math

import torch

from megaloom.ops.basic import precision
from megaloom.runtime.dtypes import torch_dtype
from megaloom.runtime.errors import GraphError
from megaloom.runtime.registry import CUBE, VECTOR, Cost, GradOf, OpDef, TensorSpec, register


def acc_dtype(dtype: str) -> str:
    """Accumulation dtype of an operand dtype: float64 stays, everything else is float32."""
    return "float64" if dtype == "float64" else "float32"


def up(x: torch.Tensor) -> torch.Tensor:
    """``x`` in its accumulation dtype (float64 stays float64; others become float32)."""
    return x if x.dtype == torch.float64 else x.float()


def _flat(a: torch.Tensor) -> torch.Tensor:
    return up(a.reshape(a.shape[0], -1))


def _cols(spec: TensorSpec) -> int:
    return math.prod(spec.shape[1:])


def io_bytes(ins: list[TensorSpec], outs: list[TensorSpec]) -> float:
    """Bytes a task reads and writes: its operands and results, once each."""
    return float(sum(s.nbytes for s in ins) + sum(o.nbytes for o in outs))


# -- proj: y = a.flat @ w^T ----------------------------------------------------------
def _proj_shape(ins: list[TensorSpec], attrs: dict) -> list[TensorSpec]:
    if len(ins) != 2 or len(ins[1].shape) != 2 or len(ins[0].shape) < 2:
        raise GraphError(f"proj takes a [m, ...] and w [n, k], got {[s.shape for s in ins]}")
    if _cols(ins[0]) != ins[1].shape[1]:
        raise GraphError(f"proj: a {ins[0].shape} flattens to {_cols(ins[0])} columns, "
                         f"w {ins[1].shape} has {ins[1].shape[1]}")
    return [TensorSpec((ins[0].shape[0], ins[1].shape[0]), acc_dtype(ins[0].dtype))]


def _proj_cost(ins: list[TensorSpec], outs: list[TensorSpec], attrs: dict) -> Cost:
    m, n = outs[0].shape
    return Cost(2.0 * m * n * ins[1].shape[1], io_bytes(ins, outs), precision=precision(ins[0].dtype))


def _proj_ref(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(_flat(a), up(w))


def _proj_kernel(ins, outs) -> None:
    torch.mm(_flat(ins[0]), up(ins[1]).t(), out=outs[0])


# -- proj_grad_input: dA = g @ w ---------------------------------------------------------
def _grad_input_shape(ins: list[TensorSpec], attrs: dict) -> list[TensorSpec]:
    if len(ins) != 2 or len(ins[0].shape) != 2 or len(ins[1].shape) != 2 or ins[0].shape[1] != ins[1].shape[0]:
        raise GraphError(f"proj_grad_input takes g [m, n] and w [n, k], got {[s.shape for s in ins]}")
    cols = tuple(attrs.get("cols", [ins[1].shape[1]]))
    if math.prod(cols) != ins[1].shape[1]:
        raise GraphError(f"proj_grad_input: cols {list(cols)} do not hold {ins[1].shape[1]} columns")
    return [TensorSpec((ins[0].shape[0], *cols), attrs.get("out_dtype", ins[1].dtype))]


def _grad_input_cost(ins: list[TensorSpec], outs: list[TensorSpec], attrs: dict) -> Cost:
    (m, n), k = ins[0].shape, ins[1].shape[1]
    return Cost(2.0 * m * n * k, io_bytes(ins, outs), precision=precision(ins[1].dtype))


def _grad_input_ref(g: torch.Tensor, w: torch.Tensor, cols=None, out_dtype: str | None = None) -> torch.Tensor:
    y = (up(g) @ up(w)).reshape(g.shape[0], *(cols or [w.shape[1]]))
    return y.to(torch_dtype(out_dtype) if out_dtype else w.dtype)


def _grad_input_kernel(ins, outs, cols=None, out_dtype: str | None = None) -> None:
    (g, w), out = ins, outs[0]
    if out.dtype == g.dtype == w.dtype and out.is_contiguous():
        torch.mm(g, w, out=out.view(g.shape[0], -1))
    else:
        out.copy_((up(g) @ up(w)).view(out.shape))


# -- proj_grad_weight: dW = [acc +] g^T @ a.flat --------------------------------------------
def _grad_weight_shape(ins: list[TensorSpec], attrs: dict) -> list[TensorSpec]:
    if len(ins) not in (2, 3) or len(ins[0].shape) != 2 or ins[0].shape[0] != ins[1].shape[0]:
        raise GraphError("proj_grad_weight takes g [m, n], a [m, ...] and an optional acc [n, k], "
                         f"got {[s.shape for s in ins]}")
    shape, acc = (ins[0].shape[1], _cols(ins[1])), acc_dtype(ins[1].dtype)
    if len(ins) == 3 and (ins[2].shape != shape or ins[2].dtype != acc):
        raise GraphError(f"proj_grad_weight: acc is {ins[2].shape} {ins[2].dtype}, expected {shape} {acc}")
    return [TensorSpec(shape, attrs.get("out_dtype", acc))]


def _grad_weight_cost(ins: list[TensorSpec], outs: list[TensorSpec], attrs: dict) -> Cost:
    (m, n), k = ins[0].shape, _cols(ins[1])
    return Cost(2.0 * m * n * k, io_bytes(ins, outs), precision=precision(ins[1].dtype))


def _grad_weight_ref(g: torch.Tensor, a: torch.Tensor, acc: torch.Tensor | None = None,
                     out_dtype: str | None = None) -> torch.Tensor:
    y = up(g).t() @ _flat(a)
    if acc is not None:
        y = acc + y
    return y.to(torch_dtype(out_dtype)) if out_dtype else y


def _grad_weight_kernel(ins, outs, out_dtype: str | None = None) -> None:
    g, a, out = up(ins[0]), _flat(ins[1]), outs[0]
    if len(ins) == 2:
        if out.dtype == a.dtype:
            torch.mm(g.t(), a, out=out)
        else:
            out.copy_(g.t() @ a)
    elif out.dtype == a.dtype:
        if out.data_ptr() != ins[2].data_ptr():
            out.copy_(ins[2])
        out.addmm_(g.t(), a)
    else:
        out.copy_(torch.addmm(ins[2], g.t(), a))


# -- sum_partials: per-tile partial sums -> one total ---------------------------------------
def _sum_shape(ins: list[TensorSpec], attrs: dict) -> list[TensorSpec]:
    if len(ins) != 1 or len(ins[0].shape) < 1:
        raise GraphError(f"sum_partials takes one [n, ...] operand, got {[s.shape for s in ins]}")
    return [TensorSpec(ins[0].shape[1:], attrs.get("out_dtype", ins[0].dtype))]


def _sum_cost(ins: list[TensorSpec], outs: list[TensorSpec], attrs: dict) -> Cost:
    return Cost(float(ins[0].numel), io_bytes(ins, outs), precision=precision(ins[0].dtype))


def _sum_ref(p: torch.Tensor, out_dtype: str | None = None) -> torch.Tensor:
    return up(p).sum(0).to(torch_dtype(out_dtype) if out_dtype else p.dtype)


def _sum_kernel(ins, outs, out_dtype: str | None = None) -> None:
    p, out = ins[0], outs[0]
    if out.dtype == p.dtype:
        torch.sum(p, 0, out=out)
    else:
        out.copy_(up(p).sum(0))


register(OpDef("proj", (CUBE,), _proj_ref, _proj_shape, _proj_cost, _proj_kernel,
               doc="a [m, ...] flattened to [m, k] times w [n, k] transposed, accumulated in float32"))
register(OpDef("proj_grad_input", (CUBE,), _grad_input_ref, _grad_input_shape, _grad_input_cost, _grad_input_kernel,
               doc="g [m, n] @ w [n, k], reshaped to [m, *cols], cast to out_dtype",
               grad_of=GradOf("proj", "dy0 x1", "dx0")))
register(OpDef("proj_grad_weight", (CUBE,), _grad_weight_ref, _grad_weight_shape, _grad_weight_cost,
               _grad_weight_kernel,
               doc="[acc +] g^T @ a.flat accumulated in float32, cast to out_dtype; chains over token tiles",
               grad_of=GradOf("proj", "dy0 x0", "dx1")))
register(OpDef("sum_partials", (VECTOR,), _sum_ref, _sum_shape, _sum_cost, _sum_kernel,
               doc="sum of per-tile partials over dim 0, accumulated, cast to out_dtype"))
