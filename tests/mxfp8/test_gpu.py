"""CUDA paths (skipped without a GPU): quantisation matches the CPU bit for bit; matmuls match
emulation, natively where the device has MX block-scaled GEMMs (sm100+)."""
import pytest
import torch

from megaloom.ops.mxfp8 import MXFP8Linear, mx_matmul, native_available, quantize

pytestmark = pytest.mark.gpu


def test_cuda_quantize_matches_cpu():
    x = torch.randn(128, 256, dtype=torch.bfloat16) * 100
    for axis in ("rows", "cols"):
        for mode in ("floor", "rceil"):
            c, g = quantize(x, axis, mode), quantize(x.cuda(), axis, mode)
            assert torch.equal(c.data.view(torch.uint8), g.data.cpu().view(torch.uint8))
            assert torch.equal(c.scales.view(torch.uint8), g.scales.cpu().view(torch.uint8))


@pytest.mark.parametrize("layout", ["NT", "NN", "TN"])
def test_cuda_matmul_matches_emulation(layout):
    m, k, n = 256, 128, 192
    a = torch.randn(k, m, device="cuda") if layout[0] == "T" else torch.randn(m, k, device="cuda")
    b = torch.randn(k, n, device="cuda") if layout[1] == "N" else torch.randn(n, k, device="cuda")
    qa = quantize(a, "cols" if layout[0] == "T" else "rows")
    qb = quantize(b, "cols" if layout[1] == "N" else "rows")
    want = mx_matmul(qa, qb, layout, torch.float32, native=False)
    got = mx_matmul(qa, qb, layout, torch.float32)  # native on sm100+, else the same emulation
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-2 if native_available(a.device) else 0)


def test_cuda_linear_backward_runs():
    lin = MXFP8Linear(128, 64).cuda().bfloat16()
    x = torch.randn(50, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    lin(x).sum().backward()
    assert x.grad.shape == x.shape and torch.isfinite(lin.weight.grad).all()
