"""Ready-made fused programs for common activations, forward and backward.

A graph builder makes a fused node from one of them and whole-buffer or tile regions::

    prog = library.swiglu((T, H), "bfloat16")                  # h = silu(gate) * up
    g.task("dvm.fused", [gate, up], [h], attrs={"program": prog.to_attrs()})
    bwd = library.swiglu_backward((T, H), "bfloat16")          # (dh, gate, up) -> (dgate, dup)
    g.task("dvm.fused", [dh, gate, up], [dgate, dup], attrs={"program": bwd.to_attrs()})

Shapes are those of the task's regions (a tile's shape for a tiled node); kernels are
cached by structure, so every tile size shares one. The forms are chosen so the native
backend runs them as its pattern functions (``sigmoid``, ``silu``, ``swiglu``).
"""
from __future__ import annotations

import math
from typing import Sequence

from megaloom.ops.dvm.program import Program, instr


def _inputs(shape: Sequence[int], dtype: str, n: int) -> tuple:
    return tuple((tuple(shape), dtype) for _ in range(n))


def silu(shape: Sequence[int], dtype: str = "float32") -> Program:
    """``x * sigmoid(x)``."""
    return Program(_inputs(shape, dtype, 1), (instr("sigmoid", [0]), instr("mul", [0, 1])), (2,))


def swiglu(shape: Sequence[int], dtype: str = "float32") -> Program:
    """Inputs (gate, up) -> ``silu(gate) * up``."""
    return Program(_inputs(shape, dtype, 2), (instr("sigmoid", [0]), instr("mul", [0, 2]), instr("mul", [3, 1])), (4,))


def swiglu_backward(shape: Sequence[int], dtype: str = "float32") -> Program:
    """Inputs (dh, gate, up) -> (dgate, dup) of ``h = silu(gate) * up``:
    ``dup = dh * silu(gate)``, ``dgate = dh * up * s * (1 + gate * (1 - s))``, s = sigmoid(gate)."""
    code = (instr("sigmoid", [1]),           # 3: s
            instr("mul", [1, 3]),            # 4: silu(gate)
            instr("mul", [0, 4]),            # 5: dup
            instr("sub", [3], scalar=1.0, scalar_pos=0),  # 6: 1 - s
            instr("mul", [1, 6]),            # 7: gate (1 - s)
            instr("add", [7], scalar=1.0),   # 8
            instr("mul", [3, 8]),            # 9: d silu / d gate
            instr("mul", [0, 2]),            # 10: dh * up
            instr("mul", [10, 9]))           # 11: dgate
    return Program(_inputs(shape, dtype, 3), code, (11, 5))


def gelu_tanh(shape: Sequence[int], dtype: str = "float32") -> Program:
    """``0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))``."""
    code = (instr("mul", [0, 0]), instr("mul", [1, 0]), instr("mul", [2], scalar=0.044715), instr("add", [0, 3]),
            instr("mul", [4], scalar=math.sqrt(2.0 / math.pi)), instr("tanh", [5]), instr("add", [6], scalar=1.0),
            instr("mul", [0], scalar=0.5), instr("mul", [8, 7]))
    return Program(_inputs(shape, dtype, 1), code, (9,))
