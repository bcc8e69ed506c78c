"""The compiled MXFP8 kernels against the torch implementation (the oracle): every E4M3
code, every E8M0 scale, every bfloat16 value, all axes, dual, grouped, strided tiles."""
import pytest
import torch

from megaloom.ops import native
from megaloom.ops.mxfp8 import dequantize, quantize, quantize_dual, quantize_grouped
from megaloom.ops.mxfp8 import kernels
from megaloom.ops.mxfp8.format import empty_quantized
from megaloom.runtime import ReferenceExecutor, TaskGraph, ThreadExecutor
from megaloom.runtime.errors import GraphError

from .test_format import special_rows

pytestmark = pytest.mark.skipif(not native.AVAILABLE, reason="the compiled kernels are not built")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def both(fn, *args):
    """``fn(*args)`` through the kernels and through torch, as uint8 views."""
    got = fn(*args)
    with native.disabled():
        want = fn(*args)
    flat = lambda r: [t.view(torch.uint8) if t.dtype.itemsize == 1 else t for q in r for t in q[:2]]  # noqa: E731
    return flat(got if isinstance(got, tuple) and isinstance(got[0], tuple) else [got]), \
        flat(want if isinstance(want, tuple) and isinstance(want[0], tuple) else [want])


def assert_same(fn, *args):
    got, want = both(fn, *args)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and torch.equal(g, w)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["floor", "rceil"])
def test_special_blocks_rows_cols_dual(dtype, mode):
    x = special_rows(dtype)
    x = torch.cat([x, torch.zeros(-x.shape[0] % 32, 64, dtype=dtype)])
    for axis in ("rows", "cols"):
        assert_same(quantize, x, axis, mode)
        assert_same(quantize, x.t().contiguous(), axis, mode)
    assert_same(quantize_dual, x, mode)


@pytest.mark.parametrize("mode", ["floor", "rceil"])
def test_every_bfloat16_value_under_every_scale_band(mode):
    """All 65536 bfloat16 bit patterns, each block led by a value that sets its scale."""
    v = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(-1, 32)
    for lead in (1.0, 3.0e-38, 2.0 ** 100, 448.0, 65504.0):
        x = v.clone()
        x[:, 0] = lead
        assert_same(quantize, x, "rows", mode)
        assert_same(quantize, x.reshape(-1, 64).t().contiguous(), "cols", mode)


@pytest.mark.parametrize("dtype", DTYPES)
def test_random_magnitudes_and_float16_input(dtype):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(96, 160, generator=g) * 2.0 ** torch.randint(-20, 20, (96, 1), generator=g).float()).to(dtype)
    for mode in ("floor", "rceil"):
        assert_same(quantize_dual, x, mode)


def test_every_code_dequantises_under_every_scale():
    data = torch.arange(256, dtype=torch.uint8).repeat(256, 1).view(torch.float8_e4m3fn)  # 256 x 256
    for axis, scales in (("rows", torch.arange(256, dtype=torch.uint8).repeat_interleave(8).reshape(256, 8)),
                         ("cols", torch.arange(256, dtype=torch.uint8)[:8].repeat(256, 1).t().contiguous())):
        s = scales.view(torch.float8_e8m0fnu)
        for dt in DTYPES:
            got = dequantize(data, s, axis, dt)
            with native.disabled():
                want = dequantize(data, s, axis, dt)
            assert torch.equal(got.isnan(), want.isnan())
            assert torch.equal(got.nan_to_num(), want.nan_to_num())
            assert torch.equal(got.signbit() & ~got.isnan(), want.signbit() & ~want.isnan())  # signed zeros


@pytest.mark.parametrize("sizes", [[40, 40, 72, 128], [0, 31, 0, 33, 1], [64], [5, 0]])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grouped_matches_padding_then_quantising(sizes, dtype):
    offsets = torch.tensor(sizes).cumsum(0).tolist()
    x = (torch.randn(offsets[-1], 96, generator=torch.Generator().manual_seed(1)) * 5).to(dtype)
    x[0:1, 3] = float("nan") if offsets[-1] else 0.0
    for axis in ("cols", "rows"):
        assert_same(quantize_grouped, x, offsets, axis, "floor")


def test_strided_tiles_and_three_d_inputs():
    x = torch.randn(2, 64, 96, dtype=torch.bfloat16)
    for axis in ("rows", "cols"):
        assert_same(quantize, x, axis, "floor")
    big = torch.randn(128, 160)
    tile = big[32:96, 32:128]  # row stride 160, a view
    r, c = empty_quantized((128, 160), "rows"), empty_quantized((128, 160), "cols")
    assert kernels.quantize_into(tile, (r.data[32:96, 32:128], r.scales[32:96, 1:4]),
                                 (c.data[32:96, 32:128], c.scales[1:3, 32:128]), "floor")
    with native.disabled():
        wr, wc = quantize_dual(tile.contiguous())
    assert torch.equal(r.data[32:96, 32:128].view(torch.uint8), wr.data.view(torch.uint8))
    assert torch.equal(r.scales[32:96, 1:4].view(torch.uint8), wr.scales.view(torch.uint8))
    assert torch.equal(c.data[32:96, 32:128].view(torch.uint8), wc.data.view(torch.uint8))
    assert torch.equal(c.scales[1:3, 32:128].view(torch.uint8), wc.scales.view(torch.uint8))
    column_major = torch.empty(96, 64, dtype=torch.float8_e4m3fn).t()
    assert not kernels.quantize_into(tile, (column_major, r.scales[32:96, 1:4]), None, "floor")  # not taken
    with pytest.raises(GraphError, match="do not fit"):
        kernels.quantize_into(tile, (r.data, r.scales), None, "floor")


def test_every_instruction_set_gives_the_same_bits():
    x = torch.randn(64, 256, dtype=torch.bfloat16) * 100
    old = native.ext.isa()
    try:
        results = []
        for isa in native.ext.isas():
            native.ext.set_isa(isa)
            r, c = quantize_dual(x)
            results.append([t.view(torch.uint8) for t in (r.data, r.scales, c.data, c.scales)])
    finally:
        native.ext.set_isa(old)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


def test_tile_kernels_write_task_tiles_in_place():
    """Quantisation tasks over 32-row tiles of one buffer, on the thread executor's kernels,
    equal the reference executor's whole-tensor results."""
    g = TaskGraph("mx_tiles")
    x = g.input("x", (128, 96), "bfloat16")
    outs = [g.output(n, s, d) for n, s, d in (("rd", (128, 96), "float8_e4m3fn"), ("rs", (128, 3), "float8_e8m0fnu"),
                                               ("cd", (128, 96), "float8_e4m3fn"), ("cs", (4, 96), "float8_e8m0fnu"))]
    y = g.output("y", (128, 96), "float32")
    for i in range(0, 128, 32):
        g.task("mx_quantize_dual", [x[i:i + 32]], [outs[0][i:i + 32], outs[1][i:i + 32], outs[2][i:i + 32],
                                                  outs[3][i // 32:i // 32 + 1]])
        g.task("mx_dequantize", [outs[0][i:i + 32], outs[1][i:i + 32]], [y[i:i + 32]], attrs={"axis": "rows"})
    feed = {"x": torch.randn(128, 96, dtype=torch.bfloat16)}
    got = ThreadExecutor().run(g, feed).outputs
    want = ReferenceExecutor().run(g, feed).outputs
    for k in want:
        a, b = got[k], want[k]
        assert torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 else a,
                           b.view(torch.uint8) if b.dtype.itemsize == 1 else b), k
