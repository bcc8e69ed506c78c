"""World simulation: every rank's graph at once, collectives synchronised across ranks."""
from dataclasses import asdict

import pytest

import megaloom.comm.ops  # noqa: F401  (registers the comm ops)
from megaloom.cli import main
from megaloom.graphs.moe import MEGAMOE, MegaMoESpec, build_forward, synthetic_counts
from megaloom.runtime import Cost, TaskGraph
from megaloom.runtime.errors import ConfigError, ScheduleError
from megaloom.scheduler import Simulator
from megaloom.scheduler.world import match_collectives, rank_ends, simulate_world
from .graphs import random_dag


def spmd_graph(spec, name="g"):
    """One rank's graph: ``(op, engine, duration_s, preds[, peer])`` per task: a ``noop``, or a
    comm op reading a small input and writing its own output (so the graph validates)."""
    g = TaskGraph(name)
    x = g.input("x", (4, 4))
    for i, (op, engine, d, preds, *peer) in enumerate(spec):
        ins, outs, attrs = [x], [g.buffer(f"y{i}", (4, 4))], {"world_size": 1}
        if op == "noop":
            ins, outs, attrs = [], [], {}
        elif op == "send":
            outs, attrs = [], {"peer": peer[0], "tag": 7}
        elif op == "recv":
            ins, attrs = [], {"peer": peer[0], "tag": 7, "shape": [4, 4]}
        g.task(op, ins, outs, name=f"t{i}", engine=engine, attrs={**attrs, "duration": d}, cost=Cost(),
               after=[g.tasks[p] for p in preds])
    return g


# compute -> all_reduce -> compute, a second chained all_reduce, and work off the collective path
STEP = [("noop", "cube", 1.0, []), ("all_reduce", "comm", 0.5, [0]), ("noop", "cube", 1.0, [1]),
        ("noop", "vector", 2.0, []), ("all_gather", "comm", 0.25, [1, 3]), ("noop", "vector", 0.5, [4])]


def by_rank(trace):
    out = {}
    for e in trace.events:
        out.setdefault(e.rank, {})[e.task_id] = e
    return out


def times(events):
    return {tid: (e.start, e.end, e.unit, e.engine, e.task) for tid, e in events.items()}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("policy", ["fifo", "critical_path", "rotated", "expert_interleave", "static"])
def test_identical_ranks_get_the_single_rank_schedule(world, policy):
    for g in (spmd_graph(STEP), random_dag(3, 40)):
        single = by_rank(Simulator("h100", policy=policy).run(g).trace)[0]
        res = simulate_world([g] * world, "h100", policy=policy)
        ranks = by_rank(res.trace)
        assert sorted(ranks) == list(range(world)) and res.trace.meta["world_size"] == world
        for r in range(world):
            assert times(ranks[r]) == times(single)


def test_identical_megamoe_ranks_match_the_single_rank_schedule():
    spec = MegaMoESpec(tokens=32, hidden=16, intermediate=16, experts=4, top_k=2, ep=2, tile_m=8)
    g = build_forward(spec, synthetic_counts(spec, "skewed", rank=0))
    single = Simulator("atlas-a3").run(g).trace
    res = simulate_world([g, g], "atlas-a3")
    assert res.trace.meta["loop"] == "compiled" and res.trace.meta["collectives"] > 0
    for r, events in by_rank(res.trace).items():
        assert times(events) == times(by_rank(single)[0])


def test_slow_rank_delays_the_others_exactly_at_the_collectives():
    g = spmd_graph(STEP)
    ranks = by_rank(simulate_world([g, g], "h100", slowdown={1: 2.0}).trace)
    span = {r: {tid: (e.start, e.end) for tid, e in ev.items()} for r, ev in ranks.items()}
    # rank 1 reaches the all_reduce at 2 (t0 takes 2 s there), the all_gather at 4 (t3 takes 4 s);
    # each lasts as long as rank 1's copy (1 s, 0.5 s) on both ranks
    assert span[0] == {0: (0, 1), 1: (2, 3), 2: (3, 4), 3: (0, 2), 4: (4, 4.5), 5: (4.5, 5)}
    assert span[1] == {0: (0, 2), 1: (2, 3), 2: (3, 5), 3: (0, 4), 4: (4, 4.5), 5: (4.5, 5.5)}
    # without end synchronisation each rank keeps its own collective durations
    own = by_rank(simulate_world([g, g], "h100", slowdown={1: 2.0}, sync_end=False).trace)
    assert {t: (e.start, e.end) for t, e in own[0].items()} == \
        {0: (0, 1), 1: (2, 2.5), 2: (2.5, 3.5), 3: (0, 2), 4: (4, 4.25), 5: (4.25, 4.75)}
    assert rank_ends(simulate_world([g, g], "h100").trace) == {0: 2.75, 1: 2.75}


def test_point_to_point_pairs_rendezvous_pairwise():
    sender = spmd_graph([("noop", "cube", 1.0, []), ("send", "comm", 0.5, [0], 1)])
    receiver = spmd_graph([("recv", "comm", 0.25, [], 0), ("noop", "cube", 1.0, [0])])
    ranks = by_rank(simulate_world([sender, receiver], "h100").trace)
    assert (ranks[0][1].start, ranks[0][1].end) == (1.0, 1.5)
    assert (ranks[1][0].start, ranks[1][0].end, ranks[1][1].end) == (1.0, 1.5, 2.5)
    lone = spmd_graph([("recv", "comm", 0.25, [], 1)])
    with pytest.raises(ScheduleError, match=r"rank 1 sends 0 message\(s\) with tag 7 to rank 0.*'t0' on rank 0"):
        simulate_world([lone, spmd_graph([("noop", "cube", 1.0, [])])], "h100")


def test_send_before_recv_on_both_ranks_deadlocks():
    g0 = spmd_graph([("send", "comm", 0.5, [], 1), ("recv", "comm", 0.5, [0], 1)])
    g1 = spmd_graph([("send", "comm", 0.5, [], 0), ("recv", "comm", 0.5, [0], 0)])
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate_world([g0, g1], "h100")


def test_mismatched_collectives_raise():
    short = spmd_graph(STEP[:4])
    with pytest.raises(ScheduleError, match=r"collective #1 .* rank 0 issues all_gather 't4', rank 1 issues none"):
        simulate_world([spmd_graph(STEP), short], "h100")
    swapped = [(("all_reduce" if op == "all_gather" else op), *rest) for op, *rest in STEP]
    swapped[1] = ("all_gather", *STEP[1][1:])
    with pytest.raises(ScheduleError, match=r"collective #0 .* rank 0 issues all_reduce 't1', rank 2 issues all_gather"):
        simulate_world([spmd_graph(STEP), spmd_graph(STEP), spmd_graph(swapped)], "h100")
    with pytest.raises(ConfigError, match="slowdown"):
        simulate_world([short, short], "h100", slowdown={2: 2.0})
    with pytest.raises(ConfigError, match=r"slowdown\[0\]"):
        simulate_world([short, short], "h100", slowdown={0: 0.0})


@pytest.mark.parametrize("ep", [2, 4])
def test_megamoe_ep_world(ep):
    spec = MegaMoESpec(tokens=32, hidden=16, intermediate=16, experts=8, top_k=2, ep=ep, tile_m=8)
    graphs = [build_forward(spec, synthetic_counts(spec, "skewed", rank=r)) for r in range(ep)]
    assert [g.name for g in MEGAMOE.world(**{**asdict(spec), "routing": "skewed"})] == [g.name for g in graphs]
    trace = simulate_world(graphs, "atlas-a3", policy="critical_path").trace
    ranks = by_rank(trace)
    assert sorted(ranks) == list(range(ep)) and sum(map(len, ranks.values())) == sum(map(len, graphs))
    for r, g in enumerate(graphs):
        assert {e.engine for e in ranks[r].values()} <= {"cube", "vector", "comm"}
        for tid, e in ranks[r].items():
            assert e.task == g.tasks[tid].name and e.deps == g.pred[tid]
            assert all(ranks[r][p].end <= e.start for p in e.deps)
    # the builder names the k-th collective alike on every rank (stage, expert, round, chunk)
    colls = [{e.task: e for e in ranks[r].values() if e.op == "all_to_all"} for r in range(ep)]
    assert colls[0] and all(c.keys() == colls[0].keys() for c in colls)
    assert len(match_collectives(graphs)) == len(colls[0])
    for name in colls[0]:
        assert len({c[name].start for c in colls}) == 1, name
        # and no rank starts it before every rank has finished that collective's predecessors
        ready = max((ranks[r][p].end for r in range(ep) for p in colls[r][name].deps), default=0.0)
        assert colls[0][name].start >= ready
    world_end = max(rank_ends(trace).values())
    for g in graphs:
        assert world_end >= Simulator("atlas-a3", policy="critical_path").run(g).trace.makespan


def test_simulate_world_cli(capsys):
    spec = "megamoe:tokens=32,hidden=16,intermediate=16,experts=8,top_k=2,ep=4,tile_m=8,routing=skewed"
    assert main(["simulate", "--graph", spec, "--world", "--profile", "atlas-a3"]) == 0
    out = capsys.readouterr().out
    assert all(f"rank {r}:" in out for r in range(4)) and "world makespan" in out
    assert main(["simulate", "--graph", spec + ",rank=1", "--world"]) == 2
    assert "rank" in capsys.readouterr().err
