"""Columnar traces against the event lists they replace, and executors' cached dispatch plans."""
import threading

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from megaloom.runtime import ReferenceExecutor, TaskGraph, ThreadExecutor, Trace, TraceEvent, merge, metrics
from megaloom.runtime.metrics import COMPUTE, critical_path, intersect, measure, union
from megaloom.runtime.perfetto import to_chrome
from megaloom.runtime.record import events_of
from megaloom.runtime.trace import Columns
from megaloom.scheduler import Simulator
from megaloom.scheduler.simulator import task_durations
from .test_properties import SETTINGS, graphs, written_rows


def _old_events(graph: TaskGraph, trace: Trace) -> list[TraceEvent]:
    """The events as the recorder built them before traces were columns: one per record."""
    c = trace.columns
    recs = zip(c.column("task_id"), c.column("unit"), c.column("start"), c.column("end"))
    return events_of(graph, recs, trace.meta.get("rank", 0))


def _old_figures(events: list[TraceEvent]) -> tuple:
    """Busy time, comm time, comm hidden and overlap of one rank's events, event by event."""
    busy: dict[str, float] = {}
    for e in events:
        busy[e.engine] = busy.get(e.engine, 0.0) + e.duration
    per = {k: union([(e.start, e.end) for e in events if e.engine == k]) for k in {e.engine for e in events}}
    compute = union([iv for k in COMPUTE for iv in per.get(k, [])])
    comm = per.get("comm", [])
    return busy, measure(comm), intersect(comm, compute), intersect(per.get("cube", []), per.get("vector", []))


def _check_against_events(graph: TaskGraph, trace: Trace) -> None:
    old = _old_events(graph, trace)
    m = metrics(trace)
    busy, comm, hidden, overlap = _old_figures(old)
    assert m.busy == busy and m.comm_time == comm and m.cube_vector_overlap == overlap
    assert m.comm_hidden == (hidden / comm if comm > 0 else 0.0)
    assert m.critical_path == critical_path(old) and m.tasks == len(old)
    assert to_chrome(trace) == to_chrome(Trace(old, trace.meta))
    assert trace.events == old  # made from the columns on first read


@SETTINGS
@given(graphs(), st.sampled_from(["fifo", "expert_interleave", "critical_path"]))
def test_simulated_columns_equal_the_event_lists(case, policy):
    g, _ = case
    _check_against_events(g, Simulator("ascend-910b", {"cube": 2, "vector": 1, "comm": 1}, policy).run(g).trace)


@SETTINGS
@given(graphs())
def test_executed_columns_equal_the_event_lists(case):
    g, inputs = case
    _check_against_events(g, ThreadExecutor({"cube": 1, "vector": 2, "comm": 1}).run(g, inputs).trace)


_events = st.lists(st.builds(
    TraceEvent, task_id=st.integers(0, 40), task=st.text(max_size=3), op=st.sampled_from(["matmul", "add", "x"]),
    engine=st.sampled_from(["cube", "vector", "comm", "host"]), unit=st.integers(0, 3), rank=st.integers(0, 2),
    start=st.floats(0, 10), end=st.floats(10, 20), flops=st.floats(0, 1e9), bytes=st.integers(0, 10**6),
    comm_bytes=st.floats(0, 1e6), deps=st.lists(st.integers(0, 40), max_size=3),
    tags=st.dictionaries(st.sampled_from(["expert", "cpu", "delay"]), st.integers(0, 9), max_size=2),
    precision=st.sampled_from(["fp32", "bf16"])), max_size=30)


@SETTINGS
@given(_events, _events)
def test_columns_of_events_round_trip_and_merge_alike(tmp_path_factory, a, b):
    assert Columns.of_events(a).events() == a
    p = tmp_path_factory.mktemp("cols") / "t.mlt"
    Trace(a, {"graph": "g"}).save(p)
    back = Trace.load(p)
    assert back._events is None and back.events == a  # stored by column, events made on demand
    by_columns = merge([Trace(meta={}, columns=Columns.of_events(x)) for x in (a, b)])
    assert by_columns.events == merge([Trace(list(a), {}), Trace(list(b), {})]).events
    if a:
        c = Trace(meta={}, columns=Columns.of_events(a))
        assert c.makespan == max(e.end for e in a) - min(e.start for e in a) and c.ranks == sorted({e.rank for e in a})


def test_edits_to_events_show_in_the_trace(tmp_path):
    g = TaskGraph("t")
    x, y = g.input("x", (2, 2)), g.output("y", (2, 2))
    g.task("copy", [x], [y])
    trace = ReferenceExecutor().run(g, {"x": torch.ones(2, 2)}).trace
    trace.events[0].end = trace.events[0].start + 5.0
    assert metrics(trace).busy["vector"] == 5.0 and trace.makespan == 5.0
    trace.save(tmp_path / "t.mlt")
    assert Trace.load(tmp_path / "t.mlt").events[0].end == trace.events[0].end


def test_simulator_durations_equal_the_cost_models():
    from ..scheduler.graphs import real_graph
    from ..scheduler.test_golden import GRAPHS
    sim = Simulator("ascend-910b")
    for g in [real_graph()] + [make() for make in GRAPHS.values()]:
        g.tasks[0].attrs["duration"] = 1e-3  # a measured duration wins
        for t in g.tasks[1::5]:
            t.tags["link"] = "inter"
        assert task_durations(sim.cost_model, g).tolist() == sim.cost_model.durations(g)


# -- cached dispatch plans ---------------------------------------------------------------
def _chain(n: int, d: int) -> TaskGraph:
    g = TaskGraph(f"chain{d}")
    x, w, b = g.input("x", (d, d)), g.input("w", (d, d)), g.input("b", (d, d))
    h, y = g.buffer("h", (2 * d, d)), g.output("y", (d, d))
    src = x
    for i in range(n):
        dst = y if i == n - 1 else h[(i % 2) * d:(i % 2 + 1) * d, :]
        g.task("matmul" if i % 3 else "add", [src, w if i % 3 else b], [dst])
        src = dst
    return g


def _inputs(d: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(d, d, generator=gen), "w": torch.linalg.qr(torch.randn(d, d, generator=gen))[0],
            "b": torch.randn(d, d, generator=gen) / d}


@pytest.mark.parametrize("units", [{"cube": 1, "vector": 1}, {"cube": 2, "vector": 2}])
def test_cached_plans_equal_the_reference_on_new_inputs_and_shapes(units):
    ex, ref = ThreadExecutor(units), ReferenceExecutor()
    for d in (4, 8, 4):  # a graph of other shapes gets its own plan; the first one's stays
        g = _chain(12, d)
        plans = []
        for seed in range(4):
            inputs = _inputs(d, seed)
            got, want = ex.run(g, inputs), ref.run(g, inputs)
            torch.testing.assert_close(got["y"], want["y"], rtol=1e-5, atol=1e-5)
            plans.append(next(p for k, p in g.cached("dispatch_plans", dict).items() if k[0].__name__ == "kernel_call"))
            assert got["y"] is not plans[-1].scratch.get("y")  # outputs are the caller's, new each run
        assert all(p is plans[0] for p in plans)  # built once, reused by every run
        g.task("copy", [g.buffers["y"]], [g.buffers["h"][0:d, :]])  # a changed graph: a new plan
        g.task("copy", [g.buffers["h"][0:d, :]], [g.buffers["y"]])
        inputs = _inputs(d, 9)
        torch.testing.assert_close(ex.run(g, inputs)["y"], ref.run(g, inputs)["y"], rtol=1e-5, atol=1e-5)
        assert all(p is not plans[0] for p in g.cached("dispatch_plans", dict).values())


def test_concurrent_runs_of_one_graph_do_not_share_scratch():
    g = _chain(30, 8)
    ex = ThreadExecutor({"cube": 1, "vector": 1})
    want = {s: ReferenceExecutor().run(g, _inputs(8, s))["y"] for s in range(4)}
    got: dict[int, torch.Tensor] = {}

    def run(seed: int) -> None:
        got[seed] = ex.run(g, _inputs(8, seed))["y"]
    threads = [threading.Thread(target=run, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s in range(4):
        torch.testing.assert_close(got[s], want[s], rtol=1e-5, atol=1e-5)


def test_plan_keeps_no_caller_tensor_and_follows_a_re_registered_op():
    from megaloom.runtime.registry import OpDef, get_op, register
    g = _chain(4, 4)
    inputs = _inputs(4, 0)
    ThreadExecutor().run(g, inputs)
    plan = next(iter(g.cached("dispatch_plans", dict).values()))
    assert all(lst[i] is None for _, views in plan.slots for _, places in views for lst, i in places)
    add = get_op("add")
    try:
        register(OpDef("add", add.engines, torch.sub, add.shape, add.cost, None), replace=True)
        got = ThreadExecutor().run(g, inputs)["y"]
        torch.testing.assert_close(got, ReferenceExecutor().run(g, inputs)["y"])
    finally:
        register(add, replace=True)


def test_reference_executor_reuses_its_plan_with_new_inputs():
    from megaloom.runtime.executors import drop_plans
    g = _chain(6, 4)
    outs = [ReferenceExecutor().run(g, _inputs(4, s)) for s in range(3)]
    assert len(g.cached("dispatch_plans", dict)) == 1
    drop_plans(g)
    assert not g.cached("dispatch_plans", dict)
    outs.append(ReferenceExecutor().run(g, _inputs(4, 2)))
    assert torch.equal(outs[3]["y"], outs[2]["y"])
    assert not torch.equal(outs[0]["y"], outs[1]["y"])
    assert np.array_equal(outs[2]["y"].numpy(), ReferenceExecutor().run(g, _inputs(4, 2))["y"].numpy())


@pytest.mark.parametrize("executor", [ReferenceExecutor, ThreadExecutor])
def test_bad_inputs_keep_the_plan_and_start_no_run(executor):
    from megaloom.runtime import ExecutionError, Observer

    class Starts(Observer):
        runs = 0

        def on_run_start(self, graph, meta):
            self.runs += 1
    seen = Starts()
    g = _chain(4, 4)
    ex = executor(observers=[seen])
    ex.run(g, _inputs(4, 0))
    plan = next(iter(g.cached("dispatch_plans", dict).values()))
    with pytest.raises(ExecutionError, match="input 'w' is"):
        ex.run(g, {**_inputs(4, 1), "w": torch.ones(3, 3)})
    assert seen.runs == 1 and next(iter(g.cached("dispatch_plans", dict).values())) is plan
    torch.testing.assert_close(ex.run(g, _inputs(4, 2))["y"], ReferenceExecutor().run(g, _inputs(4, 2))["y"])


def test_a_trace_keeps_its_deps_and_tags_when_the_graph_changes_later():
    g = _chain(3, 4)
    trace = ReferenceExecutor().run(g, _inputs(4, 0)).trace
    before = [(list(e.deps), dict(e.tags)) for e in Trace(meta={}, columns=trace.columns).events]
    g.tasks[2].tags["late"] = 1
    g.edge(g.tasks[0], g.tasks[2])
    assert [(e.deps, e.tags) for e in trace.events] == before
