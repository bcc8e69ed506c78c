"""The op registry: one entry per op name, extended by ``megaloom.ops`` and plug-ins.

An entry holds everything any executor needs to treat the op: which engine kinds may
run it, a torch reference (the oracle), a kernel that runs one task for real, a shape
rule and a cost function. Plug-ins register ops in the ``megaloom.ops`` entry-point
group; they are loaded the first time a name is looked up and not found.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, Callable

import torch

from megaloom.runtime.errors import GraphError

ENGINE_KINDS = ("cube", "vector", "comm")


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """Shape and dtype name of a task operand."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        from megaloom.runtime.dtypes import itemsize

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


ShapeRule = Callable[[list[TensorSpec], dict[str, Any]], list[TensorSpec]]
CostFn = Callable[[list[TensorSpec], list[TensorSpec], dict[str, Any]], Cost]
Kernel = Callable[..., Any]


@dataclass(slots=True)
class OpDef:
    """One registry entry.

    ``reference(*inputs, **attrs)`` returns the outputs (a tensor or a tuple) in plain torch.
    ``kernel(inputs, outputs, **attrs)`` writes the outputs in place (they are views of the
    buffers a task writes); when absent, the reference result is copied into them.
    With ``context=True`` both also receive ``ctx=`` (rank, communicator, device).
    ``extra["in_place"] = True`` says the kernel may write an output over an input equal to
    it (element-wise ops); the thread executor otherwise hands the kernel a copy of any
    input that a task's outputs overlap.
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

    @property
    def engine(self) -> str:
        """The default engine kind."""
        return self.engines[0]


_REGISTRY: dict[str, OpDef] = {}
_plugins_loaded = False


def register(op: OpDef, *, replace: bool = False) -> OpDef:
    """Add ``op`` to the registry; a second entry of the same name needs ``replace=True``."""
    if not op.engines:
        raise GraphError(f"op {op.name!r} names no engine kind")
    if op.name in _REGISTRY and not replace and _REGISTRY[op.name] is not op:
        raise GraphError(f"op {op.name!r} is already registered")
    _REGISTRY[op.name] = op
    return op


def _load_plugins() -> None:
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    for ep in entry_points(group="megaloom.ops"):
        ep.load()


def get_op(name: str) -> OpDef:
    """The entry for ``name``; raises GraphError naming the op when there is none."""
    op = _REGISTRY.get(name)
    if op is None:
        _load_plugins()
        op = _REGISTRY.get(name)
    if op is None:
        raise GraphError(f"unknown op {name!r}")
    return op


def all_ops() -> dict[str, OpDef]:
    """Every registered op, plug-ins included."""
    _load_plugins()
    return dict(_REGISTRY)


def run_reference(op: OpDef, inputs: list[torch.Tensor], attrs: dict[str, Any], ctx: Any = None):
    """The op's reference outputs as a tuple."""
    out = op.reference(*inputs, **attrs, **({"ctx": ctx} if op.context else {}))
    return out if isinstance(out, tuple) else (out,)
