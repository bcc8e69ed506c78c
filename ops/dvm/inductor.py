"""Optional backend: ``torch.compile`` (Inductor) of a fused program, for long steady runs.

Compiling takes seconds (it generates and builds C++), against microseconds for the tiled
backend; :attr:`InductorKernel.compile_seconds` reports it after the first call.
"""
from __future__ import annotations

import time
from typing import Sequence

import torch

from megaloom.ops.dvm.primitives import bind
from megaloom.ops.dvm.program import Program


class InductorKernel:
    """``kernel(inputs, outputs)`` through a ``torch.compile``d program (compiled on first call)."""

    backend = "inductor"

    def __init__(self, program: Program):
        self.program = program
        n_in = len(program.inputs)
        steps = [(bind(i.op, i.attr_dict, program.specs[n_in + k][1]), i.args) for k, i in enumerate(program.code)]
        outs_ids = program.outputs

        def run(ins: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
            env = list(ins)
            for step, args in steps:
                env.append(step(None, *(env[a] for a in args)))
            for o, v in zip(outs, outs_ids):
                o.copy_(env[v])

        self._fn = torch.compile(run, dynamic=False, fullgraph=True)
        self.compile_seconds: float | None = None

    def __call__(self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> None:
        if self.compile_seconds is None:
            t0 = time.perf_counter()
            self._fn(list(inputs), list(outputs))
            self.compile_seconds = time.perf_counter() - t0
            return
        self._fn(list(inputs), list(outputs))
