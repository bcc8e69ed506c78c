"""The MegaMoE module and autograd function: golden match, gradcheck, graph cache, EP ranks."""
import pytest
import torch

from megaloom.comm.spawn import run_world
from megaloom.graphs import MegaMoE, moe_reference
from megaloom.graphs.moe import megamoe
from megaloom.graphs.moe.ep import ep_check, problem
from megaloom.runtime.testing import rel_l2
from megaloom.runtime.errors import ConfigError

SHAPE = dict(tokens=24, hidden=16, intermediate=8, experts=4, top_k=2)


def module_vs_golden(dtype, executor="thread", **kw):
    p = problem(1, **SHAPE, dtype=dtype, seed=5, idle=1)
    moe = MegaMoE(16, 8, 4, 2, dtype=p["x"].dtype, tile_m=8, executor=executor, **kw)
    with torch.no_grad():
        moe.gate_up.copy_(p["gate_up"])
        moe.down.copy_(p["down"])
    x, w = p["x"].clone().requires_grad_(), p["w"].clone().requires_grad_()
    y = moe(x.view(2, 12, 16), p["ids"].view(2, 12, 2), w.view(2, 12, 2))  # any leading dims
    assert y.shape == (2, 12, 16)
    y.view(24, 16).backward(p["dout"])
    ref = {k: p[k].clone().requires_grad_() for k in ("x", "w", "gate_up", "down")}
    r = moe_reference(ref["x"], p["ids"], ref["w"], ref["gate_up"], ref["down"])
    r.backward(p["dout"])
    got = {"out": y.view(24, 16), "x": x.grad, "w": w.grad, "gate_up": moe.gate_up.grad, "down": moe.down.grad}
    want = {"out": r, **{k: ref[k].grad for k in ref}}
    return {k: rel_l2(got[k], want[k]) for k in got}


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-5), ("bfloat16", 1e-2)])
def test_module_matches_golden_block(dtype, tol):
    errs = module_vs_golden(dtype, units={"cube": 2, "vector": 1, "comm": 1}, policy="priority")
    assert max(errs.values()) <= tol, errs


def test_module_on_reference_executor_with_sequential_schedule():
    errs = module_vs_golden("float32", executor="reference", schedule="sequential", cube_split=2)
    assert max(errs.values()) <= 1e-5, errs


def test_gradcheck_float64():
    torch.manual_seed(0)
    moe = MegaMoE(6, 4, 4, 2, dtype=torch.float64, tile_m=4, cube_split=2, wgrad_split=2)
    x = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    ids = torch.tensor([[0, 1], [1, 0], [3, 1], [1, 3], [0, 1]])  # expert 2 idle
    w = torch.rand(5, 2, dtype=torch.float64, requires_grad=True)
    gu, dn = (p.detach().clone().requires_grad_() for p in (moe.gate_up, moe.down))
    assert torch.autograd.gradcheck(lambda *a: megamoe(moe.runner, a[0], ids, *a[1:]),
                                    (x, w, gu, dn), eps=1e-6, atol=1e-6)


def test_graphs_are_cached_by_counts_and_inference_saves_nothing():
    moe = MegaMoE(8, 4, 4, 2, tile_m=4)
    x = torch.randn(6, 8)
    ids = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2], [1, 3]])
    w = torch.rand(6, 2)
    with torch.no_grad():
        a = moe(x, ids, w)
        b = moe(x, ids[[1, 0, 3, 2, 5, 4]], w)  # same counts, other tokens: graph reused
    assert len(moe.runner._graphs) == 1
    torch.testing.assert_close(b, moe_reference(x, ids[[1, 0, 3, 2, 5, 4]], w, moe.gate_up, moe.down).detach())
    assert not a.requires_grad
    moe(x, torch.zeros_like(ids), w).sum().backward()  # every row on expert 0 (>= 1 idle expert)
    assert len(moe.runner._graphs) == 3  # one more forward (saving activations) and one backward


def test_module_rejects_bad_inputs():
    moe = MegaMoE(8, 4, 4, 2)
    with pytest.raises(ConfigError, match="hidden states are torch.float64"):
        moe(torch.randn(3, 8, dtype=torch.float64), torch.zeros(3, 2, dtype=torch.long), torch.rand(3, 2))
    with pytest.raises(ConfigError, match="top-k ids must lie in"):
        moe(torch.randn(3, 8), torch.full((3, 2), 4), torch.rand(3, 2))
    from megaloom.graphs.moe import MegaMoERunner, MegaMoESpec
    two = type("C", (), {"world_size": 2, "rank": 0})()
    with pytest.raises(ConfigError, match="ep=1 but the communicator has 2 ranks"):
        MegaMoERunner(MegaMoESpec(4, 8, 4, 4, 2), comm=two)
    with pytest.raises(ConfigError, match="needs ordered_comm=True"):
        MegaMoERunner(MegaMoESpec(4, 8, 4, 4, 2, ep=2, ordered_comm=False), comm=two)
    with pytest.raises(ConfigError, match="dtype must be one of"):
        MegaMoE(8, 4, 4, 2, dtype=torch.int64)


@pytest.mark.dist
@pytest.mark.parametrize("world, schedule, dtype, executor", [(2, "interleaved", "bfloat16", "thread"),
                                                             (4, "sequential", "float32", "thread"),
                                                             (2, "interleaved", "float32", "reference")])
def test_expert_parallel_on_gloo_ranks(world, schedule, dtype, executor):
    tol = 1e-2 if dtype == "bfloat16" else 1e-5
    cfg = dict(tokens=12, hidden=16, intermediate=8, experts=8, top_k=2, tile_m=8, idle=1, schedule=schedule,
               dtype=dtype, executor=executor, units={"cube": 2, "vector": 1, "comm": 2},  # the chain orders comm
               comm_tile=2 if world == 4 else 0)  # uneven chunks: some ranks send or get nothing in a chunk
    for res in run_world(ep_check, world, cfg, timeout=60, comm_timeout=20):
        assert max(res["errors"].values()) <= tol, res
