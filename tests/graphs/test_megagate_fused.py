"""MegaGate's sigmoid scoring as a dvm.fused task ahead of the selection (``fuse_vector``): the golden
router's results on both executors; only sigmoid scores take it."""
import pytest
import torch

from megaloom.graphs import GateSpec, build_megagate, run_megagate
from megaloom.graphs.common import GraphRunner
from megaloom.runtime.errors import ConfigError
from megaloom.runtime.testing import rel_l2
from megaloom.scheduler import Simulator
from tests.graphs.test_megagate import EXECUTORS, TOL, _golden


@pytest.mark.parametrize("executor", sorted(EXECUTORS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_sigmoid_scoring_matches_golden(executor, dtype):
    T, H, E, k = 45, 24, 12, 3
    opts = {"top_k": k, "score": "sigmoid", "scale": 2.5, "renorm": True, "n_group": 3, "topk_group": 2}
    x, w, bias = torch.randn(T, H).to(dtype), (0.3 * torch.randn(E, H)).to(dtype), 0.1 * torch.randn(E)
    g_w, g_l = torch.randn(T, k), torch.randn(T, E)
    logits, weights, idx, gx, gw = _golden(x, w, bias, g_w, g_l, **opts)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = run_megagate(xr, wr, bias, tile_tokens=16, runner=GraphRunner(EXECUTORS[executor]()), fuse_vector=True,
                       **opts)
    ((out.weights * g_w).sum() + (out.logits * g_l).sum()).backward()
    assert torch.equal(out.indices, idx)
    for name, got, want in [("logits", out.logits, logits), ("weights", out.weights, weights),
                            ("grad_x", xr.grad, gx), ("grad_w", wr.grad, gw)]:
        assert rel_l2(got, want) <= TOL[dtype], name


def test_graph_takes_the_fused_scoring_for_sigmoid_only():
    for score, fuse, want in (("sigmoid", True, {"proj", "dvm.fused", "gate_topk"}),
                              ("sigmoid", False, {"proj", "gate_topk"}), ("softmax", True, {"proj", "gate_topk"})):
        g = build_megagate(GateSpec(tokens=40, hidden=8, experts=8, top_k=2, score=score, tile_tokens=16,
                                    fuse_vector=fuse), "fwd").validate()
        assert {t.op for t in g.tasks} == want
    with pytest.raises(ConfigError, match="fuse_vector must be a bool"):
        GateSpec(tokens=4, hidden=8, experts=4, top_k=1, fuse_vector="on")


def test_simulated_fused_scoring_costs_a_round_trip_of_the_scores():
    """The split adds one task and one write + read of the [t, E] scores: not a gain on its own."""
    spans, moved = {}, {}
    for fuse in (True, False):
        spec = GateSpec(tokens=4096, hidden=2048, experts=256, top_k=8, score="sigmoid", fuse_vector=fuse)
        trace = Simulator("ascend-910b").run(build_megagate(spec, "fwd")).trace
        vec = [e for e in trace.events if e.engine == "vector"]
        spans[fuse], moved[fuse] = trace.makespan, sum(e.bytes for e in vec)
    assert moved[True] == moved[False] + 2 * 4096 * 256 * 4
    assert spans[True] >= spans[False]
