"""The fusible vector primitives: one table row per op, one registry entry ``dvm.<name>`` each.

A primitive task reads one to three tensors; a scalar operand lives in attrs
(``scalar``, at operand position ``scalar_pos``, default the last). ``cast`` takes
``dtype``. Every evaluation, fused or not, goes through :func:`bind`, so a fused
program runs the very torch calls of the unfused chain (same rounding).

| op         | arity | kind  | computes                     |
|------------|-------|-------|------------------------------|
| neg        | 1     | num   | ``-x``                       |
| abs        | 1     | num   | ``abs(x)``                   |
| relu       | 1     | num   | ``max(x, 0)``                |
| exp        | 1     | float | ``e**x``                     |
| log        | 1     | float | natural log                  |
| sqrt       | 1     | float | square root                  |
| rsqrt      | 1     | float | ``1/sqrt(x)``                |
| reciprocal | 1     | float | ``1/x``                      |
| tanh       | 1     | float | hyperbolic tangent           |
| sigmoid    | 1     | float | ``1/(1+e**-x)``              |
| erf        | 1     | float | error function               |
| add        | 2     | num   | ``a + b``                    |
| sub        | 2     | num   | ``a - b``                    |
| mul        | 2     | num   | ``a * b``                    |
| div        | 2     | float | ``a / b``                    |
| maximum    | 2     | num   | elementwise max (NaN wins)   |
| minimum    | 2     | num   | elementwise min (NaN wins)   |
| pow        | 2     | float | ``a ** b`` (often a scalar)  |
| eq ne lt le gt ge | 2 | cmp | comparison, bool result    |
| where      | 3     | where | ``a if cond else b``         |
| cast       | 1     | cast  | ``x.to(dtype)``              |
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from megaloom.ops.basic import precision
from megaloom.runtime.dtypes import dtype_name, torch_dtype
from megaloom.runtime.errors import GraphError
from megaloom.runtime.registry import Cost, OpDef, TensorSpec, register

FLOAT_DTYPES = ("float64", "float32", "float16", "bfloat16")
INT_DTYPES = ("int64", "int32", "int8", "uint8")
PREFIX = "dvm."

Step = Callable[..., Any]  # step(out, *tensors) -> out (a fresh tensor when out is None)


@dataclass(frozen=True, slots=True)
class Primitive:
    """One fusible op: arity, dtype kind, flops and instruction cost per element, torch call.

    ``fn(*operands, out=...)`` is the torch call; ``swapped`` is the call when the scalar
    comes first (``None``: that order is invalid); ``icost`` weighs the op for the split limits.
    """

    name: str
    arity: int
    kind: str
    fn: Callable[..., Any]
    flops: float = 1.0
    icost: float = 1.0
    swapped: Callable[..., Any] | None = None


def _relu(x, out=None):
    return torch.clamp_min(x, 0, out=out)


def _rsub(s, x, out=None):
    return torch.ops.aten.rsub.Scalar(x, s) if out is None else torch.ops.aten.rsub.Scalar_out(x, s, out=out)


def _flip(fn):
    return lambda s, x, out=None: fn(x, s, out=out)


PRIMITIVES: dict[str, Primitive] = {p.name: p for p in [
    Primitive("neg", 1, "num", torch.neg),
    Primitive("abs", 1, "num", torch.abs),
    Primitive("relu", 1, "num", _relu),
    Primitive("exp", 1, "float", torch.exp, 4, 4),
    Primitive("log", 1, "float", torch.log, 4, 4),
    Primitive("sqrt", 1, "float", torch.sqrt, 2, 2),
    Primitive("rsqrt", 1, "float", torch.rsqrt, 2, 2),
    Primitive("reciprocal", 1, "float", torch.reciprocal),
    Primitive("tanh", 1, "float", torch.tanh, 4, 4),
    Primitive("sigmoid", 1, "float", torch.sigmoid, 4, 4),
    Primitive("erf", 1, "float", torch.erf, 4, 4),
    Primitive("add", 2, "num", torch.add, swapped=_flip(torch.add)),
    Primitive("sub", 2, "num", torch.sub, swapped=_rsub),
    Primitive("mul", 2, "num", torch.mul, swapped=_flip(torch.mul)),
    Primitive("div", 2, "float", torch.div, 2, 2, swapped=torch.div),
    Primitive("maximum", 2, "num", torch.maximum, swapped=_flip(torch.clamp_min)),
    Primitive("minimum", 2, "num", torch.minimum, swapped=_flip(torch.clamp_max)),
    Primitive("pow", 2, "float", torch.pow, 4, 4, swapped=torch.pow),
    Primitive("eq", 2, "cmp", torch.eq, swapped=_flip(torch.eq)),
    Primitive("ne", 2, "cmp", torch.ne, swapped=_flip(torch.ne)),
    Primitive("lt", 2, "cmp", torch.lt, swapped=_flip(torch.gt)),
    Primitive("le", 2, "cmp", torch.le, swapped=_flip(torch.ge)),
    Primitive("gt", 2, "cmp", torch.gt, swapped=_flip(torch.lt)),
    Primitive("ge", 2, "cmp", torch.ge, swapped=_flip(torch.le)),
    Primitive("where", 3, "where", torch.where),
    Primitive("cast", 1, "cast", None, 0),
]}
_SCALAR_SECOND = {"maximum": torch.clamp_min, "minimum": torch.clamp_max}  # tensor-scalar calls


def broadcast(shapes: Sequence[Sequence[int]], what: str = "operands") -> tuple[int, ...]:
    """The broadcast of ``shapes`` (numpy rules); GraphError naming ``what`` when they clash."""
    rank = max((len(s) for s in shapes), default=0)
    out = [1] * rank
    for s in shapes:
        for i, d in enumerate(s, rank - len(s)):
            if d != 1:
                if out[i] not in (1, d):
                    raise GraphError(f"{what}: shapes {[tuple(x) for x in shapes]} do not broadcast")
                out[i] = d
    return tuple(out)


def primitive(name: str) -> Primitive:
    """The primitive called ``name`` (with or without the ``dvm.`` prefix)."""
    p = PRIMITIVES.get(name.removeprefix(PREFIX))
    if p is None:
        raise GraphError(f"unknown DVM primitive {name!r}; known: {', '.join(PRIMITIVES)}")
    return p


def _scalar_pos(p: Primitive, attrs: dict[str, Any]) -> int | None:
    if "scalar" not in attrs:
        return None
    pos = int(attrs.get("scalar_pos", p.arity - 1))
    if not 0 <= pos < p.arity or p.arity == 1:
        raise GraphError(f"dvm.{p.name}: scalar_pos {pos} is out of range for arity {p.arity}")
    if p.kind == "where" and pos == 0:
        raise GraphError("dvm.where: the condition cannot be a scalar")
    return pos


def n_tensor_inputs(p: Primitive, attrs: dict[str, Any]) -> int:
    return p.arity - (0 if _scalar_pos(p, attrs) is None else 1)


def infer(name: str, specs: Sequence[tuple[tuple[int, ...], str]], attrs: dict[str, Any]) -> tuple[tuple[int, ...], str]:
    """Shape and dtype of a primitive's result; GraphError names what is wrong."""
    p = primitive(name)
    want = n_tensor_inputs(p, attrs)
    if len(specs) != want:
        raise GraphError(f"dvm.{p.name} takes {want} tensor inputs with these attrs, got {len(specs)}")
    shape = broadcast([s for s, _ in specs], f"dvm.{p.name}")
    dts = [d for _, d in specs]
    if p.kind == "cast":
        return shape, dtype_name(attrs.get("dtype", ""))
    if p.kind == "where":
        _scalar_pos(p, attrs)
        if dts[0] != "bool":
            raise GraphError(f"dvm.where: condition must be bool, got {dts[0]}")
        dts = dts[1:]
    if len(set(dts)) != 1:
        raise GraphError(f"dvm.{p.name}: operand dtypes differ: {dts}")
    dt = dts[0]
    ok = FLOAT_DTYPES if p.kind == "float" else FLOAT_DTYPES + INT_DTYPES
    if dt not in ok:
        raise GraphError(f"dvm.{p.name} does not take dtype {dt}")
    if "scalar" in attrs:
        s = attrs["scalar"]
        if isinstance(s, bool) or not isinstance(s, (int, float)):
            raise GraphError(f"dvm.{p.name}: scalar must be an int or float, got {s!r}")
        if dt in INT_DTYPES and not isinstance(s, int):
            raise GraphError(f"dvm.{p.name}: a float scalar {s!r} with {dt} operands would change the dtype")
    return shape, ("bool" if p.kind == "cmp" else dt)


def bind(name: str, attrs: dict[str, Any], dtype: str) -> Step:
    """The torch call of one primitive task, as ``step(out, *tensors)``.

    ``dtype`` is the result dtype (it types a where-scalar). With ``out=None`` the step
    returns a fresh tensor (the unfused reference); otherwise it writes ``out``.
    """
    p = primitive(name)
    if p.kind == "cast":
        dt = torch_dtype(attrs["dtype"])
        return lambda out, x: x.to(dt, copy=True) if out is None else out.copy_(x)
    pos = _scalar_pos(p, attrs)
    fn = p.fn
    if pos is None:
        return lambda out, *xs: fn(*xs, out=out) if out is not None else fn(*xs)
    s = attrs["scalar"]
    if p.kind == "where":
        st = torch.tensor(s, dtype=torch_dtype(dtype))
        if pos == 1:
            return lambda out, c, b: fn(c, st, b, out=out) if out is not None else fn(c, st, b)
        return lambda out, c, a: fn(c, a, st, out=out) if out is not None else fn(c, a, st)
    if pos == 0:
        fn = p.swapped
        return lambda out, x: fn(s, x, out=out) if out is not None else fn(s, x)
    fn = _SCALAR_SECOND.get(p.name, fn)
    return lambda out, x: fn(x, s, out=out) if out is not None else fn(x, s)


def _register(p: Primitive) -> None:
    name = PREFIX + p.name

    def shape(ins: list[TensorSpec], attrs: dict) -> list[TensorSpec]:
        s, d = infer(name, [(i.shape, i.dtype) for i in ins], attrs)
        return [TensorSpec(s, d)]

    def cost(ins: list[TensorSpec], outs: list[TensorSpec], attrs: dict) -> Cost:
        n = max((o.numel for o in outs), default=0)
        return Cost(flops=p.flops * n, bytes=sum(s.nbytes for s in ins) + sum(o.nbytes for o in outs),
                    precision=precision(outs[0].dtype if outs else "float32"))

    def reference(*xs, **attrs):
        return bind(name, attrs, _result_dtype(name, xs, attrs))(None, *xs)

    def kernel(ins, outs, **attrs) -> None:
        bind(name, attrs, str(outs[0].dtype).removeprefix("torch."))(outs[0], *ins)

    register(OpDef(name, ("vector",), reference, shape, cost, kernel, doc=f"DVM fusible primitive {p.name}"))


def _result_dtype(name: str, xs: Sequence[torch.Tensor], attrs: dict) -> str:
    return infer(name, [(tuple(x.shape), dtype_name(x.dtype)) for x in xs], attrs)[1]


for _p in PRIMITIVES.values():
    _register(_p)
