"""Ready-made fused programs for common activations, forward and backward.

A graph builder makes a fused node from one of them and whole-buffer or tile regions::

    prog = library.swiglu((T, H), "bfloat16")                  # h = silu(gate) * up
    g.task("dvm.fused", [gate, up], [h], attrs={"program": prog.to_attrs()})
    bwd = library.swiglu_backward((T, H), "bfloat16")          # (dh, gate, up) -> (dgate, dup)
    g.task("dvm.fused", [dh, gate, up], [dgate, dup], attrs={"program": bwd.to_attrs()})

Shapes are those of the task's regions (a tile's shape for a tiled node); kernels are
cached by structure, so every tile size shares one. Activations of a reduced dtype (bfloat16,
float16) compute in float32 and round once per output (:func:`opmath`), as a fused kernel
keeps its intermediates in float32 registers. The forms are chosen so the native
backend runs them as its pattern functions (``sigmoid``, ``silu``, ``swiglu``).

Small per-token matrices (MegaMHC's ``n x n`` mix) are unrolled into one value per entry over
the tokens (:func:`mhc_coeff`): row and column sums become chains of adds, so the whole
softmax and Sinkhorn run in registers without a reduction primitive.
"""
from __future__ import annotations

import math
from typing import Sequence

from megaloom.ops.dvm.program import Instr, Program, instr


REDUCED = ("bfloat16", "float16")


def _inputs(shape: Sequence[int], dtype: str, n: int) -> tuple:
    return tuple((tuple(shape), dtype) for _ in range(n))


def opmath(program: Program) -> Program:
    """``program`` computed in float32: its bfloat16 / float16 inputs cast up, its code on the
    float32 values, its outputs cast back to their dtypes (one rounding each, none in between)."""
    n = len(program.inputs)
    low = [i for i, (_, d) in enumerate(program.inputs) if d in REDUCED]
    if not low:
        return program
    code, at, ids = [], n, list(range(n))
    for i in low:
        code.append(instr("cast", [i], dtype="float32"))
        ids[i], at = at, at + 1
    for ins in program.code:
        code.append(Instr(ins.op, tuple(ids[a] for a in ins.args), ins.attrs))
        ids.append(at)
        at += 1
    outs = []
    for o in program.outputs:
        dt = program.specs[o][1]
        if dt in REDUCED:
            code.append(instr("cast", [ids[o]], dtype=dt))
            at += 1
        outs.append(at - 1 if dt in REDUCED else ids[o])
    return Program(program.inputs, tuple(code), tuple(outs))


def sigmoid(shape: Sequence[int], dtype: str = "float32") -> Program:
    """``sigmoid(x)`` (a router's scores)."""
    return opmath(Program(_inputs(shape, dtype, 1), (instr("sigmoid", [0]),), (1,)))


def silu(shape: Sequence[int], dtype: str = "float32") -> Program:
    """``x * sigmoid(x)``."""
    return opmath(Program(_inputs(shape, dtype, 1), (instr("sigmoid", [0]), instr("mul", [0, 1])), (2,)))


def swiglu(shape: Sequence[int], dtype: str = "float32") -> Program:
    """Inputs (gate, up) -> ``silu(gate) * up``."""
    return opmath(Program(_inputs(shape, dtype, 2), (instr("sigmoid", [0]), instr("mul", [0, 2]), instr("mul", [3, 1])),
                          (4,)))


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
    return opmath(Program(_inputs(shape, dtype, 3), code, (11, 5)))


def gelu_tanh(shape: Sequence[int], dtype: str = "float32") -> Program:
    """``0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))``."""
    code = (instr("mul", [0, 0]), instr("mul", [1, 0]), instr("mul", [2], scalar=0.044715), instr("add", [0, 3]),
            instr("mul", [4], scalar=math.sqrt(2.0 / math.pi)), instr("tanh", [5]), instr("add", [6], scalar=1.0),
            instr("mul", [0], scalar=0.5), instr("mul", [8, 7]))
    return opmath(Program(_inputs(shape, dtype, 1), code, (9,)))


class _Code:
    """Straight-line code under construction: ``code(op, *args, **attrs)`` appends one instruction
    and returns its value id."""

    def __init__(self, n_inputs: int):
        self.next, self.code = n_inputs, []

    def __call__(self, op: str, *args: int, **attrs) -> int:
        self.code.append(instr(op, args, **attrs))
        self.next += 1
        return self.next - 1

    def total(self, ids: Sequence[int]) -> int:
        """``ids[0] + ids[1] + ...`` left to right."""
        acc = ids[0]
        for v in ids[1:]:
            acc = self("add", acc, v)
        return acc

    @property
    def instrs(self) -> tuple[Instr, ...]:
        return tuple(self.code)


def mhc_coeff(rows: int, n: int = 4, iters: int = 20, pre_eps: float = 1e-6, dtype: str = "float32") -> Program:
    """MegaMHC's next coefficients for ``rows`` tokens, each logit a ``[rows, 1]`` column.

    Inputs: the ``m = n*n + 2n`` columns of ``raw``, ``inv_rms``, alpha's three entries and the ``m``
    bias entries (``[1]`` each). With ``z = alpha_part * (raw * inv_rms) + bias``, outputs (one column
    each): ``pre = sigmoid(z) + pre_eps`` (n), ``post = 2 sigmoid(z)`` (n) and the mix (n*n, row-major):
    a softmax over each row of ``z``, then ``iters`` Sinkhorn rounds (rows, then columns)."""
    m = n * n + 2 * n
    col, one = ((rows, 1), dtype), ((1,), dtype)
    c = _Code(2 * m + 4)
    inv, alpha, bias = m, (m + 1, m + 2, m + 3), range(m + 4, 2 * m + 4)
    z = [c("add", c("mul", alpha[min(k // n, 2)], c("mul", k, inv)), bias[k]) for k in range(m)]
    pre = [c("add", c("sigmoid", z[i]), scalar=pre_eps) for i in range(n)]
    post = [c("mul", c("sigmoid", z[n + i]), scalar=2.0) for i in range(n)]
    mix = []
    for i in range(n):
        row = z[2 * n + i * n: 2 * n + (i + 1) * n]
        top = row[0]
        for v in row[1:]:
            top = c("maximum", top, v)
        e = [c("exp", c("sub", v, top)) for v in row]
        s = c.total(e)
        mix.append([c("div", v, s) for v in e])
    for _ in range(iters):
        mix = [[c("div", v, s) for v in r] for r, s in ((r, c.total(r)) for r in mix)]
        sums = [c.total([mix[i][j] for i in range(n)]) for j in range(n)]
        mix = [[c("div", mix[i][j], sums[j]) for j in range(n)] for i in range(n)]
    return Program((col,) * m + (col,) + (one,) * 3 + (one,) * m, c.instrs,
                   tuple(pre + post + [v for r in mix for v in r]))
