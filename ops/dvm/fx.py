"""torch.fx front end: trace a tensor function into a TaskGraph of DVM primitives.

    g = trace(fn, x)              # one task per traced call; shapes from the examples
    f = jit(fn, x); y = f(x)      # trace, fuse, compile; re-traces for new shapes/dtypes

Python numbers become ``scalar`` attrs; ``x.to(dtype)`` becomes ``cast``; ``@``/``matmul``
becomes the cube ``matmul`` op (a fusion boundary). Anything else raises GraphError
naming the fx node.
"""
from __future__ import annotations

import operator
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.fx import GraphModule, Node, symbolic_trace
from torch.fx.passes.shape_prop import ShapeProp

from megaloom.ops.dvm.cluster import fuse
from megaloom.ops.dvm.fused import OP, fused_kernel
from megaloom.ops.dvm.split import Limits
from megaloom.runtime.dtypes import dtype_name, torch_dtype
from megaloom.runtime.errors import GraphError
from megaloom.runtime.executors import ThreadExecutor
from megaloom.runtime.graph import TaskGraph

_FUNCS: dict[Any, str] = {
    operator.neg: "neg", operator.add: "add", operator.sub: "sub", operator.mul: "mul", operator.truediv: "div",
    operator.pow: "pow", operator.eq: "eq", operator.ne: "ne", operator.lt: "lt", operator.le: "le",
    operator.gt: "gt", operator.ge: "ge", operator.abs: "abs", F.relu: "relu", torch.relu: "relu",
    torch.maximum: "maximum", torch.minimum: "minimum", torch.where: "where", torch.div: "div",
    torch.true_divide: "div",
}
for _name in ("neg", "exp", "log", "sqrt", "rsqrt", "abs", "reciprocal", "tanh", "sigmoid", "erf",
              "add", "sub", "mul", "pow", "eq", "ne", "lt", "le", "gt", "ge"):
    _FUNCS[getattr(torch, _name)] = _name
_METHODS = {name: name for name in ("neg", "exp", "log", "sqrt", "rsqrt", "abs", "reciprocal", "tanh",
                                    "sigmoid", "erf", "relu", "add", "sub", "mul", "div", "pow",
                                    "eq", "ne", "lt", "le", "gt", "ge")}
_METHODS["maximum"], _METHODS["minimum"] = "maximum", "minimum"


def trace(fn: Callable[..., Any], *examples: torch.Tensor, name: str | None = None) -> TaskGraph:
    """A TaskGraph computing ``fn`` on tensors shaped like ``examples``."""
    gm = fn if isinstance(fn, GraphModule) else symbolic_trace(fn)
    ShapeProp(gm).propagate(*(torch.empty_like(x, device="meta") for x in examples))  # shapes only
    g = TaskGraph(name or getattr(fn, "__name__", "fx"))
    buf: dict[Node, Any] = {}
    out_nodes = set(output_nodes(gm))
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            meta = node.meta["tensor_meta"]
            buf[node] = g.input(node.name, tuple(meta.shape), dtype_name(meta.dtype))
        elif node.op in ("call_function", "call_method"):
            meta = node.meta.get("tensor_meta")
            if meta is None:
                raise GraphError(f"fx node {node.name!r} ({node.target}) does not produce one tensor")
            shape, dt = tuple(meta.shape), dtype_name(meta.dtype)
            make = g.output if node in out_nodes else g.buffer
            buf[node] = make(node.name, shape, dt)
            op, tensors, attrs = _lower(node)
            g.task(op, [buf[t] for t in tensors], [buf[node]], name=node.name, attrs=attrs)
        elif node.op != "output":
            raise GraphError(f"fx node {node.name!r}: {node.op} {node.target} is not supported by the DVM front end")
    return g


def output_nodes(gm: GraphModule) -> list[Node]:
    """The nodes ``gm`` returns, in order."""
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    bad = [o for o in outs if not isinstance(o, Node) or o.op == "placeholder"]
    if bad or len({o.name for o in outs}) != len(outs):
        raise GraphError(f"fx outputs must be distinct computed tensors, got {outs}")
    return outs


def _lower(node: Node) -> tuple[str, list[Node], dict[str, Any]]:
    if node.op == "call_method" and node.target in ("to", "type"):
        dt = node.args[1] if len(node.args) > 1 else node.kwargs.get("dtype")
        if not isinstance(dt, torch.dtype):
            raise GraphError(f"fx node {node.name!r}: only .to(dtype) casts are supported")
        return "dvm.cast", [node.args[0]], {"dtype": dtype_name(dt)}
    if node.target in (operator.matmul, torch.matmul):
        return "matmul", list(node.args), {}
    prim = _METHODS.get(node.target) if node.op == "call_method" else _FUNCS.get(node.target)
    if prim is None or node.kwargs:
        raise GraphError(f"fx node {node.name!r}: {node.target} has no DVM primitive")
    tensors, attrs = [], {}
    for i, a in enumerate(node.args):
        if isinstance(a, Node):
            tensors.append(a)
        elif isinstance(a, (int, float)) and not isinstance(a, bool) and "scalar" not in attrs:
            attrs = {"scalar": a, "scalar_pos": i}
        else:
            raise GraphError(f"fx node {node.name!r}: unsupported argument {a!r}")
    return "dvm." + prim, tensors, attrs


class Jit:
    """``fn`` traced, fused and compiled per input shapes/dtypes; call it like ``fn``.

    A graph that fuses into one ``dvm.fused`` task runs its kernel directly; otherwise the
    fused graph runs on a ThreadExecutor.
    """

    def __init__(self, fn: Callable[..., Any], limits: Limits = Limits(), backend: str | None = None):
        self.fn, self.limits, self.backend = fn, limits, backend
        self._gm = symbolic_trace(fn)
        self._outs = [n.name for n in output_nodes(self._gm)]
        self._graphs: dict[tuple, TaskGraph] = {}

    def graph(self, *inputs: torch.Tensor) -> TaskGraph:
        """The fused graph for inputs like these (traced and fused on first use)."""
        key = tuple((tuple(x.shape), x.dtype) for x in inputs)
        g = self._graphs.get(key)
        if g is None:
            g = self._graphs[key] = fuse(trace(self._gm, *inputs, name=getattr(self.fn, "__name__", "fx")),
                                         self.limits, self.backend)
        return g

    def __call__(self, *inputs: torch.Tensor):
        g = self.graph(*inputs)
        feed = {b.name: x for b, x in zip(g.inputs, inputs)}
        if len(g.tasks) == 1 and g.tasks[0].op == OP and all(r.box == r.buffer.full.box for r in g.tasks[0].outputs):
            t = g.tasks[0]
            res = {b.name: torch.empty(b.shape, dtype=torch_dtype(b.dtype)) for b in g.outputs}
            fused_kernel([feed[r.buffer.name] for r in t.inputs], [res[r.buffer.name] for r in t.outputs], **t.attrs)
        else:
            res = ThreadExecutor().run(g, feed).outputs
        vals = tuple(res[n] for n in self._outs)
        return vals[0] if len(vals) == 1 else vals


def jit(fn: Callable[..., Any], limits: Limits = Limits(), backend: str | None = None) -> Jit:
    """Trace, fuse and compile ``fn`` lazily per input signature."""
    return Jit(fn, limits, backend)
