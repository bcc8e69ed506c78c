"""MegaMHC's forward coefficients (pre, post, softmax mix and Sinkhorn) as one dvm.fused task per tile:
the same outputs as the mhc_coeff op and the golden reference, on both executors; simulated."""
import pytest
import torch

from megaloom.graphs import MHCSpec, build_megamhc, megamhc_reference
from megaloom.graphs.mhc.ops import coeff_ref, fused_coeff
from megaloom.ops import dvm
from megaloom.runtime import ReferenceExecutor, ThreadExecutor
from megaloom.runtime.errors import ConfigError
from megaloom.scheduler import Simulator
from tests.graphs.test_megamhc import NAMES, _inputs


def _run(spec, x, executor):
    feed = {k: v.detach() for k, v in zip(NAMES, x)}
    return executor.run(build_megamhc(spec, "fwd"), feed)


@pytest.mark.parametrize("n, iters", [(4, 20), (3, 0), (2, 5)])
def test_the_coefficient_program_matches_the_op_reference(n, iters):
    t, m = 13, n * (n + 2)
    g = torch.Generator().manual_seed(n)
    raw, inv = 3 * torch.randn(t, m, generator=g), torch.rand(t, 1, generator=g) + 0.5
    alpha, bias = torch.randn(3, generator=g), torch.randn(m, generator=g)
    prog = dvm.library.mhc_coeff(t, n, iters)
    ins, _ = fused_coeff([raw, inv, alpha, bias], [torch.empty(t, n)] * 2 + [torch.empty(t, n, n)])
    outs = [torch.empty(t, 1) for _ in range(m)]
    dvm.compile_program(prog)(ins, outs)  # the native kernel (or the tiled one without the extension)
    unfused = prog.run_reference(ins)
    pre, post, mix = coeff_ref(raw, inv, alpha, bias, n, iters)
    want = [pre[:, i:i + 1] for i in range(n)] + [post[:, i:i + 1] for i in range(n)] + \
        [mix[:, i, j:j + 1] for i in range(n) for j in range(n)]
    for got, chain, w in zip(outs, unfused, want):
        torch.testing.assert_close(got, chain, rtol=2e-6, atol=1e-7)  # transcendentals within an ulp or two
        torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-6)  # sum orders of the softmax and Sinkhorn


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_and_unfused_forward_graphs_agree(dtype):
    x = _inputs(37, 12, dtype=dtype)
    ref = megamhc_reference(*x, iters=20)
    runs = {}
    for fuse in (True, False):
        spec = MHCSpec(tokens=37, hidden=12, tile_tokens=8, dtype=str(dtype).removeprefix("torch."), fuse_vector=fuse)
        g = build_megamhc(spec, "fwd")
        assert {t.op for t in g.tasks if t.tags["stage"] == "coeff"} == ({"dvm.fused"} if fuse else {"mhc_coeff"})
        runs[fuse] = _run(spec, x, ThreadExecutor({"cube": 2, "vector": 2}))
        torch.testing.assert_close(_run(spec, x, ReferenceExecutor()).outputs, runs[fuse].outputs)
    for name, r in zip(("new_res", "block_in", "next_pre", "next_post", "next_res"), ref):
        torch.testing.assert_close(runs[True][name], runs[False][name], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(runs[True][name], r.detach(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                                   atol=1e-2 if dtype == torch.bfloat16 else 1e-5)


def test_float64_keeps_the_op_and_the_option_is_checked():
    g = build_megamhc(MHCSpec(tokens=8, hidden=4, tile_tokens=4, dtype="float64"), "fwd")
    assert "dvm.fused" not in {t.op for t in g.tasks}
    with pytest.raises(ConfigError, match="fuse_vector must be a bool"):
        MHCSpec(tokens=8, hidden=4, fuse_vector=1)


def test_the_fused_coefficients_simulate_as_one_task_per_tile_moving_the_ops_bytes():
    moved = {}
    for fuse in (True, False):
        spec = MHCSpec(tokens=512, hidden=256, tile_tokens=64, fuse_vector=fuse)
        trace = Simulator("ascend-910b").run(build_megamhc(spec, "fwd")).trace
        coeff = [e for e in trace.events if e.tags.get("stage") == "coeff"]
        assert len(coeff) == 8 and {e.op for e in coeff} == {"dvm.fused" if fuse else "mhc_coeff"}
        moved[fuse] = sum(e.bytes for e in coeff)
    assert moved[True] == moved[False]  # inputs and outputs once; the mix's rounds never reach memory
