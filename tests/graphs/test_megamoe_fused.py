"""MegaMoE's SwiGLU as dvm.fused tiles: the same outputs as the unfused ops and the golden block, on both
executors, in fp32, bf16 and with MXFP8 expert GEMMs."""
import pytest
import torch

from megaloom.graphs.moe import MegaMoE, build_backward, build_forward, megamoe, moe_reference, synthetic_counts
from megaloom.graphs.moe.ep import problem
from megaloom.runtime import ReferenceExecutor, ThreadExecutor
from megaloom.runtime.errors import ConfigError
from megaloom.runtime.testing import rel_l2
from tests.graphs.test_megamoe_graph import SHAPE, TOL, golden, run_both, spec_of


def _ops(g, stage):
    return {t.op for t in g.tasks if t.tags.get("stage") == stage}


def test_swiglu_stages_are_fused_nodes_unless_turned_off():
    for fuse in (True, False):
        spec = spec_of(fuse_vector=fuse)
        counts = synthetic_counts(spec, "skewed", seed=2)  # uneven tiles: several tile shapes
        fwd, bwd = build_forward(spec, counts), build_backward(spec, counts)
        assert _ops(fwd, "swiglu") == ({"dvm.fused"} if fuse else {"swiglu"})
        assert _ops(bwd, "swiglu_grad") == ({"dvm.fused"} if fuse else {"swiglu_grad"})
        n_tiles = sum(1 for t in fwd.tasks if t.tags.get("stage") == "swiglu")
        assert n_tiles == sum(1 for t in bwd.tasks if t.tags.get("stage") == "swiglu_grad") > 0
    with pytest.raises(ConfigError, match="fuse_vector must be a bool"):
        spec_of(fuse_vector="yes")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_and_unfused_graphs_agree_with_each_other_and_the_golden_block(dtype):
    p = problem(1, **SHAPE, dtype=dtype, seed=5, idle=1)
    want = golden(p)
    runs = {(fuse, name): run_both(spec_of(dtype=dtype, fuse_vector=fuse, cube_split=2), p, ex)
            for fuse in (True, False) for name, ex in (("ref", ReferenceExecutor()),
                                                     ("thread", ThreadExecutor({"cube": 2, "vector": 2})))}
    for k, v in want.items():
        for run in runs.values():
            assert rel_l2(run[k], v) <= TOL[dtype], k
        fused, unfused = runs[True, "thread"][k], runs[False, "thread"][k]
        torch.testing.assert_close(runs[True, "ref"][k], fused)  # the executors agree on the fused graph
        if dtype == "float32":  # x * sigmoid(x) vs torch's silu: a few ulp, carried through the GEMMs
            torch.testing.assert_close(fused, unfused, rtol=1e-5, atol=1e-6)
        else:  # bf16: each fused instruction rounds to bf16, as the eager chain of primitives would
            assert rel_l2(fused, unfused) <= TOL[dtype], k


def test_mxfp8_expert_gemms_with_the_fused_swiglu():
    torch.manual_seed(0)
    t = 48
    x, gout = torch.randn(t, 64), torch.randn(t, 64)
    ids = torch.stack([torch.randperm(4)[:2] for _ in range(t)])
    w = torch.rand(t, 2)
    got = {}
    for fuse in (True, False):
        torch.manual_seed(1)
        moe = MegaMoE(64, 32, 4, 2, tile_m=16, fuse_vector=fuse)
        leaves = [v.detach().clone().requires_grad_() for v in (x, w, moe.gate_up, moe.down)]
        y = megamoe(moe.runner, leaves[0], ids, leaves[1], leaves[2], leaves[3], "floor")
        y.backward(gout)
        got[fuse] = [y.detach()] + [v.grad for v in leaves]
        spec = moe.runner.spec_for(t, torch.float32, "floor")
        assert spec.mxfp8 and _ops(build_forward(spec, synthetic_counts(spec)), "swiglu") == (
            {"dvm.fused"} if fuse else {"swiglu"})
        ref = [v.detach().clone().requires_grad_() for v in (x, w, moe.gate_up, moe.down)]
        out = moe_reference(ref[0], ids, ref[1], ref[2], ref[3], mx="floor")
        out.backward(gout)
        for a, b in zip(got[fuse], [out.detach()] + [v.grad for v in ref]):
            assert rel_l2(a, b) <= 1e-5
    for a, b in zip(got[True], got[False]):
        assert rel_l2(a, b) <= 1e-5
