"""MegaMoE with MXFP8 expert GEMMs: against the eager MXFP8 grouped linears, against high precision,
what it saves for backward, and simulated on a chip with an MXFP8 cube rate."""
import pytest
import torch

from megaloom.graphs import MEGAMOE, MegaMoE, moe_reference
from megaloom.graphs.moe import MegaMoESpec, megamoe
from megaloom.runtime.errors import ConfigError
from megaloom.runtime.testing import rel_l2
from megaloom.scheduler import Simulator, load_profile


def _problem(dtype, t=50):
    torch.manual_seed(0)
    moe = MegaMoE(64, 32, 4, 2, dtype=dtype, tile_m=16, cube_split=2, wgrad_split=2)
    x = torch.randn(t, 64).to(dtype)
    ids = torch.stack([torch.randperm(3)[:2] for _ in range(t)])  # expert 3 idle
    w = torch.rand(t, 2).to(dtype)
    return moe, x, ids, w, torch.randn(t, 64).to(dtype)


def _run(fn, moe, x, w, g):
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, moe.gate_up, moe.down)]
    y = fn(*leaves)
    y.backward(g)
    return [y.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("scale_mode", ["floor", "rceil"])
def test_mxfp8_graphs_match_the_eager_mxfp8_block(dtype, tol, scale_mode):
    moe, x, ids, w, g = _problem(dtype)
    got = _run(lambda *a: megamoe(moe.runner, a[0], ids, a[1], a[2], a[3], scale_mode), moe, x, w, g)
    want = _run(lambda *a: moe_reference(a[0], ids, a[1], a[2], a[3], mx=scale_mode), moe, x, w, g)
    high = _run(lambda *a: moe_reference(a[0], ids, a[1], a[2], a[3]), moe, x, w, g)
    for name, a, b, h in zip(("out", "x", "w", "gate_up", "down"), got, want, high):
        assert rel_l2(a, b) <= tol, name  # the same quantised operands: rounding order only (bf16: 1.2e-2)
        assert 0.01 < rel_l2(a, h) < 0.12, name  # MXFP8 really ran; within the two-GEMM bound
    assert torch.count_nonzero(got[3][3]) == 0 and torch.count_nonzero(got[4][3]) == 0  # idle expert


def test_backward_keeps_fp8_activations_only():
    moe, x, ids, w, g = _problem(torch.bfloat16, t=256)
    saved = {}
    for mx in (None, "floor"):
        kept = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
            y = megamoe(moe.runner, x.requires_grad_(), ids, w, moe.gate_up, moe.down, mx)
        y.sum().backward()
        saved[mx] = {t.dtype: 0 for t in kept}
        for t in kept:
            if t.dim() == 2 and t.shape[0] >= 256 and t.dtype != torch.int64:  # per-row activations
                saved[mx][t.dtype] += t.numel() * t.element_size()
    fp8 = saved["floor"][torch.float8_e4m3fn] + saved["floor"][torch.float8_e8m0fnu]
    # xr [R, 64] and a [R, 32] as FP8 payload + scales (each expert padded to 32 rows) instead of bf16
    assert torch.bfloat16 in saved[None] and fp8 < 0.6 * (512 * (64 + 32) * 2)
    assert saved["floor"][torch.bfloat16] < saved[None][torch.bfloat16]


def test_spec_checks_mxfp8_dims():
    with pytest.raises(ConfigError, match="precision mxfp8 needs intermediate to be a multiple of 32, got 24"):
        MegaMoESpec(8, 64, 24, 4, 2, precision="mxfp8")
    with pytest.raises(ConfigError, match="precision must be one of"):
        MegaMoESpec(8, 64, 32, 4, 2, precision="fp4")


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_simulated_mxfp8_uses_the_mxfp8_cube_rate(direction):
    base = dict(tokens=1024, hidden=1024, intermediate=1024, experts=4, top_k=2, tile_m=512, dtype="bfloat16",
                direction=direction)
    spans = {p: Simulator("ascend-950", policy="priority").run(MEGAMOE.from_options({**base, "precision": p})).trace
             for p in ("none", "mxfp8")}
    mm = [e for e in spans["mxfp8"].events if e.op == "mx_grouped_matmul"]
    assert mm and not [e for e in spans["mxfp8"].events if e.op in ("moe_gmm", "moe_wgrad")]
    assert len(mm) == len([e for e in spans["none"].events if e.op in ("moe_gmm", "moe_wgrad")])
    prof = load_profile("ascend-950")
    rate, bw = prof.unit_peak("cube", "mxfp8"), prof.unit_mem_bw("cube")
    assert rate == 2 * prof.unit_peak("cube", "bf16")  # the profile: 1 PFLOPS MXFP8, half of it bf16
    for e in mm:  # one cube unit's roofline at the MXFP8 rate
        assert e.end - e.start == pytest.approx(max(e.flops / rate, e.bytes / bw) + prof.task_overhead, rel=1e-9)
    assert sum(e.flops / rate > e.bytes / bw for e in mm) >= len(mm) // 2  # most are compute-bound: the rate counts
