"""The native backend: a fused program lowered to register code for ``megaloom.ops._native``.

Compiling is lowering plus register allocation, done once per signature in Python (tens
of microseconds; no compiler runs): each instruction becomes one of the extension's
pre-compiled loops over a block of registers. At run time the extension cuts the domain
into blocks of a few hundred elements, runs every instruction over a block while its
registers stay in L1, and spreads the blocks over its worker threads with the GIL
released. Once the register code has run over enough elements, the extension compiles it
in the background into one loop whose values stay in registers and runs that instead, with
the same bits (ops/native/jit.c). Inputs are read and outputs written in place where they
are float32 and contiguous over a block; other dtypes and layouts are converted on the way
in and out.

Semantics are torch's, op by op (:mod:`megaloom.ops.dvm.primitives`): float32 registers,
a bfloat16 / float16 result rounded after every instruction, a scalar operand in the
operand's dtype except where torch keeps it in float32 (``mul`` and ``x / s`` on reduced
dtypes), ``pow`` by a scalar through torch's special cases (square, cube, square root, ...).
Algebraic ops are bit-exact with torch; transcendentals differ from torch's by at most
about one ulp (docs/dvm.md).

A program the backend does not take (float64 or integer values, an output that is
broadcast over the domain, more than 256 registers) compiles to the tiled torch backend
instead (:func:`native_kernel` returns None; :func:`unsupported` says why).
"""
from __future__ import annotations

from array import array
from typing import Any, NamedTuple, Sequence

import torch

from megaloom.ops import native as N
from megaloom.ops.dvm.program import Program, pattern
from megaloom.runtime.dtypes import torch_dtype
from megaloom.runtime.errors import ExecutionError

DTYPES = ("float32", "bfloat16", "float16", "bool")
_RND = {"float32": 0, "bfloat16": 1, "float16": 2, "bool": 0}
_OPMATH_SCALARS = {("mul", 0), ("mul", 1), ("div", 1)}  # kept in float32 by torch for bf16/fp16 operands
MAX_REGS = 256


OPCODES: dict[str, int] = {name: i for i, name in enumerate(N.ext.DVM_OPS)} if N.AVAILABLE else {}


def _in_dtype(s: float, dtype: str) -> float:
    """``s`` rounded to ``dtype`` (as torch converts a scalar operand), as a Python float."""
    return float(torch.tensor(s, dtype=torch_dtype(dtype)).item())


class Const(float):
    """A scalar operand of a native op (becomes a constant register)."""


class NOp(NamedTuple):
    """One native instruction over values: op name, result value, operands, result rounding."""

    op: str
    dst: int
    args: tuple  # value ids (int) or Const
    rnd: int = 0


def lower(program: Program) -> tuple[list[NOp], int]:
    """The program as native ops over value ids (program values first, then temporaries),
    with the number of value ids used."""
    n_in = len(program.inputs)
    dtypes = [d for _, d in program.specs]
    ops: list[NOp] = []
    fresh = [program.n_values]

    def temp() -> int:
        fresh[0] += 1
        return fresh[0] - 1

    for k, ins in enumerate(program.code):
        _lower_instr(ins.op, list(ins.args), [dtypes[a] for a in ins.args], ins.attr_dict, dtypes[n_in + k], n_in + k,
                     ops, temp)
    return ops, fresh[0]


def _lower_instr(op: str, args: list, dts: list[str], attrs: dict[str, Any], rd: str, dst: int, ops: list[NOp],
                 temp) -> None:
    rnd = _RND[rd]
    if "scalar" in attrs:  # the scalar becomes a constant at its operand position
        pos = int(attrs.get("scalar_pos", len(args)))
        odt = dts[-1] if op != "where" else rd
        s = attrs["scalar"]
        c = Const(_in_dtype(s, "float32") if odt == "float32" or (op, pos) in _OPMATH_SCALARS else _in_dtype(s, odt))
        if op == "pow" and pos == 1:
            return _pow_scalar(args[0], s, rd, dst, ops, temp)
        if op in ("maximum", "minimum"):  # torch.clamp_min / clamp_max(x, s), whichever side s is on
            return ops.append(NOp("clamp_min" if op == "maximum" else "clamp_max", dst, (args[0], c), rnd))
        args = args[:pos] + [c] + args[pos:]
    if op in ("eq", "ne", "lt", "le", "gt", "ge", "where"):
        return ops.append(NOp(op, dst, tuple(args)))
    if op == "cast":
        if rd == "bool":
            return ops.append(NOp("nonzero", dst, tuple(args)))
        return ops.append(NOp("copy", dst, tuple(args), 0 if dts[0] == "bool" else rnd))
    ops.append(NOp(op, dst, tuple(args), rnd))


def _pow_scalar(x: int, s: float, rd: str, dst: int, ops: list[NOp], temp) -> None:
    """``x ** s`` through torch's special cases (ATen pow_tensor_scalar) per dtype."""
    rnd = _RND[rd]
    if s == 1:
        return ops.append(NOp("copy", dst, (x,)))
    if rd != "float16" and s != 0:
        special = {0.5: "sqrt", -0.5: "rsqrt", -1: "reciprocal"}.get(s)
        if special:
            return ops.append(NOp(special, dst, (x,), rnd))
        e = float(s) if rd == "float32" else _in_dtype(s, rd)  # float32: the double exponent
        if e == 2.0:
            return ops.append(NOp("mul", dst, (x, x), rnd))
        if e in (3.0, -2.0):
            sq = temp()
            ops.append(NOp("mul", sq, (x, x), rnd))
            return ops.append(NOp("mul", dst, (sq, x), rnd) if e == 3.0 else NOp("reciprocal", dst, (sq,), rnd))
    ops.append(NOp("pow", dst, (x, Const(_in_dtype(s, rd))), rnd))


def alias_copies(ops: list[NOp], keep: set[int]) -> list[NOp]:
    """Drop register copies that change nothing (a cast up to float32, ``x ** 1``; registers are
    float32 already) unless they define an output: their readers read the source instead."""
    alias: dict[int, int] = {}
    out = []
    for o in ops:
        o = o._replace(args=tuple(a if isinstance(a, Const) else alias.get(a, a) for a in o.args))
        if o.op == "copy" and not o.rnd and o.dst not in keep:
            alias[o.dst] = o.args[0]
        else:
            out.append(o)
    return out


def fuse_patterns(ops: list[NOp], keep: set[int]) -> list[NOp]:
    """Pattern functions for common float32 chains, computing exactly what the chain does:
    neg, exp, add 1, reciprocal -> ``sigmoid``; ``x * sigmoid(x)`` -> ``silu``;
    ``silu(a) * b`` -> ``swiglu``. A chain's inner values must have no other use and not
    be in ``keep`` (outputs)."""
    uses: dict[int, int] = {}
    for o in ops:
        for a in o.args:
            if not isinstance(a, Const):
                uses[a] = uses.get(a, 0) + 1
    inner = lambda v: uses.get(v, 0) == 1 and v not in keep  # noqa: E731
    out: list[NOp] = []
    made: dict[int, NOp] = {}  # value -> the op that defines it (in ``out``)
    for o in ops:
        d = {a: made.get(a) for a in o.args if not isinstance(a, Const)}
        new = o
        x = _exp_neg_plus_one(d.get(o.args[0]), made, inner) if o.op == "reciprocal" and not o.rnd else None
        if x is not None:
            new = NOp("sigmoid", o.dst, (x,))
        elif o.rnd == 0 and o.op == "mul":
            for i, a in enumerate(o.args):
                p, other = d.get(a), o.args[1 - i]
                if p is not None and inner(a) and p.rnd == 0 and p.op == "sigmoid" and p.args[0] == other:
                    new = NOp("silu", o.dst, (other,))
                    break
                if p is not None and inner(a) and p.rnd == 0 and p.op == "silu" and not isinstance(other, Const):
                    new = NOp("swiglu", o.dst, (p.args[0], other))
                    break
        if new is not o:
            dead = {a for a in o.args if not isinstance(a, Const) and inner(a) and a not in new.args}
            while dead:  # drop the absorbed chain
                v = dead.pop()
                p = made.pop(v, None)
                if p is not None and p in out:
                    out.remove(p)
                    dead |= {a for a in p.args if not isinstance(a, Const) and inner(a) and a not in new.args}
        made[o.dst] = new
        out.append(new)
    return out


def _exp_neg_plus_one(add: NOp | None, made: dict[int, NOp], inner) -> int | None:
    """x when ``add`` computes ``exp(neg(x)) + 1`` (either order) in float32 with single-use
    inner values, else None."""
    if add is None or add.op != "add" or add.rnd or sum(isinstance(a, Const) for a in add.args) != 1:
        return None
    c, e = add.args if isinstance(add.args[0], Const) else add.args[::-1]
    ex = made.get(e)
    if float(c) != 1.0 or ex is None or not inner(e) or ex.op != "exp" or ex.rnd:
        return None
    neg = made.get(ex.args[0])
    if neg is None or not inner(ex.args[0]) or neg.op != "neg" or neg.rnd:
        return None
    return neg.args[0]


class Lowered:
    """Register code of one program: what :class:`NativeKernel` hands to the extension.

    Registers: inputs first, then values in order of need; a value's register is reused
    once the value is dead, never as the destination of the instruction that reads it
    last (the loops take restrict pointers). Scalars are operands of their own kind."""

    def __init__(self, program: Program):
        prog = self.program = program
        n_in = len(prog.inputs)
        dtypes = [d for _, d in prog.specs]
        outs = set(prog.outputs)
        ops, _ = lower(prog)
        ops = fuse_patterns(alias_copies(ops, outs), outs)
        last_use: dict[int, int] = {}
        for k, o in enumerate(ops):
            for a in o.args:
                if not isinstance(a, Const):
                    last_use[a] = k
        n = 0
        free: list[int] = []
        consts: dict[bytes, int] = {}  # float32 bit pattern (-0.0 != 0.0) -> operand code -2 - index
        reg: dict[int, int] = {}
        self.in_regs = []
        for v in range(n_in):
            self.in_regs.append(n if v in last_use else -1)
            if v in last_use:
                reg[v], n = n, n + 1
        code = []
        for k, o in enumerate(ops):
            args = []
            for a in o.args:
                if isinstance(a, Const):
                    args.append(consts.setdefault(array("f", [a]).tobytes(), -2 - len(consts)))
                else:
                    args.append(reg[a])
            if o.dst in outs or not free:
                reg[o.dst], n = n, n + 1
            else:
                reg[o.dst] = free.pop()
            for a in set(o.args):
                if not isinstance(a, Const) and last_use[a] == k and a >= n_in and a not in outs:
                    free.append(reg[a])
            args += [-1] * (3 - len(args))
            code.append((OPCODES[o.op], reg[o.dst], *args, o.rnd))
        self.ops = ops
        self.n_regs = n
        self.out_regs = [reg[o] for o in prog.outputs]
        self.const_vals = b"".join(consts)  # insertion order: index k at code -2 - k
        self.code_bytes = array("i", [f for c in code for f in c]).tobytes()
        self.in_types = [torch_dtype(dtypes[v]) for v in range(n_in)]
        self.out_types = [torch_dtype(dtypes[o]) for o in prog.outputs]


def unsupported(program: Program) -> str | None:
    """Why the native backend cannot run ``program`` (None: it can)."""
    if not N.enabled():
        return "the compiled kernels are not built or are switched off"
    bad = sorted({d for _, d in program.specs} - set(DTYPES))
    if bad:
        return f"dtypes {bad} (it takes {', '.join(DTYPES)})"
    dom = program.domain
    for o in program.outputs:
        if set(pattern(program.specs[o][0], dom)) - {"f"}:
            return f"output value {o} broadcasts over the domain {dom}"
    return None


class NativeKernel:
    """``kernel(inputs, outputs)`` through the extension; inputs of other dtypes or devices,
    or layouts it does not take, run on the tiled backend instead."""

    backend = "native"

    def __init__(self, program: Program, opts, low: Lowered):
        self.program, self.opts, self._low = program, opts, low
        self._ins = list(zip(low.in_regs, [N.DTYPE_CODES[t] for t in low.in_types], low.in_types))
        self._outs = list(zip(low.out_regs, [N.DTYPE_CODES[t] for t in low.out_types], low.out_types))
        self._block = 0 if opts.tile_bytes is None else max(16, opts.tile_bytes // 4 // 16 * 16)
        self._fallback = None

    def __call__(self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> None:
        if len(inputs) != len(self._ins) or len(outputs) != len(self._outs):
            raise ExecutionError(f"fused kernel takes {len(self._ins)} inputs and {len(self._outs)} outputs, "
                                 f"got {len(inputs)} and {len(outputs)}")
        operands = []
        for x, (reg, code, dt) in zip(inputs, self._ins):
            if x.dtype != dt or not x.is_cpu:
                return self.fallback(inputs, outputs)
            operands.append((x.data_ptr(), code, reg, x.shape, x.stride()))
        for y, (reg, code, dt) in zip(outputs, self._outs):
            if y.dtype != dt or not y.is_cpu:
                return self.fallback(inputs, outputs)
            operands.append((y.data_ptr(), code, reg, y.shape, y.stride()))
        low = self._low
        try:
            N.ext.dvm_run(low.code_bytes, low.const_vals, low.n_regs, operands, len(inputs),
                          N.threads(self.opts.threads), self._block)
        except NotImplementedError:
            self.fallback(inputs, outputs)
        except ValueError as e:
            raise ExecutionError(f"fused kernel on inputs {[tuple(x.shape) for x in inputs]}, outputs "
                                 f"{[tuple(y.shape) for y in outputs]}: {e}") from None

    def fallback(self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> None:
        """Run the tiled torch backend (the same program)."""
        if self._fallback is None:
            from megaloom.ops.dvm.backend import TiledKernel

            self._fallback = TiledKernel(self.program, self.opts)
        self._fallback(inputs, outputs)


def native_kernel(program: Program, opts) -> NativeKernel | None:
    """The native kernel of ``program``, or None when the backend does not take it."""
    if unsupported(program) is not None:
        return None
    low = Lowered(program)
    return NativeKernel(program, opts, low) if low.n_regs <= MAX_REGS else None
