"""torch.fx front end: trace a tensor function into a TaskGraph of DVM primitives.

    g = trace(fn, x)              # one task per traced call; shapes from the examples
    f = jit(fn); y = f(x)         # trace once; fuse and compile per dtypes / broadcast pattern

Python numbers become ``scalar`` attrs; ``x.to(dtype)`` becomes ``cast``; ``@``/``matmul``
becomes the cube ``matmul`` op (a fusion boundary). Anything else raises GraphError
naming the fx node.
"""
from __future__ import annotations

import operator
from dataclasses import replace
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch.fx import GraphModule, Node, symbolic_trace
from torch.fx.passes.shape_prop import ShapeProp

from megaloom.ops.dvm.backend import compile_program, options
from megaloom.ops.dvm.cluster import fuse
from megaloom.ops.dvm.fused import OP, program_of
from megaloom.ops.dvm.primitives import PREFIX, broadcast
from megaloom.ops.dvm.program import Instr, Program, pattern
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
    """``fn`` traced once, fused and compiled; call it like ``fn``.

    The function is traced with torch.fx once, when the Jit is made. The first call with
    inputs of a new dtype / broadcast pattern (which dims are 1) fuses the traced graph; when
    every resulting task is a DVM task, the fused graph becomes a shape-free plan (kernels,
    and per intermediate its dtype and broadcast pattern), so a call on new sizes only
    allocates and runs: no tracing, fusing or compiling (and never a compiler on the caller's
    thread). A graph with other ops (``matmul``) is fused per input shapes and runs on a
    ThreadExecutor.
    """

    def __init__(self, fn: Callable[..., Any], limits: Limits = Limits(), backend: str | None = None):
        self.fn, self.limits, self.backend = fn, limits, backend
        self._gm = symbolic_trace(fn)
        self._outs = [n.name for n in output_nodes(self._gm)]
        self._graphs: dict[tuple, TaskGraph] = {}
        self._plans: dict[tuple, _Plan | None] = {}

    def graph(self, *inputs: torch.Tensor) -> TaskGraph:
        """The fused graph for inputs like these (traced and fused on first use)."""
        key = tuple((tuple(x.shape), x.dtype) for x in inputs)
        g = self._graphs.get(key)
        if g is None:
            g = self._graphs[key] = fuse(trace(self._gm, *inputs, name=getattr(self.fn, "__name__", "fx")),
                                         self.limits, self.backend)
        return g

    def __call__(self, *inputs: torch.Tensor):
        key = tuple((x.dtype, tuple(d == 1 for d in x.shape)) for x in inputs)
        plan = self._plans.get(key, False)
        if plan is False:
            plan = self._plans[key] = _Plan.of(self.graph(*inputs), [n for n in self._outs])
        if plan is not None:
            vals = plan(inputs)
        else:
            g = self.graph(*inputs)
            res = ThreadExecutor().run(g, {b.name: x for b, x in zip(g.inputs, inputs)}).outputs
            vals = tuple(res[n] for n in self._outs)
        return vals[0] if len(vals) == 1 else vals


class _Plan:
    """A fused graph of DVM tasks on whole buffers, free of sizes: per step a program and
    its slots; per slot a dtype and a broadcast pattern against the inputs' domain."""

    def __init__(self, n_in: int, slots: list[tuple[torch.dtype, str]], steps: list[tuple[Program, str | None, list[int], list[int]]],
                 outs: list[int]):
        self.n_in, self.slots, self.steps, self.outs = n_in, slots, steps, outs

    @staticmethod
    def of(g: TaskGraph, out_names: list[str]) -> _Plan | None:
        """The plan of ``g``, or None when a task is not a DVM task on whole buffers."""
        dom = broadcast([b.shape for b in g.inputs])
        index = {b.name: i for i, b in enumerate(g.inputs)}
        slots: list[tuple[torch.dtype, str]] = [(torch_dtype(b.dtype), pattern(b.shape, dom)) for b in g.inputs]
        steps = []
        for t in (g.tasks[i] for i in g.topological_order()):
            if not t.op.startswith(PREFIX) or any(r.box != r.buffer.full.box for r in (*t.inputs, *t.outputs)):
                return None
            for r in t.outputs:
                if r.buffer.name not in index:
                    index[r.buffer.name] = len(slots)
                    slots.append((torch_dtype(r.buffer.dtype), pattern(r.buffer.shape, dom)))
            prog = program_of(t.attrs) if t.op == OP else _single(t)
            steps.append((prog, t.attrs.get("backend"), [index[r.buffer.name] for r in t.inputs],
                          [index[r.buffer.name] for r in t.outputs]))
        return _Plan(len(g.inputs), slots, steps, [index[n] for n in out_names])

    def __call__(self, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        dom = broadcast([x.shape for x in inputs], "jit inputs")
        vals: list[Any] = list(inputs) + [None] * (len(self.slots) - self.n_in)
        opts = options()
        for prog, backend, ins, outs in self.steps:
            for o in outs:
                dt, pat = self.slots[o]
                vals[o] = torch.empty([d if c == "f" else 1 for c, d in zip(pat, dom) if c != "-"], dtype=dt)
            o = opts if backend is None or backend == opts.backend else replace(opts, backend=backend)
            compile_program(prog, o)([vals[i] for i in ins], [vals[i] for i in outs])
        return tuple(vals[i] for i in self.outs)


def _single(t) -> Program:
    """The one-instruction program of an unfused primitive task."""
    n = len(t.inputs)
    attrs = tuple(sorted((k, v) for k, v in t.attrs.items() if k in ("scalar", "scalar_pos", "dtype")))
    return Program(tuple((r.shape, r.dtype) for r in t.inputs), (Instr(t.op[len(PREFIX):], tuple(range(n)), attrs),), (n,))


def jit(fn: Callable[..., Any], limits: Limits = Limits(), backend: str | None = None) -> Jit:
    """Trace ``fn`` once; fuse and compile per input dtypes and broadcast pattern."""
    return Jit(fn, limits, backend)
