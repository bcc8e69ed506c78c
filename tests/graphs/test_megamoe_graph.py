"""MegaMoE spec, routing, graph structure, executors vs the golden block, simulation, memory."""
import pytest
import torch

from megaloom.graphs.moe import (
    BWD_STAGES, FWD_STAGES, MEGAMOE, MegaMoESpec, build_backward, build_forward, estimate_memory, make_routing,
    measured_bytes, moe_reference, synthetic_counts,
)
from megaloom.graphs.moe.ep import problem
from megaloom.runtime.testing import rel_l2
from megaloom.runtime import ReferenceExecutor, ThreadExecutor
from megaloom.runtime.errors import ConfigError
from megaloom.runtime.metrics import metrics
from megaloom.scheduler import Simulator

SHAPE = dict(tokens=40, hidden=16, intermediate=8, experts=6, top_k=2)
TOL = {"float32": 1e-5, "bfloat16": 1e-2}


def spec_of(**kw) -> MegaMoESpec:
    return MegaMoESpec(**{**SHAPE, "tile_m": 16, **kw})


def run_both(spec, p, executor):
    """Forward then backward graphs on ``executor``; outputs and gradients by name."""
    r = make_routing(p["ids"], spec)
    fwd = executor.run(build_forward(spec, r.counts), {"x": p["x"], "tok": r.tok, "pos": r.pos, "w": p["w"],
                                                       "gate_up": p["gate_up"], "down": p["down"]})
    ws = p["w"].reshape(-1)[r.flat][:, None].contiguous()
    bwd = executor.run(build_backward(spec, r.counts), {
        "dout": p["dout"], "tok": r.tok, "pos": r.pos, "ws": ws, "gate_up": p["gate_up"], "down": p["down"],
        **{k: fwd[k] for k in ("xr", "gu", "a", "yc")}})
    return {"out": fwd["out"], **{k: bwd[k] for k in ("dx", "dw", "d_gate_up", "d_down")}}


def golden(p):
    ref = {k: p[k].clone().requires_grad_() for k in ("x", "w", "gate_up", "down")}
    out = moe_reference(ref["x"], p["ids"], ref["w"], ref["gate_up"], ref["down"])
    out.backward(p["dout"])
    return {"out": out, "dx": ref["x"].grad, "dw": ref["w"].grad, "d_gate_up": ref["gate_up"].grad,
            "d_down": ref["down"].grad}


# -- spec and routing ------------------------------------------------------------------
def test_spec_rejects_bad_options_naming_them():
    with pytest.raises(ConfigError, match="experts .* multiple of ep"):
        MegaMoESpec(**{**SHAPE, "ep": 4})
    with pytest.raises(ConfigError, match="tile_m must be a positive integer"):
        spec_of(tile_m=0)
    with pytest.raises(ConfigError, match="schedule must be one of"):
        spec_of(schedule="fast")
    with pytest.raises(ConfigError, match="unknown MegaMoE option"):
        MEGAMOE.from_options({**SHAPE, "tile": 3})


def test_routing_permutation_and_counts():
    spec = spec_of()
    ids = torch.tensor([[2, 0], [0, 5], [2, 5]] + [[1, 3]] * 37)
    r = make_routing(ids, spec)
    assert r.counts.counts[0] == (2, 37, 2, 37, 0, 2)  # expert 4 gets no rows
    assert torch.equal(ids.reshape(-1)[r.flat], ids.reshape(-1).sort(stable=True).values)
    assert torch.equal(r.tok, r.flat // 2)
    assert torch.equal(r.flat[r.pos.reshape(-1)], torch.arange(80))  # pos inverts the sort
    with pytest.raises(ConfigError, match=r"top-k ids must lie in \[0, 6\)"):
        make_routing(torch.full((40, 2), 6), spec)
    with pytest.raises(ConfigError, match="pass every rank's counts"):
        make_routing(ids, spec_of(ep=2))


def test_counts_offsets_of_an_imbalanced_ep_routing():
    counts = ((5, 0, 1, 2, 0, 72), (0, 0, 0, 40, 40, 0))
    from megaloom.graphs.moe.spec import Counts
    c = Counts(1, 2, 3, counts)  # 3 local experts per rank
    assert c.send_rows == 80 and c.recv_rows == 2 + 0 + 72 + 40 + 0 + 40
    assert c.send_block(1, 0) == (0, 40) and c.send_block(1, 1) == (40, 80)
    assert c.recv_block(0, 0) == (0, 2) and c.recv_block(0, 1) == (2, 42) and c.expert_rows(2) == (82, 154)


# -- numerics on the executors -----------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("schedule", ["sequential", "interleaved"])
def test_graphs_match_golden_on_reference_and_thread_executors(dtype, schedule):
    spec = spec_of(dtype=dtype, schedule=schedule, cube_split=2, wgrad_split=2, group_size=2)
    p = problem(1, **SHAPE, dtype=dtype, seed=3, idle=1)  # the last expert gets no rows
    want = golden(p)
    ref_run = run_both(spec, p, ReferenceExecutor())
    thr_run = run_both(spec, p, ThreadExecutor({"cube": 2, "vector": 2}))
    for k, v in want.items():
        assert rel_l2(ref_run[k], v) <= TOL[dtype], k
        assert rel_l2(thr_run[k], v) <= TOL[dtype], k
        torch.testing.assert_close(thr_run[k], ref_run[k])  # executors agree on the same graph


def test_a_wrong_weight_is_caught():
    p = problem(1, **SHAPE, seed=1)
    got = run_both(spec_of(), p, ReferenceExecutor())
    p["down"][0, 0, 0] += 1.0
    assert rel_l2(got["out"], golden(p)["out"]) > 1e-4


# -- structure and schedules ------------------------------------------------------------
def test_every_task_is_tagged_and_comm_rounds_are_rotated():
    spec = spec_of(ep=3, tokens=30)  # 2 local experts per rank
    counts = synthetic_counts(spec, "balanced", rank=1)
    for g in (build_forward(spec, counts), build_backward(spec, counts)):
        g.validate()
        for t in g.tasks:
            assert {"stage", "rank", "direction"} <= set(t.tags), t.name
            if t.engine == "cube":
                assert {"expert", "group"} <= set(t.tags), t.name
        comm = [t for t in g.tasks if t.op == "all_to_all"]
        assert len(comm) == 2 * 2 * 2  # dispatch + combine, 2 experts, rounds 1 and 2
        first = min(comm, key=lambda t: (len(t.predecessors), t.id))
        assert first.tags["peer"] == 2 and first.tags["round"] == 1  # rank 1 sends to rank 2 first
        for t in comm:
            assert t.tags["peer"] == (1 + t.tags["round"]) % 3 and t.tags["rank"] == 1
            s, r = t.attrs["send_splits"], t.attrs["recv_splits"]
            assert sum(x > 0 for x in s) <= 1 and sum(x > 0 for x in r) <= 1
        order = g.topological_order()
        chain = [t for t in (g.tasks[i] for i in order) if t.op == "all_to_all"]
        assert all(g.reaches(a.id, b.id) for a, b in zip(chain, chain[1:]))  # one issue order


def test_comm_tiles_split_rounds_into_chunks_of_equal_count_on_every_rank():
    spec = spec_of(ep=2, tokens=30, comm_tile=4)
    from megaloom.graphs.moe.spec import Counts
    counts = ((10, 0, 3, 9, 1, 37), (2, 5, 0, 30, 3, 20))
    per_rank = []
    for rank in (0, 1):
        g = build_forward(spec, Counts(rank, 2, 3, counts))
        comm = [t for t in g.tasks if t.op == "all_to_all"]
        assert all(t.inputs[0].shape[0] <= 4 and t.outputs[0].shape[0] <= 4 for t in comm)
        per_rank.append([(t.tags["stage"], t.tags["expert"]) for t in comm])
        sent = sum(t.attrs["send_splits"][1 - rank] for t in comm if t.tags["stage"] == "dispatch")
        assert sent == sum(counts[rank][3 * (1 - rank):3 * (2 - rank)])  # every row to the peer, once
    assert per_rank[0] == per_rank[1]  # same collectives, same order, on both ranks
    # expert 0: rank 0 sends 9 rows to rank 1, rank 1 sends 2 to rank 0: max(ceil(9/4), ceil(2/4)) chunks
    assert per_rank[0].count(("dispatch", 0)) == 3 and per_rank[0].count(("dispatch", 1)) == 2


def test_rounds_without_rows_anywhere_are_skipped():
    spec = spec_of(ep=2, tokens=30)
    from megaloom.graphs.moe.spec import Counts
    only_local = ((20, 20, 20, 0, 0, 0), (0, 0, 0, 20, 20, 20))  # every row stays on its rank
    g = build_forward(spec, Counts(0, 2, 3, only_local))
    assert not [t for t in g.tasks if t.op == "all_to_all"]


def simulate(g):
    return Simulator("atlas-a3", units={"cube": 4, "vector": 4, "comm": 2}, policy="priority").run(g).trace


def spans(trace):
    """(first start, last end) of each stage tag's tasks (barriers left out)."""
    out = {}
    for e in trace.events:
        if e.op != "noop":
            a, b = out.get(e.tags["stage"], (float("inf"), 0.0))
            out[e.tags["stage"]] = (min(a, e.start), max(b, e.end))
    return out


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_sequential_has_stage_barriers_and_interleaved_overlaps_experts(direction):
    opts = dict(tokens=512, hidden=256, intermediate=128, experts=16, top_k=2, ep=4, dtype="bfloat16",
                ordered_comm=False, direction=direction)
    seq = simulate(MEGAMOE.from_options({**opts, "schedule": "sequential"}))
    inter = simulate(MEGAMOE.from_options({**opts, "schedule": "interleaved"}))
    stages = FWD_STAGES if direction == "fwd" else BWD_STAGES[:-1]  # top-k grad shares the last stage
    s = spans(seq)
    for a, b in zip(stages, stages[1:]):
        assert s[a][1] <= s[b][0], (a, b)  # no overlap between stages
    i = spans(inter)
    first, last = ("gmm1", "gmm2") if direction == "fwd" else ("dgmm2", "dgmm1")
    assert i[first][1] > i[last][0]  # one expert's later GEMM runs while another's earlier GEMM still runs
    assert metrics(inter).makespan < metrics(seq).makespan
    assert metrics(inter).comm_hidden > metrics(seq).comm_hidden


@pytest.mark.parametrize("policy, opts", [("fifo", {}), ("critical_path", {}), ("static", {}),
                                          ("expert_interleave", {"group_size": 2}), ("rotated", {})])
def test_scheduler_policies_compose_with_the_graphs(policy, opts):
    from megaloom.scheduler import make_policy
    spec = spec_of(ep=3, tokens=30, group_size=2)
    g = build_backward(spec, synthetic_counts(spec, "random", rank=2, seed=1))
    units = {"cube": 4, "vector": 4, "comm": 2}
    tr = Simulator("atlas-a3", units=units, policy=make_policy(policy, **opts)).run(g).trace
    assert len(tr.events) == len(g.tasks)
    if policy == "rotated":  # rank 2 serves peer 0 (= 2 + 1 mod 3) before peer 1 among ready comm tasks
        first = min((e for e in tr.events if e.op == "all_to_all"), key=lambda e: (e.start, e.task_id))
        assert first.tags["peer"] == 0
    p = problem(1, **SHAPE, seed=6)
    executor = ThreadExecutor({"cube": 2, "vector": 1}, policy=make_policy(policy, **opts))
    got = run_both(spec_of(group_size=2), p, executor)
    assert rel_l2(got["d_gate_up"], golden(p)["d_gate_up"]) <= 1e-5


def test_group_priorities_follow_expert_groups():
    g = build_forward(spec_of(group_size=2), synthetic_counts(spec_of(), "balanced"))
    for t in g.tasks:
        if "expert" in t.tags:
            assert t.tags["group"] == t.tags["expert"] // 2 and t.priority == -t.tags["group"]


# -- memory ---------------------------------------------------------------------------
@pytest.mark.parametrize("ep", [1, 2])
def test_memory_estimate_matches_what_a_run_allocates(ep):
    spec = spec_of(ep=ep)
    T, H, I, S = spec.tokens, spec.hidden, spec.intermediate, spec.rows
    p = problem(1, **SHAPE, seed=2)
    counts = make_routing(p["ids"], spec_of()).counts
    if ep == 1:
        g = build_forward(spec, counts)
        est = estimate_memory(g)
        R = S  # all rows stay local
        assert est.allocated_bytes == 4 * (R * H + R * 2 * I + R * I + S * H + T * H)
        r = make_routing(p["ids"], spec)
        res = ReferenceExecutor().run(g, {"x": p["x"], "tok": r.tok, "pos": r.pos, "w": p["w"],
                                          "gate_up": p["gate_up"], "down": p["down"]})
        assert measured_bytes(g, res.buffers) == est.allocated_bytes
        assert est.saved_bytes == est.allocated_bytes  # training keeps every activation
        nosave = estimate_memory(build_forward(spec, counts, save=False))
        assert nosave.peak_bytes < nosave.allocated_bytes  # gu and a die before the output is made
    else:
        c = synthetic_counts(spec, "skewed", seed=4)
        est = estimate_memory(build_backward(spec, c))
        R, S = c.recv_rows, c.send_rows
        work = S * H + R * H + R * I + R * 2 * I + R * H + S * H  # dys dyr da dgu dxr dxs
        outs = T * H + T * 2 + spec.experts_local * (H * 2 * I + I * H)  # dx dw d_gate_up d_down
        assert est.allocated_bytes == 4 * (work + outs)
        assert est.saved_bytes == 4 * outs and est.saved_bytes < est.peak_bytes < est.allocated_bytes


# -- options / CLI ----------------------------------------------------------------------
def test_build_graph_from_yaml_and_cli(tmp_path, capsys):
    path = tmp_path / "moe.yaml"
    path.write_text("megamoe:\n  tokens: 64\n  hidden: 32\n  intermediate: 16\n  experts: 8\n  top_k: 2\n  ep: 2\n")
    g = MEGAMOE(spec=str(path), direction="bwd", routing="random")
    assert g.name == "megamoe.bwd.r0" and any(t.op == "moe_wgrad" for t in g.tasks)
    from megaloom.cli import main
    assert main(["simulate", "--graph", f"megamoe:spec={path},schedule=sequential", "--profile", "atlas-a3"]) == 0
    assert "megamoe.fwd.r0" in capsys.readouterr().out
    assert main(["simulate", "--graph", "megamoe:tokens=8,hidden=8,intermediate=8,experts=4,top_k=9"]) == 2
