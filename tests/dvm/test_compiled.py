"""Hot programs compiled at run time (ops/native/jit.c): the interpreter's bits, the
threshold, the disk cache and the fallback when no compiler runs."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from megaloom.ops import dvm, native
from megaloom.ops.dvm.primitives import PRIMITIVES
from megaloom.ops.dvm.program import Program, instr

from .test_native import SPECIAL

pytestmark = [
    pytest.mark.skipif(not native.AVAILABLE, reason="the compiled kernels are not built"),
    pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler"),
]
SHAPE = (48, 160)
UNARY = sorted(op for op, p in PRIMITIVES.items() if p.arity == 1 and op != "cast")
BINARY = sorted(op for op, p in PRIMITIVES.items() if p.arity == 2)


@pytest.fixture
def jit(tmp_path_factory):
    """Compile every program at its first call, into a fresh cache; settings restored after."""
    old = native.ext.jit_config()
    cache = str(tmp_path_factory.mktemp("dvm_cache"))
    native.ext.jit_config(threshold=0, cache_dir=cache)
    yield cache
    native.ext.jit_config(threshold=old["threshold"], cc=old["cc"], cache_dir=old["cache_dir"])


def wide(dtype: str) -> Program:
    """Every primitive and form as an output of its own: tensor and scalar operands on either
    side, a broadcast row, where with a scalar, casts to every dtype."""
    ins = ((SHAPE, dtype), (SHAPE, dtype), ((1, SHAPE[1]), dtype), (SHAPE, "bool"))
    code = [instr(op, [0]) for op in UNARY]
    for op in BINARY:
        code += [instr(op, [0, 1]), instr(op, [0, 2]), instr(op, [0], scalar=0.75),
                 instr(op, [1], scalar=-1.5, scalar_pos=0)]
    code += [instr("where", [3, 0, 2]), instr("where", [3, 1], scalar=2.5, scalar_pos=1)]
    code += [instr("cast", [0], dtype=d) for d in ("float32", "bfloat16", "float16", "bool")]
    return Program(ins, tuple(code), tuple(range(4, 4 + len(code))))


def chain(dtype: str) -> Program:
    """A long chain whose registers are reused, with the pattern functions in float32
    (sigmoid, silu, swiglu) and a tanh-GELU."""
    c = [instr("neg", [0]), instr("exp", [2]), instr("add", [3], scalar=1.0), instr("reciprocal", [4]),  # 5: sigmoid
         instr("mul", [0, 5]), instr("mul", [6, 1]),  # 7: swiglu(x, y)
         instr("mul", [0], scalar=0.044715), instr("mul", [8, 0]), instr("mul", [9, 0]), instr("add", [10, 0]),
         instr("mul", [11], scalar=0.7978845608), instr("tanh", [12]), instr("add", [13], scalar=1.0),
         instr("mul", [14, 7]), instr("maximum", [15, 1]), instr("div", [16], scalar=3.0), instr("sqrt", [17]),
         instr("gt", [18], scalar=1.0), instr("where", [19, 17, 16]), instr("sub", [20, 0])]
    return Program(((SHAPE, dtype), (SHAPE, dtype)), tuple(c), (7, 21))


def inputs(prog: Program, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    xs = []
    for shape, dt in prog.inputs:
        x = torch.randn(shape, generator=g) * 3
        x.view(-1)[: len(SPECIAL)] = torch.tensor(SPECIAL)
        xs.append(x > 0 if dt == "bool" else x.to(getattr(torch, dt)))
    xs[1] = xs[1].t().contiguous().t() if xs[1].dim() == 2 else xs[1]  # column-major: converted on the way in
    return xs


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns, every NaN as one (the sign of a NaN made by an invalid operation
    follows operand order, which the compiler may swap; instruction sets differ alike)."""
    t = t.masked_fill(t.isnan(), float("nan")) if t.is_floating_point() else t
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def run(prog: Program, xs) -> list[torch.Tensor]:
    outs = [torch.empty(s, dtype=getattr(torch, d)) for s, d in prog.out_specs()]
    dvm.compile_program(prog)(xs, outs)
    return outs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_compiled_programs_give_the_interpreters_bits(jit, dtype):
    for prog in (wide(dtype), chain(dtype)):
        xs = inputs(prog, 1)
        native.ext.jit_config(threshold=-1)
        want = run(prog, xs)
        native.ext.jit_config(threshold=0)
        built = native.ext.jit_stats()["built"]
        run(prog, xs)  # queues the build
        assert native.ext.jit_wait(120)
        stats = native.ext.jit_stats()
        assert stats["built"] == built + 1, stats["last_error"]
        got = run(prog, xs)
        for k, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(bits(a), bits(b)), (dtype, k, prog.code[prog.outputs[k] - len(prog.inputs)])


@pytest.mark.slow
def test_threshold_counts_elements_and_the_disk_cache_serves_other_processes(jit):
    prog = Program(((SHAPE, "float32"),), (instr("mul", [0], scalar=0.3), instr("exp", [1]), instr("sub", [2, 0])),
                   (3,))
    x = torch.randn(SHAPE)
    native.ext.jit_config(threshold=-1)
    want = run(prog, [x])[0]
    native.ext.jit_config(threshold=3 * x.numel())
    before = native.ext.jit_stats()
    for _ in range(2):
        run(prog, [x])
    assert native.ext.jit_stats()["programs"] == before["programs"] + 1
    assert native.ext.jit_wait(120) and native.ext.jit_stats()["built"] == before["built"]  # not hot yet
    run(prog, [x])
    assert native.ext.jit_wait(120) and native.ext.jit_stats()["built"] == before["built"] + 1
    assert run(prog, [x])[0].equal(want)
    code = f"""
import json, torch
from megaloom.ops import dvm, native
from megaloom.ops.dvm.program import Program, instr
native.ext.jit_config(threshold=0, cache_dir={jit!r})
prog = Program(((({SHAPE[0]}, {SHAPE[1]}), "float32"),), (instr("mul", [0], scalar=0.3), instr("exp", [1]),
               instr("sub", [2, 0])), (3,))
dvm.compile_program(prog)([torch.randn({SHAPE[0]}, {SHAPE[1]})], [torch.empty({SHAPE[0]}, {SHAPE[1]})])
native.ext.jit_wait(120)
print(json.dumps(native.ext.jit_stats()))
"""
    out = subprocess.run([sys.executable, "-c", code], check=True, timeout=300, capture_output=True, text=True)
    stats = json.loads(out.stdout.strip().splitlines()[-1])
    assert stats["loaded"] == 1 and stats["built"] == 0, stats


def test_a_compiler_that_fails_leaves_the_interpreter_running(jit):
    prog = Program(((SHAPE, "float32"),), (instr("add", [0], scalar=0.123), instr("tanh", [1]), instr("abs", [2])),
                   (3,))
    x = torch.randn(SHAPE)
    native.ext.jit_config(threshold=-1)
    want = run(prog, [x])[0]
    native.ext.jit_config(threshold=0, cc="/nonexistent/cc")
    failed = native.ext.jit_stats()["failed"]
    for _ in range(2):
        assert run(prog, [x])[0].equal(want)
        assert native.ext.jit_wait(120)
    stats = native.ext.jit_stats()
    assert stats["failed"] == failed + 1 and "/nonexistent/cc" in stats["last_error"]
