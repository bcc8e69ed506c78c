"""Bit-exact MXFP8 quantisation against the float64 spec implementation in ``spec.py``,
through the compiled kernels and through the torch implementation."""
import math

import pytest
import torch

from megaloom.ops import native
from megaloom.ops.mxfp8 import dequantize, quantize, quantize_dual
from megaloom.runtime.errors import GraphError

from .spec import e4m3_value, quantize_ref

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True, params=["native", "torch"])
def impl(request):
    """Every test runs on the compiled kernels and on the torch implementation."""
    if request.param == "native":
        if not native.AVAILABLE:
            pytest.skip("the compiled kernels are not built")
        yield request.param
    else:
        with native.disabled():
            yield request.param


def special_rows(dtype: torch.dtype) -> torch.Tensor:
    """64-wide rows (two 32-blocks each) of random, tiny, huge, subnormal, zero, NaN/Inf and boundary blocks."""
    fi = torch.finfo(dtype)
    g = torch.Generator().manual_seed(1)
    rows = []
    lo, hi = math.log2(fi.tiny) - 8, math.log2(fi.max)
    for k in torch.linspace(lo, hi, 24).tolist():  # random blocks over the whole range
        rows.append(torch.randn(64, generator=g, dtype=torch.float64) * 2.0 ** k)
    rows.append(torch.rand(64, generator=g, dtype=torch.float64) * fi.tiny)  # subnormals of the input dtype
    rows.append(torch.cat([torch.full((1,), fi.max, dtype=torch.float64), torch.randn(63, generator=g, dtype=torch.float64)]))
    rows.append(torch.zeros(64, dtype=torch.float64))
    rows.append(torch.tensor([-0.0, 0.0] * 32, dtype=torch.float64))
    for bad in (math.nan, math.inf, -math.inf):
        r = torch.randn(64, generator=g, dtype=torch.float64)
        r[5] = bad
        rows.append(r)
    for k in (-4, 0, 3):  # +-448 boundaries, the floor-mode saturation band, ties between grid points
        s = 2.0 ** k
        rows.append(torch.tensor([448 * s, -448 * s, 464 * s, 447 * s] + [1.0 * s] * 60, dtype=torch.float64))
        rows.append(torch.tensor([1.75 * 256 * s, 1.9 * 256 * s, -1.99 * 256 * s] + [s] * 61, dtype=torch.float64))
        ties = [(1 + (2 * m + 1) / 16) * 2.0 ** j * s for j in range(-9, 9) for m in range(4)][:63]
        rows.append(torch.tensor([256 * s] + [t if i % 2 else -t for i, t in enumerate(ties)], dtype=torch.float64))
        rows.append(torch.tensor([447.9 * s] + [448.1 * s] * 31 + [2.0 ** -9 * 0.5 * s] * 32, dtype=torch.float64))
    return torch.stack(rows).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["floor", "rceil"])
@pytest.mark.parametrize("axis", ["rows", "cols"])
def test_quantize_bit_exact(dtype, mode, axis):
    x = special_rows(dtype)
    x = torch.cat([x, torch.zeros(-x.shape[0] % 32, 64, dtype=dtype)])  # rows multiple of 32 for cols
    if axis == "cols":
        x = x.t().contiguous()
    q = quantize(x, axis, mode)
    want_d, want_s = quantize_ref(x, axis, mode)
    assert q.data.dtype == torch.float8_e4m3fn and q.scales.dtype == torch.float8_e8m0fnu
    assert torch.equal(q.scales.view(torch.uint8), want_s)
    assert torch.equal(q.data.view(torch.uint8), want_d)


@pytest.mark.parametrize("mode", ["floor", "rceil"])
def test_dual_equals_two_singles(mode):
    x = torch.randn(64, 96, dtype=torch.bfloat16) * 3
    x[3, 7] = float("nan")
    r, c = quantize_dual(x, mode)
    for got, axis in ((r, "rows"), (c, "cols")):
        want = quantize(x, axis, mode)
        assert got.axis == axis
        assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
        assert torch.equal(got.scales.view(torch.uint8), want.scales.view(torch.uint8))


def test_all_e4m3_codes_round_trip():
    codes = torch.arange(256, dtype=torch.uint8)
    decoded = codes.view(torch.float8_e4m3fn).double()
    spec = torch.tensor([e4m3_value(c) for c in range(256)], dtype=torch.float64)
    assert torch.equal(decoded.isnan(), spec.isnan())
    assert torch.equal(decoded.nan_to_num(), spec.nan_to_num())
    # a block [256, v, 0...] has shared exponent 0, so every finite code must come back unchanged
    finite = [c for c in range(256) if not math.isnan(e4m3_value(c))]
    x = torch.zeros(len(finite), 32)
    x[:, 0] = 256
    x[:, 1] = torch.tensor([e4m3_value(c) for c in finite])
    q = quantize(x)
    assert torch.equal(q.scales.view(torch.uint8), torch.full((len(finite), 1), 127, dtype=torch.uint8))
    assert q.data.view(torch.uint8)[:, 1].tolist() == finite


def test_all_e8m0_scales():
    codes = torch.arange(256, dtype=torch.uint8)
    scales = codes.view(torch.float8_e8m0fnu).reshape(256, 1)
    data = torch.tensor([e4m3_value(c) for c in range(32)], dtype=torch.float32).to(torch.float8_e4m3fn)
    y = dequantize(data.expand(256, 32).contiguous(), scales)
    want = torch.tensor([[e4m3_value(c) * 2.0 ** (s - 127) for c in range(32)] for s in range(255)], dtype=torch.float64)
    assert torch.equal(y[:255].double(), want)
    assert y[255].isnan().all()
    # every scale an fp32 input can reach comes out of a block whose amax is 2**(e + 8)
    e = torch.arange(-127, 120)
    x = torch.zeros(len(e), 32, dtype=torch.float64)
    x[:, 0] = 2.0 ** (e.double() + 8)
    q = quantize(x.float(), "rows", "floor")
    assert q.scales.view(torch.uint8).flatten().tolist() == (e + 127).tolist()


def test_nan_block_decodes_to_nan_and_zero_block_to_zero():
    x = torch.zeros(2, 64)
    x[0, 40] = float("inf")
    y = dequantize(*quantize(x)[:2])
    assert y[0, 32:].isnan().all() and (y[0, :32] == 0).all() and (y[1] == 0).all()
    assert quantize(x).scales.view(torch.uint8).tolist() == [[0, 255], [0, 0]]


def test_dequantize_error_bound():
    x = torch.randn(64, 128)
    for mode, bound in (("rceil", 2 ** -4), ("floor", 2 ** -4)):
        q = quantize(x, "rows", mode)
        err = (dequantize(q.data, q.scales) - x).abs()
        amax = x.abs().reshape(64, 4, 32).amax(-1, keepdim=True).expand(64, 4, 32).reshape(64, 128)
        if mode == "rceil":  # no saturation: relative error <= half an ulp of E4M3 (2**-4)
            assert (err <= bound * x.abs() + 2.0 ** -9 * amax / 448 * 2).all()
        else:  # floor may saturate the top of the binade
            assert (err <= 0.25 * amax).all()


def test_bad_inputs_name_the_problem():
    with pytest.raises(GraphError, match="multiple of 32"):
        quantize(torch.randn(4, 33))
    with pytest.raises(GraphError, match="multiple of 32"):
        quantize(torch.randn(33, 32), "cols")
    with pytest.raises(GraphError, match="scale_mode"):
        quantize(torch.randn(4, 32), "rows", "round")
    with pytest.raises(GraphError, match="axis"):
        quantize(torch.randn(4, 32), "diag")
    with pytest.raises(GraphError, match="float32/bfloat16/float16"):
        quantize(torch.randn(4, 32).double())
