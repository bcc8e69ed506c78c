"""Random fused chains (hypothesis): tiled torch kernel == unfused evaluation, every dtype,
broadcast rows/columns, non-contiguous inputs, empty domains, any tile size."""
from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megaloom.ops.dvm import backend as B
from megaloom.ops.dvm.program import Program, instr

FLOAT_UNARY = ["neg", "abs", "relu", "exp", "tanh", "sigmoid", "erf", "reciprocal"]
FLOAT_BINARY = ["add", "sub", "mul", "div", "maximum", "minimum"]
INT_UNARY = ["neg", "abs", "relu"]
INT_BINARY = ["add", "sub", "mul", "maximum", "minimum"]
DTYPES = ["float32", "float64", "float16", "bfloat16", "int32"]


@st.composite
def chains(draw):
    dtype = draw(st.sampled_from(DTYPES))
    is_int = dtype == "int32"
    rank = draw(st.integers(1, 3))
    domain = tuple(draw(st.integers(0 if draw(st.integers(0, 9)) == 0 else 1, 9)) for _ in range(rank))
    shapes = [domain]
    for _ in range(draw(st.integers(0, 2))):
        pat = draw(st.lists(st.sampled_from("fb"), min_size=rank, max_size=rank))
        shape = tuple(d if c == "f" else 1 for c, d in zip(pat, domain))
        shapes.append(shape[draw(st.integers(0, rank - 1)):])  # drop some leading dims
    code = []
    data = list(range(len(shapes)))  # values of ``dtype`` (comparison results are bool)
    n = len(shapes)
    for _ in range(draw(st.integers(1, 8))):
        kind = draw(st.sampled_from(["unary", "binary", "scalar", "where"]))
        a = draw(st.sampled_from(data))
        if kind == "unary":
            code.append(instr(draw(st.sampled_from(INT_UNARY if is_int else FLOAT_UNARY)), [a]))
        elif kind == "binary":
            code.append(instr(draw(st.sampled_from(INT_BINARY if is_int else FLOAT_BINARY)), [a, draw(st.sampled_from(data))]))
        elif kind == "scalar":
            s = draw(st.integers(-3, 3)) if is_int else draw(st.sampled_from([0.5, -1.25, 2.0, 0.044715]))
            code.append(instr(draw(st.sampled_from(INT_BINARY if is_int else FLOAT_BINARY)), [a], scalar=s,
                              scalar_pos=draw(st.integers(0, 1))))
        else:
            code.append(instr("gt", [a], scalar=0))
            n += 1
            code.append(instr("where", [n - 1, a, draw(st.sampled_from(data))]))
        n += 1
        data.append(n - 1)
    if not is_int and draw(st.booleans()):
        code.append(instr("cast", [n - 1], dtype="float32" if dtype != "float32" else "bfloat16"))
        n += 1
    outs = sorted(set([n - 1] + draw(st.lists(st.integers(len(shapes), n - 1), max_size=2))))
    prog = Program(tuple((s, dtype) for s in shapes), tuple(code), tuple(outs))
    return prog, draw(st.integers(0, 2**31)), draw(st.booleans()), draw(st.sampled_from([None, 8, 48, 200]))


def _inputs(prog: Program, seed: int, strided: bool) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    xs = []
    for shape, dt in prog.inputs:
        big = tuple(2 * d if strided else d for d in shape)
        x = torch.randn(big, generator=g) * 2
        x = x.to(torch.int32) if dt == "int32" else x.to(getattr(torch, dt))
        if strided:  # every other element along every dim: non-contiguous
            x = x[tuple(slice(None, None, 2) for _ in shape)]
        xs.append(x)
    return xs


def _tolerance(prog: Program, xs: list[torch.Tensor]) -> tuple[float, float]:
    """A few ulps of the largest finite magnitude met along the chain (cancellation keeps
    absolute, not relative, error)."""
    eps = max((torch.finfo(getattr(torch, d)).eps for _, d in prog.specs if d in FLOAT_DTYPES), default=0.0)
    n_in = len(prog.inputs)
    env = list(xs)
    for k in range(len(prog.code)):  # every intermediate: rebuild the prefix program's last value
        sub = Program(prog.inputs, prog.code[:k + 1], (n_in + k,))
        env.append(sub.run_reference(xs)[0])
    big = max((float(v[torch.isfinite(v)].abs().max()) for v in env
               if v.dtype.is_floating_point and torch.isfinite(v).any()), default=1.0)
    return 16 * eps, 16 * eps * max(big, 1.0)


FLOAT_DTYPES = ("float32", "float64", "float16", "bfloat16")


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(chains())
def test_fused_equals_unfused(case):
    """One tile (no tile_bytes: these domains are small): the very same torch calls, so
    bit-exact. Many tiles: torch runs a loop's ragged tail with scalar code, which may
    differ from its SIMD body by an ulp on transcendental ops, so a few ulps."""
    prog, seed, strided, tile_bytes = case
    xs = _inputs(prog, seed, strided)
    want = prog.run_reference(xs)
    outs = [torch.empty(s, dtype=getattr(torch, d)) for s, d in prog.out_specs()]
    B.compile_program(prog, B.Options(backend="tiled", tile_bytes=tile_bytes))(xs, outs)
    rtol, atol = (0.0, 0.0) if tile_bytes is None else _tolerance(prog, xs)
    for got, w in zip(outs, want):
        assert got.shape == w.shape and got.dtype == w.dtype
        torch.testing.assert_close(got, w, rtol=rtol, atol=atol, equal_nan=True)
