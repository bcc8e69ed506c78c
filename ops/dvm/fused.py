"""The ``dvm.fused`` registry entry: a task that runs a whole fused program.

Attrs: ``program`` (:meth:`Program.to_attrs`), optionally ``backend`` ("tiled" or
"inductor", default: the process option), ``members`` (names of the fused tasks) and
``operand_shapes``: the shapes of the task's regions, inputs then outputs, where they are
views of the program's values with other dims (same sizes; e.g. a ``[t, 1, 1]`` entry of a
``[T, n, n]`` buffer as a ``[t, 1]`` value). Its cost counts each external input and output
once: intermediates never reach memory.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from megaloom.ops.basic import precision
from megaloom.ops import native
from megaloom.ops.dvm.backend import cache_epoch, check_options, compile_program, options
from megaloom.ops.dvm.program import Program
from megaloom.runtime.errors import GraphError
from megaloom.runtime.registry import Cost, OpDef, TensorSpec, register

OP = "dvm.fused"
_decoded: dict[int, tuple[dict, Program, dict]] = {}  # id(program attr) -> (it, Program, kernels by options)
_MAX_DECODED = 4096


def _entry(attrs: dict[str, Any]) -> tuple[dict, Program, dict]:
    data = attrs.get("program")
    if not isinstance(data, dict):
        raise GraphError(f"{OP} needs a 'program' attr (a dict), got {type(data).__name__}")
    hit = _decoded.get(id(data))
    if hit is not None and hit[0] is data:
        return hit
    if len(_decoded) >= _MAX_DECODED:
        _decoded.clear()
    hit = _decoded[id(data)] = (data, Program.from_attrs(data), {})  # holding ``data`` keeps its id from being reused
    return hit


def program_of(attrs: dict[str, Any]) -> Program:
    """The checked Program held by a fused task's attrs (decoded once per attrs dict)."""
    return _entry(attrs)[1]


def operand_shapes(prog: Program, attrs: dict[str, Any]) -> tuple[list[tuple], list[tuple]]:
    """Shapes of a fused task's input and output regions (``operand_shapes``, else the program's)."""
    ins, outs = [s for s, _ in prog.inputs], [s for s, _ in prog.out_specs()]
    given = attrs.get("operand_shapes")
    if given is None:
        return ins, outs
    try:
        shapes = [tuple(int(d) for d in s) for s in given]
    except (TypeError, ValueError):
        raise GraphError(f"{OP}: operand_shapes must be lists of ints, got {given!r}") from None
    if [math.prod(s) for s in shapes] != [math.prod(s) for s in ins + outs]:
        raise GraphError(f"{OP}: operand_shapes {shapes} do not have the sizes of the program's values {ins + outs}")
    return shapes[:len(ins)], shapes[len(ins):]


def _shape(ins: list[TensorSpec], attrs: dict) -> list[TensorSpec]:
    prog = program_of(attrs)
    shapes, out_shapes = operand_shapes(prog, attrs)
    got, want = [(tuple(s.shape), s.dtype) for s in ins], [(s, d) for s, (_, d) in zip(shapes, prog.inputs)]
    if got != want:
        raise GraphError(f"{OP}: inputs {got} do not match the program's inputs {want}")
    return [TensorSpec(s, d) for s, (_, d) in zip(out_shapes, prog.out_specs())]


def _cost(ins: list[TensorSpec], outs: list[TensorSpec], attrs: dict) -> Cost:
    prog = program_of(attrs)
    return Cost(flops=prog.flops(), bytes=sum(s.nbytes for s in ins) + sum(o.nbytes for o in outs),
                precision=precision(outs[0].dtype if outs else "float32"))


def _reference(*ins, program: dict, operand_shapes: list | None = None, **_: Any):
    prog = program_of({"program": program})
    outs = prog.run_reference([x.reshape(s) for x, (s, _) in zip(ins, prog.inputs)])
    if operand_shapes is None:
        return outs
    return tuple(y.reshape(s) for y, s in zip(outs, operand_shapes[len(ins):]))


def fused_kernel(ins, outs, program: dict, backend: str | None = None, operand_shapes: list | None = None,
                 **_: Any) -> None:
    """Run a fused task: the cached kernel of its program (backend from attrs or options)."""
    opts = options()
    if backend is not None and backend != opts.backend:
        opts = replace(opts, backend=backend)
        check_options(opts)
    _, prog, kernels = _entry({"program": program})
    if operand_shapes is not None:  # the regions as the program's values (views: outputs are written in place)
        ins = [x if x.shape == s else x.reshape(s) for x, (s, _) in zip(ins, prog.inputs)]
        outs = [y if y.shape == s else y.view(s) for y, (s, _) in zip(outs, prog.out_specs())]
    key = (opts, native.enabled(), cache_epoch())  # the program's signature is not hashed again per call
    kernel = kernels.get(key)
    if kernel is None:
        kernel = kernels[key] = compile_program(prog, opts)
    kernel(ins, outs)


register(OpDef(OP, ("vector",), _reference, _shape, _cost, fused_kernel,
               doc="a fused chain of DVM primitives (attrs: program, backend, members)",
               extra={"compute": lambda attrs, rate: program_of(attrs).seconds(rate)}))  # each primitive at its rate
