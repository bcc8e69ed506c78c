"""The run recorder: one meta layout, one observer protocol and one stall error for every executor."""
import gc

import pytest
import torch

import megaloom.ops  # noqa: F401  (registers the built-in ops)
from megaloom.runtime import (
    Cost, DeadlockError, ExecutionError, Observer, ReferenceExecutor, ScheduleError, TaskGraph, ThreadExecutor,
)
from megaloom.runtime.core import Core
from megaloom.runtime.record import Recorder, gc_paused
from megaloom.scheduler import Simulator


def _chain() -> TaskGraph:
    g = TaskGraph("chain")
    x, h, y = g.input("x", (4, 4)), g.buffer("h", (4, 4)), g.output("y", (4, 4))
    g.task("silu", [x], [h], name="a")
    g.task("copy", [h], [y], name="b")
    return g


class Log(Observer):
    def __init__(self):
        self.calls = []

    def on_run_start(self, graph, meta):
        self.calls.append(("start", graph.name, dict(meta)))

    def on_task(self, event):
        self.calls.append(("task", event.task))

    def on_run_end(self, trace):
        self.calls.append(("end", len(trace.events)))


@pytest.mark.parametrize("make, mode, clock", [
    (lambda o: ReferenceExecutor(observers=[o]), "reference", "wall"),
    (lambda o: ThreadExecutor(observers=[o]), "execute", "wall"),
    (lambda o: Simulator("cpu", observers=[o]), "simulate", "virtual"),
])
def test_every_executor_records_alike(make, mode, clock):
    g, log = _chain(), Log()
    ex = make(log)
    res = ex.run(g, {"x": torch.randn(4, 4)}) if mode != "simulate" else ex.run(g)
    meta = res.trace.meta
    assert list(meta)[:6] == ["graph", "mode", "clock", "units", "rank", "world_size"]
    assert (meta["graph"], meta["mode"], meta["clock"], meta["rank"], meta["world_size"]) == ("chain", mode, clock, 0, 1)
    assert log.calls[0] == ("start", "chain", meta)
    assert log.calls[1:] == [("task", "a"), ("task", "b"), ("end", 2)]
    assert [e.task for e in res.trace.events] == ["a", "b"]


def test_recorder_replays_in_completion_order():
    g, log = _chain(), Log()
    rec = Recorder(g, [log], mode="simulate", clock="virtual", units={"vector": 2}, policy="fifo")
    trace = rec.finish([(1, 0, 0.0, 3.0), (0, 1, 0.0, 2.0)], replay=True)
    assert [e.task for e in trace.events] == ["b", "a"]  # record order
    assert log.calls[1:] == [("task", "a"), ("task", "b"), ("end", 2)]  # completion order
    assert trace.meta["policy"] == "fifo" and trace.meta["units"] == {"vector": 2}


def test_recorder_keeps_task_records_unless_told():
    g, log = _chain(), Log()
    rec = Recorder(g, [log], mode="reference", clock="wall", units={"vector": 1})
    rec.task(0, 0, 0.0, 1.0)
    rec.task(1, 0, 1.0, 2.0, keep=False)
    assert rec.records == [(0, 0, 0.0, 1.0)]
    assert [c for c in log.calls if c[0] == "task"] == [("task", "a"), ("task", "b")]
    assert [e.task for e in rec.finish().events] == ["a"]


def _cycle() -> TaskGraph:
    g = TaskGraph("loop")
    a = g.task("noop", name="a", engine="cube", cost=Cost())
    b = g.task("noop", name="b", engine="cube", cost=Cost(), after=[a])
    a.succeed(b)
    return g


def test_one_stall_error_for_simulator_and_core():
    for fast in (True, False):
        with pytest.raises(DeadlockError) as info:
            Simulator("cpu", fast=fast).run(_cycle(), validate=False)
        err = info.value
        assert isinstance(err, ScheduleError) and isinstance(err, ExecutionError)
        assert err.blocked == {"a": ["b"], "b": ["a"]}
        assert "stalled with 2 tasks left" in str(err) and "a waits for b" in str(err)
    core = Core(_cycle(), {"cube": 1})
    err = core.deadlock("why", shown=1)
    assert str(err) == "why:\n  a waits for b\n  ... and 1 more" and err.blocked == {"a": ["b"], "b": ["a"]}


def test_gc_paused_restores_the_collector():
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
    with gc_paused(False):
        assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # it was off before: stays off
    finally:
        gc.enable()


def test_perfetto_observer_writes_every_run(tmp_path):
    import json

    from megaloom.runtime.perfetto import PerfettoObserver, to_chrome

    obs = PerfettoObserver(tmp_path / "{graph}-{run}.json")
    ex = ReferenceExecutor(observers=[obs])
    first = ex.run(_chain(), {"x": torch.randn(4, 4)})
    Simulator("cpu", observers=[obs]).run(_chain())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chain-0.json", "chain-1.json"]
    doc = json.loads((tmp_path / "chain-0.json").read_text())
    assert doc == json.loads(json.dumps(to_chrome(first.trace)))
    assert [e["name"] for e in doc["traceEvents"] if e["ph"] == "X"] == ["a", "b"]
