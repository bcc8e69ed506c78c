import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megaloom.runtime import Cost, Observer, TaskGraph
from megaloom.runtime.errors import ConfigError, ScheduleError
from megaloom.scheduler import POLICIES, Simulator, make_policy

from .graphs import random_dag, timed_graph

UNITS = st.fixed_dictionaries({"cube": st.integers(1, 3), "vector": st.integers(1, 3), "comm": st.integers(1, 2)})


def check_schedule(graph: TaskGraph, trace, units: dict[str, int]) -> None:
    ev = {e.task_id: e for e in trace.events}
    assert sorted(ev) == list(range(len(graph)))
    for tid, preds in enumerate(graph.pred):  # every dependency respected
        for p in preds:
            assert ev[tid].start >= ev[p].end, (graph.tasks[p].name, graph.tasks[tid].name)
    for e in trace.events:  # durations as given
        assert e.end - e.start == graph.tasks[e.task_id].attrs["duration"]
    # never more running tasks of one kind than units, never two on one unit
    for kind, n in units.items():
        mine = [e for e in trace.events if e.engine == kind]
        assert all(0 <= e.unit < n for e in mine)
        points = sorted([(e.start, 1) for e in mine if e.end > e.start] + [(e.end, -1) for e in mine if e.end > e.start])
        running = 0
        for _, d in points:  # ends sort before starts at the same instant
            running += d
            assert running <= n
        for u in range(n):
            spans = sorted((e.start, e.end) for e in mine if e.unit == u)
            assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10 ** 6), n=st.integers(1, 40), units=UNITS, policy=st.sampled_from(sorted(POLICIES)))
def test_random_dags_respect_deps_and_units_and_are_deterministic(seed, n, units, policy):
    g = random_dag(seed, n)
    first = Simulator("ascend-910b", units, make_policy(policy)).run(g).trace
    check_schedule(g, first, units)
    again = Simulator("ascend-910b", units, make_policy(policy)).run(random_dag(seed, n)).trace
    assert [tuple(vars_(e)) for e in first.events] == [tuple(vars_(e)) for e in again.events]


def vars_(e):
    return (e.task_id, e.task, e.engine, e.unit, e.start, e.end, tuple(e.deps))


def test_hand_computed_schedule():
    #  a(cube,1) -> b(vector,2) -> d(cube,1)
    #  a         -> c(vector,3) -> d
    g = timed_graph([("cube", 1.0, []), ("vector", 2.0, [0]), ("vector", 3.0, [0]), ("cube", 1.0, [1, 2])])
    one = Simulator("ascend-910b", {"cube": 1, "vector": 1}).run(g).trace
    assert [(e.task, e.start, e.end) for e in one.events] == [("t0", 0, 1), ("t1", 1, 3), ("t2", 3, 6), ("t3", 6, 7)]
    two = Simulator("ascend-910b", {"cube": 1, "vector": 2}).run(g).trace
    assert two.makespan == 5.0
    assert two.meta["mode"] == "simulate" and two.meta["clock"] == "virtual"
    assert two.meta["profile"] == "ascend-910b" and two.meta["units"]["vector"] == 2


def test_cost_model_durations_and_profile_units():
    g = TaskGraph("mm")
    x, w = g.input("x", (64, 64)), g.input("w", (64, 64))
    y = g.output("y", (64, 64))
    g.task("matmul", [x, w], [y])
    sim = Simulator("h100")
    ev = sim.run(g).trace.events[0]
    assert ev.end - ev.start == pytest.approx(sim.cost_model.duration(Cost(2 * 64 ** 3, 3 * 64 * 64 * 4), "cube"))
    assert sim.units == {"cube": 132, "vector": 132, "comm": 8}


def test_observers_and_progress():
    g = random_dag(3, 30)
    seen, calls = [], []

    class Rec(Observer):
        def on_run_start(self, graph, meta):
            seen.append(("start", meta["mode"]))

        def on_task(self, event):
            seen.append(event)

        def on_run_end(self, trace):
            seen.append(("end", len(trace.events)))

    res = Simulator("ascend-910b", {"cube": 1, "vector": 1, "comm": 1}, observers=[Rec()],
                    progress=lambda d, t: calls.append((d, t)), progress_every=7).run(g)
    assert seen[0] == ("start", "simulate") and seen[-1] == ("end", 30)
    ends = [e.end for e in seen[1:-1]]
    assert ends == sorted(ends) and len(ends) == 30
    assert calls[-1] == (30, 30) and len(calls) >= 4
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)
    assert res.outputs == {}


def test_errors():
    g = timed_graph([("cube", 1.0, []), ("dsp", 1.0, [0])])
    with pytest.raises(ScheduleError, match="dsp"):
        Simulator("ascend-910b").run(g, validate=False)
    with pytest.raises(ConfigError, match="units\\['cube'\\]"):
        Simulator("ascend-910b", {"cube": 0})
    cyc = timed_graph([("cube", 1.0, []), ("cube", 1.0, [0])])
    cyc.edge(cyc.tasks[1], cyc.tasks[0])
    with pytest.raises(ScheduleError, match="stalled with 2 tasks left"):
        Simulator("ascend-910b").run(cyc, validate=False)
    with pytest.raises(ScheduleError, match="2 durations"):
        Simulator("ascend-910b").schedule(timed_graph([("cube", 1.0, [])]), [1.0, 2.0])


def test_empty_graph():
    res = Simulator("cpu").run(TaskGraph("empty"))
    assert res.trace.events == [] and res.trace.makespan == 0.0


def test_schedule_matches_run_and_a_saved_graph_simulates_alike(tmp_path):
    g = random_dag(11, 40)
    sim = Simulator("ascend-910b", {"cube": 2, "vector": 2, "comm": 1})
    sched = sim.schedule(g)
    events = sim.run(g).trace.events
    assert [e.task_id for e in events] == sched.order
    assert [(e.start, e.unit) for e in events] == [(sched.start[t], sched.unit[t]) for t in sched.order]
    assert sched.makespan == max(e.end for e in events)
    g.save(str(tmp_path / "g.mlg"))
    loaded = TaskGraph.load(str(tmp_path / "g.mlg"))
    assert loaded.succ == g.succ  # no duplicated successor edges after a load
    assert [vars_(e) for e in sim.run(loaded).trace.events] == [vars_(e) for e in events]
