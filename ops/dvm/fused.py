"""The ``dvm.fused`` registry entry: a task that runs a whole fused program.

Attrs: ``program`` (:meth:`Program.to_attrs`), optionally ``backend`` ("tiled" or
"inductor", default: the process option) and ``members`` (names of the fused tasks).
Its cost counts each external input and output once: intermediates never reach memory.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from megaloom.ops.basic import precision
from megaloom.ops.dvm.backend import check_options, compile_program, options
from megaloom.ops.dvm.program import Program
from megaloom.runtime.errors import GraphError
from megaloom.runtime.registry import Cost, OpDef, TensorSpec, register

OP = "dvm.fused"
_decoded: dict[int, tuple[dict, Program]] = {}
_MAX_DECODED = 4096


def program_of(attrs: dict[str, Any]) -> Program:
    """The checked Program held by a fused task's attrs (decoded once per attrs dict)."""
    data = attrs.get("program")
    if not isinstance(data, dict):
        raise GraphError(f"{OP} needs a 'program' attr (a dict), got {type(data).__name__}")
    hit = _decoded.get(id(data))
    if hit is not None and hit[0] is data:
        return hit[1]
    prog = Program.from_attrs(data)
    if len(_decoded) >= _MAX_DECODED:
        _decoded.clear()
    _decoded[id(data)] = (data, prog)  # holding ``data`` keeps its id from being reused
    return prog


def _shape(ins: list[TensorSpec], attrs: dict) -> list[TensorSpec]:
    prog = program_of(attrs)
    got = [(tuple(s.shape), s.dtype) for s in ins]
    if got != list(prog.inputs):
        raise GraphError(f"{OP}: inputs {got} do not match the program's inputs {list(prog.inputs)}")
    return [TensorSpec(s, d) for s, d in prog.out_specs()]


def _cost(ins: list[TensorSpec], outs: list[TensorSpec], attrs: dict) -> Cost:
    prog = program_of(attrs)
    return Cost(flops=prog.flops(), bytes=sum(s.nbytes for s in ins) + sum(o.nbytes for o in outs),
                precision=precision(outs[0].dtype if outs else "float32"))


def _reference(*ins, program: dict, **_: Any):
    return program_of({"program": program}).run_reference(ins)


def fused_kernel(ins, outs, program: dict, backend: str | None = None, **_: Any) -> None:
    """Run a fused task: the cached kernel of its program (backend from attrs or options)."""
    opts = options()
    if backend is not None and backend != opts.backend:
        opts = replace(opts, backend=backend)
        check_options(opts)
    compile_program(program_of({"program": program}), opts)(ins, outs)


register(OpDef(OP, ("vector",), _reference, _shape, _cost, fused_kernel,
               doc="a fused chain of DVM primitives (attrs: program, backend, members)"))
