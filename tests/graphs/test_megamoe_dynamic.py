"""MegaMoE dynamic graphs: built once per spec, every routing a run-time input."""
from dataclasses import replace

import pytest
import torch

from megaloom.comm.spawn import run_world
from megaloom.graphs import MegaGate, MegaMHC
from megaloom.graphs.moe import MEGAMOE, MegaMoE, MegaMoERunner, MegaMoESpec, make_routing, moe_reference
from megaloom.graphs.moe.ep import ep_check
from megaloom.graphs.moe.graph import saved_names
from megaloom.graphs.moe.layout import Layout, make_plan
from megaloom.graphs.moe.spec import Counts
from megaloom.runtime import ThreadExecutor
from megaloom.runtime.errors import ConfigError
from megaloom.runtime.testing import rel_l2

T, H, I, E, K = 24, 32, 32, 4, 2


def routings(n: int, seed: int = 0):
    """``n`` top-k id tensors: random, some experts idle, every row on one expert, skewed."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        kind = i % 5
        if kind == 0:
            ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
        elif kind == 1:  # experts 2 and 3 idle
            ids = torch.stack([torch.randperm(2, generator=gen)[:K] for _ in range(T)])
        elif kind == 2:  # every row on one expert (top-k lists it twice)
            ids = torch.full((T, K), int(torch.randint(E, (1,), generator=gen)))
        elif kind == 3:  # expert 0 idle
            ids = torch.stack([1 + torch.randperm(E - 1, generator=gen)[:K] for _ in range(T)])
        else:  # skewed: most rows on expert 1
            ids = torch.where(torch.rand(T, K, generator=gen) < 0.8, 1, torch.randint(E, (T, K), generator=gen))
        out.append(ids)
    return out


def golden(x, ids, w, gu, dn, dout, mx=None):
    ref = [t.clone().requires_grad_() for t in (x, w, gu, dn)]
    out = moe_reference(ref[0], ids, ref[1], ref[2], ref[3], mx=mx)
    out.backward(dout)
    return [out.detach(), *(t.grad for t in ref)]


def fresh(spec, ids, x, w, gu, dn, dout):
    """The graphs built for this routing's counts (no capacity, no plan)."""
    ex, r, spec = ThreadExecutor(), make_routing(ids, spec), replace(spec, grouped=False)  # counts graphs tile
    f = ex.run(MEGAMOE.build(spec, "fwd", r.counts), {"x": x, "tok": r.tok, "pos": r.pos, "w": w, "gate_up": gu,
                                                       "down": dn})
    ws = w.reshape(-1)[r.flat][:, None].contiguous()
    b = ex.run(MEGAMOE.build(spec, "bwd", r.counts), {"dout": dout, "tok": r.tok, "pos": r.pos, "ws": ws,
                                                       **{k: f[k] for k in saved_names(spec)}, "gate_up": gu,
                                                       "down": dn})
    return [f["out"], b["dx"], b["dw"], b["d_gate_up"], b["d_down"]]


@pytest.mark.parametrize("precision, n, tile_m, grouped", [("none", 50, 8, False), ("none", 20, 8, True),
                                                           ("mxfp8", 10, 16, False)])
def test_cached_graph_matches_fresh_graphs_and_golden_over_many_routings(precision, n, tile_m, grouped):
    spec = MegaMoESpec(T, H, I, E, K, tile_m=tile_m, cube_split=2, precision=precision, grouped=grouped)
    runner = MegaMoERunner(spec, units={"cube": 2, "vector": 2}, policy="priority")
    gen = torch.Generator().manual_seed(1)
    gu, dn = torch.randn(E, H, 2 * I, generator=gen) / H ** 0.5, torch.randn(E, I, H, generator=gen) / I ** 0.5
    mx = "floor" if precision == "mxfp8" else None
    for ids in routings(n):
        x, dout, w = torch.randn(T, H, generator=gen), torch.randn(T, H, generator=gen), torch.rand(T, K, generator=gen)
        r = make_routing(ids, spec)
        f = runner.forward(spec, r, x, w, gu, dn)
        b = runner.backward(spec, r, dout, w, {k: f[k] for k in saved_names(spec)}, gu, dn)
        got = [f["out"], b["dx"], b["dw"], b["d_gate_up"], b["d_down"]]
        for g, want in zip(got, fresh(spec, ids, x, w, gu, dn, dout)):
            torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-5)
        for g, want in zip(got, golden(x, ids, w, gu, dn, dout, mx)):
            assert rel_l2(g, want) <= 1e-5
    assert runner.builds == 2  # one forward, one backward graph for every routing


@pytest.mark.dist
def test_expert_parallel_ranks_reuse_their_graphs_over_new_routings():
    cfg = dict(tokens=12, hidden=16, intermediate=8, experts=4, top_k=2, tile_m=8, idle=1, repeat=4, reroute=True,
               units={"cube": 2, "vector": 1, "comm": 2}, comm_tile=4)
    for res in run_world(ep_check, 2, cfg, timeout=60, comm_timeout=20):
        assert max(res["errors"].values()) <= 1e-5 and res["builds"] == 2, res


def test_module_builds_and_validates_once_across_steps(monkeypatch):
    import megaloom.runtime.graph as graph_mod

    calls = []
    real = graph_mod.validate
    monkeypatch.setattr(graph_mod, "validate", lambda g: calls.append(g.name) or real(g))
    moe = MegaMoE(H, I, E, K, tile_m=8)
    for ids in routings(6, seed=3):
        x = torch.randn(T, H, requires_grad=True)
        moe(x, ids, torch.rand(T, K)).sum().backward()
    assert moe.runner.builds == 2 and len(moe.runner._graphs) == 2
    assert sorted(calls) == ["megamoe.bwd.r0", "megamoe.fwd.r0"]  # validated once each


def test_module_groups_each_stage_into_one_task_when_experts_hold_few_tiles():
    moe = MegaMoE(H, I, E, K, tile_m=4)
    tasks = {}
    for tokens in (8, 40):  # 4 experts of 4 and of 20 rows on average: 1 and 5 row tiles
        moe(torch.randn(tokens, H, requires_grad=True), routings(1)[0][:tokens].repeat(2, 1)[:tokens],
            torch.rand(tokens, K)).sum().backward()
        graphs = list(moe.runner._graphs.values())[-2:]
        tasks[tokens] = [len(g.tasks) for g in graphs]
    # grouped: forward gather, GEMM, SwiGLU, GEMM, weighted sum; backward also the weight gradients and top-k grad
    assert tasks[8] == [5, 8] and min(tasks[40]) > 20
    assert [moe.runner.spec_for(t, torch.float32, "").grouped for t in (8, 40)] == [True, False]
    two_cubes = MegaMoE(H, I, E, K, tile_m=4, units={"cube": 2, "vector": 1})  # tiles run at once there
    assert not two_cubes.runner.spec_for(8, torch.float32, "").grouped
    with pytest.raises(ConfigError, match="grouped needs ep=1"):
        MegaMoESpec(T, H, I, E, K, ep=2, grouped=True)
    with pytest.raises(ConfigError, match="grouped graphs are dynamic"):
        MEGAMOE.build(MegaMoESpec(T, H, I, E, K, grouped=True), "fwd", make_routing(routings(1)[0], MegaMoESpec(
            T, H, I, E, K)).counts)


def test_gate_and_mhc_modules_keep_one_graph_per_token_count():
    gate, mhc = MegaGate(16, 8, 2, tile_tokens=8), MegaMHC(16, streams=2, tile_tokens=8)
    for step in range(4):
        x = torch.randn(12, 16, requires_grad=True)
        out = gate(x)
        (out.weights.sum() + out.logits.sum()).backward()
        y, h = torch.randn(12, 16, requires_grad=True), torch.randn(12, 2, 16, requires_grad=True)
        res = mhc(y, h, torch.rand(12, 2), torch.rand(12, 2, 2))
        sum(t.float().sum() for t in res).backward()
    assert gate.runner.builds == 2 and mhc.runner.builds == 2


def test_plan_tiles_and_capacity():
    spec = MegaMoESpec(T, H, I, E, K, tile_m=8)
    lay = Layout(spec)
    assert lay.rows == (T * K + E * 7) // 8 * 8 and lay.tiles == lay.rows // 8
    plan = make_plan(lay, Counts(0, 1, E, ((9, 0, 39, 0),)))
    assert plan.start == [0, 16, 16, 56] and plan.n == [9, 0, 39, 0]
    assert plan.tile[:7] == [(0, 8), (0, 1), (2, 8), (2, 8), (2, 8), (2, 8), (2, 7)]
    assert all(n == 0 for _, n in plan.tile[7:])
    ep = Layout(MegaMoESpec(T, H, I, E, K, ep=2, tile_m=8), rank=1)
    assert ep.slot == 48 and ep.rows == 2 * 48 and ep.region(1) == (48, 96)
    with pytest.raises(ConfigError, match="lists an expert at most once"):
        make_plan(ep, Counts(1, 2, 2, ((30, 18, 0, 0), (12, 12, 12, 12))))


@pytest.mark.parametrize("n", [0, 3, 8])
def test_dyn_tile_kernel_matches_its_reference_on_live_rows(n):
    from megaloom.runtime.registry import get_op, run_reference

    op = get_op("moe_dyn")
    gen = torch.Generator().manual_seed(n)
    x, w = torch.randn(8, 6, generator=gen), torch.randn(3, 6, 5, generator=gen)
    meta = torch.tensor([[2, n, 0]])
    attrs = {"op": "moe_gmm", "codes": "tre|r", "sim": n}
    out = torch.full((8, 5), 7.0)
    op.kernel([meta, x, w], [out], **attrs)
    ref, = run_reference(op, [meta, x, w], attrs)
    torch.testing.assert_close(out[:n], x[:n] @ w[2])
    torch.testing.assert_close(ref[:n], out[:n])
    assert (out[n:] == 7).all() and (ref[n:] == 0).all()  # rows past the live ones: untouched (zeros in the oracle)
    dw = torch.full((1, 6, 5), 7.0)  # an expert block: its weight gradient, zeros when it has no rows
    block = torch.tensor([[10 + 2, n, 0]])
    get_op("moe_dyn").kernel([block, x, x[:, :5]], [dw], op="moe_wgrad", codes="brr|e", base=10, sim=n)
    torch.testing.assert_close(dw[0], x[2:2 + n].t() @ x[2:2 + n, :5])


def test_exchange_copies_own_rows_by_the_plan():
    from megaloom.runtime.registry import get_op, run_reference

    src, old = torch.randn(10, 4), torch.randn(6, 4)
    row = torch.tensor([[3, 4, 1, 4, 4]])  # source rows 3..6 to destination rows 1..4
    attrs = {"to": -1, "frm": -1, "world": 1, "chunk": 1, "tile": 2, "sim": 2}
    out = old.clone()
    get_op("moe_exchange").kernel([row, src, old], [out], **attrs)
    want = old.clone()
    want[3:5] = src[5:7]  # chunk 1 of 2 rows
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(run_reference(get_op("moe_exchange"), [row, src, old], attrs)[0], want)
