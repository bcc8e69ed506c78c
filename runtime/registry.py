"""The op registry: one entry per op name, extended by ``megaloom.ops`` and plug-ins.

An entry holds everything any executor needs to treat the op: which engine kinds may
run it, a torch reference (the oracle), a kernel that runs one task for real, a shape
rule and a cost function. Plug-ins register ops in the ``megaloom.ops`` entry-point
group; they are loaded the first time a name is looked up and not found (the one
:class:`~megaloom.runtime.plugins.Registry` every named plug-in kind uses).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from megaloom.runtime.dtypes import itemsize
from megaloom.runtime.errors import GraphError
from megaloom.runtime.plugins import Registry

if TYPE_CHECKING:
    import torch

CUBE, VECTOR, COMM, COPY, HOST = "cube", "vector", "comm", "copy", "host"
"""The engine kinds, the one table of them: matrix units, vector units, collectives and point-to-point
transfers, copy (DMA) engines, and the host's threads (imported traces: CPU ops and launches)."""
ENGINE_KINDS = (CUBE, VECTOR, COMM)
"""The kinds megaloom's own graphs run on (a chip's engines)."""
MOVERS = (COMM, COPY)
"""The kinds whose tasks move bytes rather than compute (costed by their bytes and the link)."""


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """Shape and dtype name of a task operand."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)


@dataclass(slots=True)
class Cost:
    """Work of one task: arithmetic, memory traffic, bytes on the wire, and rate class.

    ``precision`` picks the profile's peak rate ("fp32", "bf16", "mxfp8", ...).
    """

    flops: float = 0.0
    bytes: float = 0.0
    comm_bytes: float = 0.0
    precision: str = "fp32"

    def valid(self) -> bool:
        """Finite work figures >= 0 and a precision name: what graph files and the simulator take."""
        figures = (self.flops, self.bytes, self.comm_bytes)
        return isinstance(self.precision, str) and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < float("inf") for v in figures)


ShapeRule = Callable[[list[TensorSpec], dict[str, Any]], list[TensorSpec]]
CostFn = Callable[[list[TensorSpec], list[TensorSpec], dict[str, Any]], Cost]
Kernel = Callable[..., Any]


@dataclass(frozen=True, slots=True)
class GradOf:
    """What a backward op computes in terms of its forward op ``op``, so that tests hold it
    against ``torch.autograd`` of the forward reference (:func:`megaloom.runtime.testing.check_grads`).

    ``inputs`` names each operand of the backward op: ``x<i>`` the forward op's input i,
    ``y<j>`` its output j, ``dy<j>`` a gradient arriving for output j (several add up),
    ``dx<i>`` a gradient of input i summed so far, which the op adds to. ``outputs`` names
    each of its outputs ``dx<i>``: the gradient of input i (a per-tile partial may add
    leading dims of size 1). Both take a space-separated string.
    """

    op: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]

    def __init__(self, op: str, inputs: str, outputs: str):
        for sym in (*inputs.split(), *outputs.split()):
            if not re.fullmatch(r"(x|y|dy|dx)[0-9]+", sym):
                raise GraphError(f"grad_of {op!r}: bad operand {sym!r}; expected x<i>, y<j>, dy<j> or dx<i>")
        if not all(s.startswith("dx") for s in outputs.split()):
            raise GraphError(f"grad_of {op!r}: outputs must be input gradients dx<i>, got {outputs!r}")
        object.__setattr__(self, "op", op)
        object.__setattr__(self, "inputs", tuple(inputs.split()))
        object.__setattr__(self, "outputs", tuple(outputs.split()))


@dataclass(slots=True)
class OpDef:
    """One registry entry.

    ``reference(*inputs, **attrs)`` returns the outputs (a tensor or a tuple) in plain torch.
    ``kernel(inputs, outputs, **attrs)`` writes the outputs in place (they are views of the
    buffers a task writes); when absent, the reference result is copied into them.
    With ``context=True`` both also receive ``ctx=`` (rank, communicator, device).
    ``extra["in_place"] = True`` says the kernel may write an output over an input equal to
    it (element-wise ops); the thread executor otherwise hands the kernel a copy of any
    input that a task's outputs overlap. ``extra["compute"](attrs, rate)``: the seconds of arithmetic of one
    task on one unit, for ops whose flops run at several rates (``rate(op class, precision)``
    gives each one's; the cost model uses it instead of one rate for all the op's flops).
    ``extra["bind"](attrs)``, when given, returns one task's kernel ``fn(inputs, outputs)`` with its
    attrs applied (what depends on the attrs alone is done once, when the executors' dispatch plan
    is built). ``grad_of`` (a backward op's) names the forward op
    whose gradient it computes, and how.
    """

    name: str
    engines: tuple[str, ...]
    reference: Callable[..., Any]
    shape: ShapeRule
    cost: CostFn
    kernel: Kernel | None = None
    context: bool = False
    doc: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    grad_of: GradOf | None = None

    @property
    def engine(self) -> str:
        """The default engine kind."""
        return self.engines[0]


OPS: Registry[OpDef] = Registry("op", "megaloom.ops", error=GraphError)
"""Every op by name; the ``megaloom.ops`` entry points (modules that register ops) load on
the first lookup of a name not registered yet."""


def register(op: OpDef, *, replace: bool = False) -> OpDef:
    """Add ``op`` to the registry; a second entry of the same name needs ``replace=True``."""
    if not op.engines:
        raise GraphError(f"op {op.name!r} names no engine kind")
    return OPS.register(op.name, op, replace=replace)


def get_op(name: str) -> OpDef:
    """The entry for ``name``; raises GraphError naming the op when there is none."""
    return OPS.get(name)


def all_ops() -> dict[str, OpDef]:
    """Every registered op, plug-ins included."""
    return OPS.items()


def run_reference(op: OpDef, inputs: list[torch.Tensor], attrs: dict[str, Any], ctx: Any = None):
    """The op's reference outputs as a tuple."""
    out = op.reference(*inputs, **attrs, **({"ctx": ctx} if op.context else {}))
    return out if isinstance(out, tuple) else (out,)
