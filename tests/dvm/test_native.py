"""The native backend (megaloom.ops._native) against eager torch and the tiled torch backend.

Algebraic ops (arithmetic, comparisons, selection, casts, rounding to bfloat16/float16)
are bit-exact with torch. Transcendentals come from other math code than torch's (its
MKL / Sleef) and are held to the per-op bounds in ULP below, measured and documented in
docs/dvm.md.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megaloom.ops import dvm, native
from megaloom.ops.dvm import fx
from megaloom.ops.dvm.native import Lowered
from megaloom.ops.dvm.primitives import PRIMITIVES
from megaloom.ops.dvm.program import Program, instr
from megaloom.runtime.errors import ExecutionError

from .test_numerics import _inputs, _tolerance

needs_ext = pytest.mark.skipif(not native.AVAILABLE, reason="the compiled kernels are not built")
DTYPES = ("float32", "bfloat16", "float16")
# max |native - torch| in ULP of the result dtype, per op (torch's own float32 sqrt is not
# correctly rounded on this build, so even sqrt has one ULP)
ULP = {"exp": 1, "log": 1, "sqrt": 1, "tanh": 1, "sigmoid": 3, "erf": 1, "pow": 1}
EXACT = sorted(set(PRIMITIVES) - set(ULP) - {"cast", "where"})
SPECIAL = [0.0, -0.0, 1.0, -1.0, 0.5, 2.0, -3.0, math.inf, -math.inf, math.nan, 1e-40, -1e-40, 88.5, -104.0, 1e30,
           -1e30, 65504.0, 3e38, 1e-5]


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in representable values of a's dtype; 0 for NaN against NaN, huge for NaN
    against a number."""
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[a.dtype]
    ia, ib = a.view(bits).long(), b.view(bits).long()
    top = 1 << (8 * a.element_size() - 1)
    ia = torch.where(ia < 0, -(ia + top), ia)
    ib = torch.where(ib < 0, -(ib + top), ib)
    d = (ia - ib).abs()
    d[a.isnan() & b.isnan()] = 0
    d[a.isnan() ^ b.isnan()] = 1 << 40
    return d


def run(prog: Program, xs, **opts):
    k = dvm.compile_program(prog, dvm.Options(**opts))
    outs = [torch.full(s, 7, dtype=getattr(torch, d)) for s, d in prog.out_specs()]
    k(xs, outs)
    return k, outs


def operands(op: str, dtype: str, n: int = 4096, seed: int = 0) -> list[torch.Tensor]:
    """Vector-path sized random operands (torch's ragged-tail code differs), special values included."""
    g = torch.Generator().manual_seed(seed)
    arity = PRIMITIVES[op].arity
    xs = []
    for i in range(arity):
        x = torch.randn(n, generator=g) * (4 if op != "pow" else 2)
        if op in ("log", "sqrt", "rsqrt") or (op == "pow" and i == 0):
            x = x.abs() * 10 ** torch.randint(-3, 4, (n,), generator=g).float()
        x[: len(SPECIAL)] = torch.tensor(SPECIAL).roll(3 * i)
        xs.append(x.to(getattr(torch, dtype)))
    return xs


@needs_ext
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", EXACT + sorted(ULP))
def test_every_primitive(op, dtype):
    xs = operands(op, dtype)
    prog = Program(tuple(((4096,), dtype) for _ in xs), (instr(op, list(range(len(xs)))),), (len(xs),))
    k, (got,) = run(prog, xs)
    assert k.backend == "native"
    (want,) = prog.run_reference(xs)
    if got.dtype == torch.bool:
        assert torch.equal(got, want)
        return
    if op == "erf" and dtype != "float32":  # torch's bf16/fp16 erf is a 1.5e-7-absolute approximation
        want = torch.erf(xs[0].double()).to(got.dtype)
    d = ulps(got, want)
    assert int(d.max()) <= ULP.get(op, 0), (op, dtype, int(d.max()))
    zeros = (want == 0) & (got == 0)
    assert torch.equal(got.signbit()[zeros], want.signbit()[zeros])


@needs_ext
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["add", "sub", "mul", "div", "maximum", "minimum", "eq", "lt", "ge", "pow"])
@pytest.mark.parametrize("pos", [0, 1])
def test_scalar_operands_follow_torch(op, dtype, pos):
    (x,) = operands("exp", dtype, seed=1)
    scalars = [0.1, -1.25, 3, 0.044715, 448.0, -0.0, 1e-3] if op != "pow" else [0.5, -0.5, -1, 0, 1, 2, 3, -2, 1.7]
    for s in scalars:
        xx = x.abs() + 0.25 if op == "pow" else x
        prog = Program((((4096,), dtype),), (instr(op, [0], scalar=s, scalar_pos=pos),), (1,))
        _, (got,) = run(prog, [xx])
        (want,) = prog.run_reference([xx])
        # x ** 0.5 is torch's sqrt (see ULP); other special exponents are exact ops
        bound = 1 if op == "pow" and (pos == 0 or s not in (-0.5, -1, 0, 1, 2, 3, -2)) else 0
        if got.dtype == torch.bool:
            assert torch.equal(got, want), s
        else:
            assert int(ulps(got, want).max()) <= bound, (s, int(ulps(got, want).max()))


@needs_ext
def test_casts_where_and_bool_values():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, 80, generator=g) * 1000
    x[0, :len(SPECIAL)] = torch.tensor(SPECIAL)
    mask = torch.rand(64, 80, generator=g) > 0.5
    for src, dst in [("float32", "bfloat16"), ("float32", "float16"), ("bfloat16", "float16"), ("float16", "bfloat16"),
                     ("bfloat16", "float32"), ("float32", "bool"), ("float16", "bool")]:
        xs = x.to(getattr(torch, src))
        prog = Program((((64, 80), src),), (instr("cast", [0], dtype=dst),), (1,))
        _, (got,) = run(prog, [xs])
        assert torch.equal(got.view(torch.uint8) if dst == "bool" else got.view(torch.int16 if dst != "float32"
                           else torch.int32), prog.run_reference([xs])[0].view(got.dtype).view(
                               torch.uint8 if dst == "bool" else torch.int16 if dst != "float32" else torch.int32)) \
            or torch.equal(got.isnan(), prog.run_reference([xs])[0].isnan())
    prog = Program((((64, 80), "bool"), ((64, 80), "float32"), ((1, 80), "float32")),
                   (instr("where", [0, 1, 2]), instr("gt", [3], scalar=0.0), instr("cast", [4], dtype="float32"),
                    instr("where", [4, 5], scalar=-2.5, scalar_pos=2)), (3, 4, 6))
    row = torch.randn(1, 80, generator=g)
    _, got = run(prog, [mask, x, row])
    for a, b in zip(got, prog.run_reference([mask, x, row])):
        assert a.dtype == b.dtype and torch.equal(a, b)


@needs_ext
@pytest.mark.parametrize("shape,row,tile_bytes", [((37, 19), (1, 19), 64), ((3, 1000), (3, 1), 256), ((1000,), (), None),
                                                   ((5, 7, 9), (7, 1), 64), ((2, 3, 4, 5), (5,), 64),
                                                   ((2, 1, 64), (2, 1, 1), None), ((), (), None)])
def test_layouts_broadcasting_and_blocks(shape, row, tile_bytes):
    g = torch.Generator().manual_seed(4)
    x, r = torch.randn(shape, generator=g), torch.randn(row, generator=g)
    prog = Program(((shape, "float32"), (row, "float32")),
                   (instr("mul", [0, 1]), instr("add", [2], scalar=0.5), instr("maximum", [3, 0]), instr("sub", [4, 1])),
                   (3, 5))
    _, got = run(prog, [x, r], tile_bytes=tile_bytes)
    for a, b in zip(got, prog.run_reference([x, r])):
        assert torch.equal(a, b)


@needs_ext
def test_strided_inputs_and_outputs_and_threads():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(700, 300, generator=g).t()  # (300, 700), column-major
    y = torch.randn(300, 1400, generator=g)[:, ::2]  # every other column
    prog = Program((((300, 700), "float32"), ((300, 700), "float32")),
                   (instr("sigmoid", [0]), instr("mul", [2, 1]), instr("tanh", [3])), (3, 4))
    want = [torch.empty(300, 700), torch.empty(700, 300).t()]
    run1 = dvm.compile_program(prog, dvm.Options(threads=1))
    run1([x, y], want)
    for threads, tile_bytes in ((2, None), (2, 256), (3, 4096)):
        outs = [torch.empty(300, 700), torch.empty(700, 300).t()]
        dvm.compile_program(prog, dvm.Options(threads=threads, tile_bytes=tile_bytes))([x, y], outs)
        assert all(torch.equal(a, b) for a, b in zip(outs, want))
    for a, b in zip(want, prog.run_reference([x, y])):
        torch.testing.assert_close(a, b, rtol=4e-7, atol=4e-7)


@needs_ext
def test_large_outputs_and_unaligned_inputs():
    """Outputs of 8 MiB on two threads; misaligned inputs."""
    x = torch.randn(1 << 21, generator=torch.Generator().manual_seed(6))
    prog = Program((((1 << 21,), "float32"),), (instr("neg", [0]), instr("mul", [1, 0])), (1, 2))
    _, (a, b) = run(prog, [x], threads=2)
    assert torch.equal(a, -x) and torch.equal(b, -x * x)
    tail = Program((((x.numel() - 1,), "float32"),), prog.code, prog.outputs)
    _, (c, d) = run(tail, [x[1:]], threads=2)
    assert torch.equal(c, -x[1:]) and torch.equal(d, -x[1:] * x[1:])


@needs_ext
def test_in_place_outputs_overlapping_inputs():
    x = torch.randn(64, 512, generator=torch.Generator().manual_seed(7))
    want = torch.tanh(x * 2.0) + x
    prog = Program((((64, 512), "float32"),), (instr("mul", [0], scalar=2.0), instr("tanh", [1]), instr("add", [2, 0])),
                   (3,))
    _, (fresh,) = run(prog, [x])
    dvm.compile_program(prog)([x], [x])  # the output is the input: block by block, reads before writes
    assert torch.equal(x, fresh) and int(ulps(x, want).max()) <= 1


@needs_ext
def test_every_instruction_set_gives_the_same_bits():
    g = torch.Generator().manual_seed(8)
    xs = [torch.randn(33, 250, generator=g) * 5, torch.rand(33, 250, generator=g) + 0.1]
    prog = Program((((33, 250), "float32"), ((33, 250), "float32")),
                   tuple(instr(op, [0]) for op in ("exp", "tanh", "sigmoid", "erf")) + (instr("log", [1]),
                   instr("pow", [1, 0]), instr("cast", [6], dtype="bfloat16"), instr("cast", [5], dtype="float16")),
                   tuple(range(2, 10)))
    old = native.ext.isa()
    results = []
    try:
        for isa in native.ext.isas():
            native.ext.set_isa(isa)
            results.append(run(prog, xs)[1])
    finally:
        native.ext.set_isa(old)
    for other in results[1:]:
        assert all(torch.equal(a, b) or torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
                   for a, b in zip(results[0], other))
    with pytest.raises(ValueError, match="not available"):
        native.ext.set_isa("sse9")


@needs_ext
def test_concurrent_callers():
    """Python threads calling kernels at once (the pool is busy: callers run alone)."""
    prog = Program((((256, 1024), "float32"),), (instr("exp", [0]), instr("mul", [1], scalar=0.5)), (2,))
    xs = [torch.randn(256, 1024, generator=torch.Generator().manual_seed(i)) for i in range(6)]
    want = [run(prog, [x])[1][0] for x in xs]
    got = [None] * len(xs)

    def work(i):
        got[i] = run(prog, [xs[i]], threads=2)[1][0]

    ts = [threading.Thread(target=work, args=(i,)) for i in range(len(xs))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@needs_ext
def test_pattern_functions_compute_the_chain_they_replace():
    silu = (instr("neg", [0]), instr("exp", [2]), instr("add", [3], scalar=1.0), instr("reciprocal", [4]))
    fused = Program((((64, 300), "float32"), ((64, 300), "float32")), silu + (instr("mul", [0, 5]), instr("mul", [6, 1])),
                    (7,))
    kept = Program(fused.inputs, fused.code, (5, 7))  # the sigmoid is an output: the mul reads it, no silu/swiglu
    assert [o.op for o in Lowered(fused).ops] == ["swiglu"]
    assert [o.op for o in Lowered(kept).ops] == ["sigmoid", "mul", "mul"]
    g = torch.Generator().manual_seed(9)
    xs = [torch.randn(64, 300, generator=g) * 6, torch.randn(64, 300, generator=g)]
    _, (a,) = run(fused, xs)
    _, (_, b) = run(kept, xs)
    assert torch.equal(a, b)
    assert int(ulps(a, fused.run_reference(xs)[0]).max()) <= 4
    chain = (instr("neg", [0]), instr("exp", [1]), instr("add", [2], scalar=1.0), instr("reciprocal", [3]))
    bf16 = Program((((64, 300), "bfloat16"),), chain + (instr("mul", [0, 4]),), (5,))
    assert "silu" not in [o.op for o in Lowered(bf16).ops]  # every bf16 step rounds: no fusion


def test_programs_the_backend_does_not_take_run_on_the_tiled_backend():
    x = torch.randn(8, 16, dtype=torch.float64)
    f64 = Program((((8, 16), "float64"),), (instr("exp", [0]), instr("neg", [1])), (2,))
    assert dvm.compile_program(f64).backend == "tiled"
    bcast = Program((((8, 16), "float32"), ((1, 16), "float32")), (instr("exp", [1]), instr("add", [0, 2])), (2, 3))
    assert dvm.compile_program(bcast).backend == "tiled"
    assert dvm.native.unsupported(f64) is not None
    _, (y,) = run(f64, [x])
    assert torch.equal(y, -torch.exp(x))


@needs_ext
def test_inputs_of_another_dtype_fall_back_and_bad_outputs_raise():
    prog = Program((((8, 16), "float32"),), (instr("exp", [0]), instr("neg", [1])), (2,))
    k = dvm.compile_program(prog)
    x = torch.randn(8, 16)
    out = torch.empty(8, 16)
    k([x.double()], [out])  # torch's tiled kernel takes it (its ops promote and cast)
    assert torch.allclose(out, -torch.exp(x), rtol=1e-6)
    with pytest.raises(ExecutionError, match="broadcast shape"):
        k([x], [torch.empty(8, 15)])
    with pytest.raises(ExecutionError, match="takes 1 inputs"):
        k([x, x], [out])


@st.composite
def native_programs(draw):
    """Random programs over the native dtypes; ``exact``: only bit-exact ops were drawn."""
    dtype = draw(st.sampled_from(DTYPES))
    rank = draw(st.integers(1, 3))
    domain = tuple(draw(st.integers(1, 9)) for _ in range(rank))
    shapes = [domain]
    for _ in range(draw(st.integers(0, 2))):
        pat = draw(st.lists(st.sampled_from("fb"), min_size=rank, max_size=rank))
        shape = tuple(d if c == "f" else 1 for c, d in zip(pat, domain))
        shapes.append(shape[draw(st.integers(0, rank - 1)):])
    code, data, n = [], list(range(len(shapes))), len(shapes)
    exact = True
    for _ in range(draw(st.integers(1, 10))):
        kind = draw(st.sampled_from(["unary", "binary", "scalar", "where", "transcendental"]))
        a = draw(st.sampled_from(data))
        if kind == "unary":
            code.append(instr(draw(st.sampled_from(["neg", "abs", "relu", "reciprocal", "rsqrt"])), [a]))
        elif kind == "transcendental":
            code.append(instr(draw(st.sampled_from(["exp", "tanh", "sigmoid", "erf"])), [a]))
            exact = False
        elif kind == "binary":
            code.append(instr(draw(st.sampled_from(["add", "sub", "mul", "div", "maximum", "minimum"])),
                              [a, draw(st.sampled_from(data))]))
        elif kind == "scalar":
            code.append(instr(draw(st.sampled_from(["add", "sub", "mul", "div", "maximum", "minimum"])), [a],
                              scalar=draw(st.sampled_from([0.5, -1.25, 2.0, 0.044715, 3])),
                              scalar_pos=draw(st.integers(0, 1))))
        else:
            code.append(instr(draw(st.sampled_from(["gt", "le", "ne"])), [a], scalar=0))
            n += 1
            code.append(instr("where", [n - 1, a, draw(st.sampled_from(data))]))
        n += 1
        data.append(n - 1)
    if draw(st.booleans()):
        code.append(instr("cast", [n - 1], dtype=draw(st.sampled_from([d for d in DTYPES if d != dtype]))))
        n += 1
    outs = sorted(set([n - 1] + draw(st.lists(st.integers(len(shapes), n - 1), max_size=2))))
    prog = Program(tuple((s, dtype) for s in shapes), tuple(code), tuple(outs))
    return prog, exact, draw(st.integers(0, 2**31)), draw(st.booleans()), draw(st.sampled_from([None, 64, 192]))


@needs_ext
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(native_programs())
def test_random_programs_native_equals_tiled_equals_eager(case):
    """Programs of exact ops: native, tiled torch backend and eager torch agree bit for bit.
    With transcendentals, native agrees with eager to a few ULP of the largest magnitude
    met along the chain (cancellation turns an ULP into absolute error)."""
    prog, exact, seed, strided, tile_bytes = case
    xs = _inputs(prog, seed, strided)
    eager = prog.run_reference(xs)
    k, nat = run(prog, xs, tile_bytes=tile_bytes)
    assert k.backend == ("native" if dvm.native.unsupported(prog) is None else "tiled")  # broadcast outputs: tiled
    _, tiled = run(prog, xs, backend="tiled")
    rtol, atol = (0.0, 0.0) if exact else _tolerance(prog, xs)
    for a, b, c in zip(nat, tiled, eager):
        assert a.dtype == c.dtype and a.shape == c.shape
        torch.testing.assert_close(a, c, rtol=rtol, atol=atol, equal_nan=True)
        if exact:
            torch.testing.assert_close(b, c, rtol=0, atol=0, equal_nan=True)


@needs_ext
def test_jit_traces_once_per_function(monkeypatch):
    calls = []
    real = fx.trace
    monkeypatch.setattr(fx, "trace", lambda *a, **k: calls.append(1) or real(*a, **k))

    def f(x, b):
        return torch.tanh(x * 0.5 + b) * x

    j = dvm.jit(f)
    for m, n in ((4, 8), (17, 33), (64, 256), (1, 5)):
        x, b = torch.randn(m if m > 1 else 2, n), torch.randn(n)
        torch.testing.assert_close(j(x, b), f(x, b), rtol=1e-6, atol=1e-6)
    assert len(calls) == 1  # one trace for every shape with the same dtypes and broadcast pattern
    j(torch.randn(3, 4, dtype=torch.bfloat16), torch.randn(4, dtype=torch.bfloat16))
    j(torch.randn(3, 1), torch.randn(4))  # another broadcast pattern
    assert len(calls) == 3


def test_without_the_extension_everything_falls_back(tmp_path):
    """A process where the extension cannot be imported (as with no C compiler at install
    time) runs the torch backends and implementations, with the same results."""
    code = f"""
import json, sys, torch
sys.modules["megaloom.ops._native"] = None  # import fails
from megaloom.ops import dvm, native
from megaloom.ops.dvm.program import Program, instr
from megaloom.ops.mxfp8 import quantize_dual
assert not native.AVAILABLE and not native.enabled()
prog = Program((((32, 64), "float32"),), (instr("mul", [0], scalar=1.5), instr("add", [1, 0]), instr("neg", [2])), (3,))
x = torch.arange(32 * 64, dtype=torch.float32).reshape(32, 64) / 7
out = torch.empty(32, 64)
k = dvm.compile_program(prog)
k([x], [out])
r, c = quantize_dual(x * 3)
json.dump({{"backend": k.backend, "y": out.flatten().tolist(), "jit": dvm.jit(lambda t: -(t * 1.5 + t))(x).flatten().tolist(),
           "q": [t.view(torch.uint8).flatten().tolist() for t in (r.data, r.scales, c.data, c.scales)]}},
          open({str(tmp_path / "out.json")!r}, "w"))
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
    res = json.load(open(tmp_path / "out.json"))
    assert res["backend"] == "tiled"
    x = torch.arange(32 * 64, dtype=torch.float32).reshape(32, 64) / 7
    want = -(x * 1.5 + x)
    assert res["y"] == want.flatten().tolist() == res["jit"]
    from megaloom.ops.mxfp8 import quantize_dual

    r, c = quantize_dual(x * 3)
    assert res["q"] == [t.view(torch.uint8).flatten().tolist() for t in (r.data, r.scales, c.data, c.scales)]
