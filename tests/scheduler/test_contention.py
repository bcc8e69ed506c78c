"""Contention: units sharing cores and comm overlapping compute slow each other in the simulator."""
import pytest

from megaloom.runtime import Cost, TaskGraph
from megaloom.runtime.errors import ConfigError
from megaloom.scheduler import CostModel, Simulator, load_profile
from megaloom.scheduler.contention import work
from megaloom.scheduler.fit import fit_overlap, fit_traces
from megaloom.scheduler.policies import POLICIES
from megaloom.scheduler.profile import Contention, parse_profile
from .graphs import random_dag, timed_graph


def modelled(spec):
    """``timed_graph``'s tasks without measured durations (the simulator is given them), so the
    contention model applies to them."""
    g = TaskGraph("modelled")
    for i, (engine, _, preds) in enumerate(spec):
        g.task("noop", name=f"t{i}", engine=engine, cost=Cost(), after=[g.tasks[p] for p in preds])
    return g, [d for _, d, _ in spec]


def spans(graph, durations, units, contention, policy="fifo", fast=True):
    cm = CostModel("cpu")
    cm.contention = contention
    sim = Simulator("cpu", units, policy, cm, fast=fast)
    trace = sim.run(graph, durations=durations).trace
    return {e.task: (e.start, e.end) for e in trace.events}, sim.last_loop


def test_units_sharing_fewer_cores_share_their_time():
    g, d = modelled([("cube", 1.0, []), ("cube", 1.0, [])])
    free, loop = spans(g, d, {"cube": 2}, None)
    assert free == {"t0": (0.0, 1.0), "t1": (0.0, 1.0)} and loop == "compiled"
    shared, loop = spans(g, d, {"cube": 2}, Contention(1.0, ("cube",)))
    assert shared == {"t0": (0.0, 2.0), "t1": (0.0, 2.0)} and loop == "python"
    # t2 waits for a vector task (not sharing the core): t1 runs alone, then at half speed beside t2
    g, d = modelled([("vector", 0.5, []), ("cube", 1.0, []), ("cube", 1.0, [0])])
    got, _ = spans(g, d, {"cube": 2, "vector": 1}, Contention(1.0, ("cube",)))
    assert got["t1"] == pytest.approx((0.0, 1.5)) and got["t2"] == pytest.approx((0.5, 2.0))
    assert got["t0"] == (0.0, 0.5)
    # 1.5 cores for three tasks: each at half speed
    g, d = modelled([("cube", 1.0, []), ("cube", 1.0, []), ("vector", 1.0, [])])
    got, _ = spans(g, d, {"cube": 2, "vector": 1}, Contention(1.5, ("cube", "vector")))
    assert all(v == pytest.approx((0.0, 2.0)) for v in got.values())


def test_comm_overlapping_compute_slows_it():
    g, d = modelled([("cube", 1.0, []), ("comm", 0.5, [])])
    got, _ = spans(g, d, {"cube": 1, "comm": 1}, Contention(1.0, (), overlap=0.5))
    assert got["t1"] == (0.0, 0.5)                                   # comm itself is not slowed
    assert got["t0"][1] == pytest.approx(0.5 + (1.0 - 0.5 / 1.5))   # a third of its work done beside comm


def test_measured_durations_are_taken_as_measured():
    g = timed_graph([("cube", 1.0, []), ("cube", 1.0, [])])
    got, loop = spans(g, None, {"cube": 2}, Contention(1.0, ("cube",)))
    assert got == {"t0": (0.0, 1.0), "t1": (0.0, 1.0)} and loop == "compiled"  # nothing to slow


@pytest.mark.parametrize("policy", sorted(POLICIES.names()))
@pytest.mark.parametrize("seed", range(4))
def test_the_contention_loop_gives_the_plain_schedule_when_nothing_is_slowed(policy, seed):
    """Contention that binds only an engine the graph never uses: the contention loop runs and
    must give the compiled (or plain Python) loop's schedule exactly, dispatch order included."""
    g = random_dag(seed, 120)
    d = [t.attrs.pop("duration") for t in g.tasks]
    units = {"cube": 2, "vector": 3, "comm": 1, "host": 2}
    idle = Contention(1.0, ("host",))
    plain, loop = spans(g, d, units, None, policy)
    assert loop == ("python" if policy in ("static", "expert_interleave") else "compiled")
    contended, loop = spans(g, d, units, idle, policy)
    assert loop == "python" and contended == plain
    sims = [Simulator("cpu", units, policy, CostModel("cpu")) for _ in range(2)]
    sims[1].cost_model.contention = idle
    a, b = (s.schedule(g, d) for s in sims)
    assert (a.order, a.unit) == (b.order, b.unit)


def test_work_inverts_the_contention_and_fits_see_through_it():
    g, d = modelled([("cube", 1.0 + 0.25 * (i % 3), []) for i in range(12)] +
                    [("vector", 0.5 + 0.125 * (i % 2), [i]) for i in range(12)])
    c = Contention(1.25, ("cube", "vector"))
    cm = CostModel("cpu")
    cm.contention = c
    events = Simulator("cpu", {"cube": 2, "vector": 1}, "fifo", cm).run(g, durations=d).trace.events
    assert max(e.end - e.start - d[e.task_id] for e in events) > 0.5  # the run was slowed
    assert work(events, c) == pytest.approx([d[e.task_id] for e in events])
    for e in events:  # one op class per duration: a fit without overhead explains it exactly
        e.op = f"op{d[e.task_id]}"
    from megaloom.runtime.trace import Trace
    trace = Trace(events, {})
    assert max(f.max_rel_error for f in fit_traces([trace], dispatch=False, contention=c).values()) < 1e-9
    assert max(f.max_rel_error for f in fit_traces([trace], dispatch=False).values()) > 0.1


def test_the_fit_finds_the_overlap_slowdown_and_fits_comm_by_its_bytes():
    spec = [("cube", 1.0 + 0.25 * (i % 3), []) for i in range(8)] + [("comm", 0.5 + 0.25 * (i % 2), []) for i in range(6)]
    g, d = modelled(spec)
    c = Contention(4.0, ("cube",), overlap=0.4)
    cm = CostModel("cpu")
    cm.contention = c
    events = Simulator("cpu", {"cube": 1, "comm": 1}, "fifo", cm).run(g, durations=d).trace.events
    for e in events:
        e.op = "send" if e.engine == "comm" else f"mm{d[e.task_id]}"
        e.comm_bytes = 1e6 * d[e.task_id] if e.engine == "comm" else 0.0  # comm at 1 MB/ms, no overhead
    from megaloom.runtime.trace import Trace
    fitted, fits = fit_overlap([Trace(events, {})], Contention(4.0, ("cube",)), dispatch=False)
    assert fitted == Contention(4.0, ("cube",), pytest.approx(0.4))
    assert fits["send"].coeffs.throughput == pytest.approx(1e6) and fits["send"].max_rel_error < 1e-9


def test_profile_contention_section_round_trips_and_checks():
    data = load_profile("cpu").to_dict()
    data["contention"] = {"cores": 1.5, "engines": ["cube", "vector"], "overlap": 0.25}
    data["sources"]["contention"] = "test"
    p = parse_profile(data, "<test>")
    assert p.contention == Contention(1.5, ("cube", "vector"), 0.25)
    assert parse_profile(p.to_dict(), "<again>").contention == p.contention
    assert CostModel(p).contention == p.contention
    for bad, msg in (({"cores": 0}, "contention.cores"), ({"engines": ["tpu"]}, "engine kinds"), ({"engines": "cube"}, "engine kinds"),
                     ({"overlap": -1}, "contention.overlap"), ({"speed": 2}, "contention")):
        with pytest.raises(ConfigError, match=msg):
            parse_profile({**data, "contention": {**data["contention"], **bad}}, "<bad>")
    del data["sources"]["contention"]
    with pytest.raises(ConfigError, match="sources.contention"):
        parse_profile(data, "<unsourced>")
