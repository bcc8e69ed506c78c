"""The tiled torch backend and the signature cache: fused kernel == program reference."""
from __future__ import annotations

import msgpack
import pytest
import torch

from megaloom.ops import dvm
from megaloom.ops.dvm import backend as B
from megaloom.ops.dvm.program import Program, instr
from megaloom.runtime.errors import ConfigError, GraphError

SILU = (instr("neg", [0]), instr("exp", [1]), instr("add", [2], scalar=1.0), instr("reciprocal", [3]), instr("mul", [0, 4]))


def silu(shape, dtype="float32") -> Program:
    return Program(((shape, dtype),), SILU, (5,))


def run(prog: Program, xs, opts: B.Options = B.Options(backend="tiled")):
    outs = [torch.full(s, -7, dtype=getattr(torch, d)) for s, d in prog.out_specs()]
    B.compile_program(prog, opts)(xs, outs)
    return outs


def test_signature_ignores_sizes_but_not_structure():
    a, b = silu((64, 32)), silu((8, 1024))
    assert a.signature == b.signature
    assert B.compile_program(a) is B.compile_program(b)
    assert silu((64, 32), "float16").signature != a.signature
    row = Program((((64, 32), "float32"), ((1, 32), "float32")), (instr("add", [0, 1]),), (2,))
    col = Program((((64, 32), "float32"), ((64, 1), "float32")), (instr("add", [0, 1]),), (2,))
    vec = Program((((64, 32), "float32"), ((32,), "float32")), (instr("add", [0, 1]),), (2,))
    assert len({row.signature, col.signature, vec.signature}) == 3
    other = Program((((64, 32), "float32"), ((1, 32), "float32")), (instr("add", [1, 0]),), (2,))
    assert other.signature != row.signature


def test_program_round_trips_through_msgpack():
    p = silu((4, 4))
    q = Program.from_attrs(msgpack.unpackb(msgpack.packb(p.to_attrs())))
    assert q.signature == p.signature and q.specs == p.specs


@pytest.mark.parametrize("bad,match", [
    ({"inputs": [[[2], "float32"]], "code": [["exp", [3], {}]], "outputs": [1]}, "undefined value"),
    ({"inputs": [[[2], "float32"]], "code": [], "outputs": []}, "at least one"),
    ({"inputs": [[[2], "float32"]], "code": [["exp", [0], {}]], "outputs": [0]}, "instruction results"),
    ({"inputs": 3}, "malformed"),
])
def test_malformed_programs_raise(bad, match):
    with pytest.raises(GraphError, match=match):
        Program.from_attrs(bad)


@pytest.mark.parametrize("shape,tile_bytes", [((64, 256), 4096), ((16, 8, 128), 2048), ((64, 32), None), ((), None)])
def test_tiled_is_bit_exact_when_tiles_are_whole_simd_vectors(shape, tile_bytes):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    prog = silu(shape)
    (got,) = run(prog, [x], B.Options(backend="tiled", tile_bytes=tile_bytes))
    assert torch.equal(got, prog.run_reference([x])[0])


@pytest.mark.parametrize("shape,tile_bytes", [((37, 19), 256), ((3, 1000), 512), ((1000,), 400), ((5, 7, 9), 200),
                                              ((2, 3, 4, 5), 64), ((1, 1), 8)])
def test_ragged_tiles_match_within_rounding(shape, tile_bytes):
    # a tile's ragged tail runs torch's scalar code, which may differ from SIMD by an ulp
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    prog = silu(shape)
    (got,) = run(prog, [x], B.Options(backend="tiled", tile_bytes=tile_bytes))
    torch.testing.assert_close(got, prog.run_reference([x])[0], rtol=4e-7, atol=1e-7)


def test_broadcast_rows_columns_and_invariant_outputs():
    g = torch.Generator().manual_seed(1)
    x, row, col = torch.randn(33, 20, generator=g), torch.randn(1, 20, generator=g), torch.randn(33, 1, generator=g)
    # v3 = exp(row) depends on the row only: computed once and also an output
    prog = Program((((33, 20), "float32"), ((1, 20), "float32"), ((33, 1), "float32")),
                   (instr("exp", [1]), instr("mul", [0, 3]), instr("sub", [4, 2]), instr("gt", [5], scalar=0.0),
                    instr("where", [6, 5], scalar=0.0, scalar_pos=2)), (3, 7, 5))
    for tb in (None, 160, 40):
        got = run(prog, [x, row, col], B.Options(backend="tiled", tile_bytes=tb))
        for a, b in zip(got, prog.run_reference([x, row, col])):
            assert a.shape == b.shape
            torch.testing.assert_close(a, b, rtol=4e-7, atol=1e-7)


def test_non_contiguous_inputs_and_outputs():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(40, 30, generator=g).t()  # (30, 40) transposed view
    prog = silu((30, 40))
    out_store = torch.zeros(40, 30)
    B.compile_program(prog, B.Options(backend="tiled", tile_bytes=300))([x], [out_store.t()])
    torch.testing.assert_close(out_store.t(), prog.run_reference([x])[0], rtol=0, atol=1e-6)


def test_empty_domains():
    prog = silu((0, 8))
    (got,) = run(prog, [torch.empty(0, 8)])
    assert got.shape == (0, 8)
    # exp(row) is (1, 4) and an output even though the domain (0, 4) is empty
    prog = Program((((0, 4), "float32"), ((1, 4), "float32")), (instr("exp", [1]), instr("add", [0, 2])), (2, 3))
    row = torch.randn(1, 4)
    e, s = run(prog, [torch.empty(0, 4), row])
    assert torch.equal(e, torch.exp(row)) and s.shape == (0, 4)


def test_threads_over_tiles_match():
    x = torch.randn(64, 50, generator=torch.Generator().manual_seed(3))
    prog = silu((64, 50))
    (got,) = run(prog, [x], B.Options(backend="tiled", tile_bytes=800, threads=2))
    torch.testing.assert_close(got, prog.run_reference([x])[0], rtol=4e-7, atol=1e-7)


def test_in_place_register_reuse_keeps_live_values():
    # v1 = exp(x) is read again after v2 and v3: its register must not be overwritten
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(4))
    prog = Program((((16, 8), "float32"),), (instr("exp", [0]), instr("neg", [1]), instr("tanh", [2]),
                                             instr("add", [3, 1]), instr("mul", [4, 4])), (5,))
    (got,) = run(prog, [x], B.Options(backend="tiled", tile_bytes=64))
    torch.testing.assert_close(got, prog.run_reference([x])[0], rtol=4e-7, atol=1e-7)


def test_options_are_checked():
    with pytest.raises(ConfigError, match="backend"):
        dvm.configure(backend="nope")
    with pytest.raises(ConfigError, match="unknown DVM option"):
        dvm.configure(tiles=3)
    with pytest.raises(ConfigError, match="threads"):
        dvm.configure(threads=0)
    assert dvm.options().backend == "native"


def test_l2_detection_and_size_parsing():
    assert dvm.l2_cache_bytes() >= 64 << 10
    assert B._parse_size("2048K") == 2 << 20 and B._parse_size("1 MiB") == 1 << 20 and B._parse_size("junk") is None
