"""The fused-program IR: inputs, a straight-line list of primitive instructions, outputs.

Values are numbered: the ``n`` inputs are ``0..n-1`` and instruction ``k`` defines value
``n + k``. A program is stored in task attrs as plain lists (:meth:`Program.to_attrs`),
so graphs holding fused nodes still round-trip through msgpack.

The structural signature keys the kernel cache: instruction ops, wiring, attrs, dtypes
and each input's broadcast pattern against the program's domain (one letter per domain
dim: ``f`` full, ``b`` broadcast size 1, ``-`` absent); never sizes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Sequence

import torch

from megaloom.ops.basic import precision
from megaloom.ops.dvm.primitives import PREFIX, bind, broadcast, infer, primitive
from megaloom.runtime.dtypes import dtype_name
from megaloom.runtime.errors import GraphError

Spec = tuple[tuple[int, ...], str]  # (shape, dtype name)


class Instr(NamedTuple):
    """One primitive application: op name (no prefix), argument value ids, scalar/dtype attrs.

    A named tuple, so hashing a signature full of them stays in C (cache hits are ~us)."""

    op: str
    args: tuple[int, ...]
    attrs: tuple[tuple[str, Any], ...] = ()

    @property
    def attr_dict(self) -> dict[str, Any]:
        return dict(self.attrs)


def pattern(shape: Sequence[int], domain: Sequence[int]) -> str:
    """Broadcast pattern of ``shape`` within ``domain``: ``f`` full, ``b`` size-1, ``-`` absent."""
    lead = len(domain) - len(shape)
    return "".join("-" if i < lead else ("b" if shape[i - lead] == 1 and d != 1 else "f")
                   for i, d in enumerate(domain))


@dataclass(slots=True)
class Program:
    """A checked fused program; ``specs`` holds every value's (shape, dtype)."""

    inputs: tuple[Spec, ...]
    code: tuple[Instr, ...]
    outputs: tuple[int, ...]
    specs: list[Spec] = field(default_factory=list)
    _sig: tuple | None = None

    def __post_init__(self) -> None:
        if not self.code:
            raise GraphError("a fused program needs at least one instruction")
        self.specs = [(tuple(int(d) for d in s), dtype_name(dt)) for s, dt in self.inputs]
        self.inputs = tuple(self.specs)
        for k, ins in enumerate(self.code):
            if any(not 0 <= a < len(self.specs) for a in ins.args):
                raise GraphError(f"fused program instruction {k} ({ins.op}) uses an undefined value: args {ins.args}")
            self.specs.append(infer(ins.op, [self.specs[a] for a in ins.args], ins.attr_dict))
        n_in = len(self.inputs)
        if not self.outputs or len(set(self.outputs)) != len(self.outputs) or \
                any(not n_in <= o < len(self.specs) for o in self.outputs):
            raise GraphError(f"fused program outputs {self.outputs} must be distinct instruction results")

    @property
    def n_values(self) -> int:
        return len(self.specs)

    @property
    def domain(self) -> tuple[int, ...]:
        """The shape every value broadcasts to."""
        return broadcast([s for s, _ in self.inputs], "fused program inputs")

    @property
    def signature(self) -> tuple:
        """Structural key: ops, wiring, attrs, dtypes and broadcast patterns; never sizes."""
        if self._sig is None:
            dom = self.domain
            self._sig = (tuple((pattern(s, dom), d) for s, d in self.inputs), self.code, self.outputs)
        return self._sig

    def out_specs(self) -> list[Spec]:
        return [self.specs[o] for o in self.outputs]

    def icost(self) -> float:
        """Estimated instruction cost (the split limit's measure)."""
        return sum(primitive(i.op).icost for i in self.code)

    def flops(self) -> float:
        """Arithmetic of one evaluation: each instruction over its own result size."""
        return self.seconds(lambda op, precision: 1.0)

    def seconds(self, rate: Callable[[str, str], float]) -> float:
        """Seconds of one evaluation on one unit: each instruction's flops (over its own result
        size) at ``rate("dvm.<name>", precision of its result)``, summed."""
        return sum(primitive(ins.op).flops * math.prod(shape) / rate(f"{PREFIX}{ins.op}", precision(dtype))
                   for ins, (shape, dtype) in zip(self.code, self.specs[len(self.inputs):]))

    def run_reference(self, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Evaluate instruction by instruction into fresh tensors (the unfused semantics)."""
        env = list(inputs)
        n_in = len(self.inputs)
        for k, ins in enumerate(self.code):
            env.append(bind(ins.op, ins.attr_dict, self.specs[n_in + k][1])(None, *(env[a] for a in ins.args)))
        return tuple(env[o] for o in self.outputs)

    def to_attrs(self) -> dict[str, Any]:
        """Plain msgpack-encodable form (the ``program`` attr of a ``dvm.fused`` task)."""
        return {"inputs": [[list(s), d] for s, d in self.inputs],
                "code": [[i.op, list(i.args), dict(i.attrs)] for i in self.code],
                "outputs": list(self.outputs)}

    @staticmethod
    def from_attrs(data: dict[str, Any]) -> Program:
        """Inverse of :meth:`to_attrs`; GraphError when malformed."""
        try:
            ins = tuple((tuple(s), d) for s, d in data["inputs"])
            code = tuple(Instr(str(op).removeprefix(PREFIX), tuple(int(a) for a in args), tuple(sorted(at.items())))
                         for op, args, at in data["code"])
            outs = tuple(int(o) for o in data["outputs"])
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise GraphError(f"malformed fused program: {type(e).__name__}: {e}") from None
        return Program(ins, code, outs)


def instr(op: str, args: Sequence[int], **attrs: Any) -> Instr:
    """Convenience constructor: ``instr("add", [0], scalar=1.0)``."""
    return Instr(op.removeprefix(PREFIX), tuple(args), tuple(sorted(attrs.items())))
