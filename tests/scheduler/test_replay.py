import pytest
import torch

from megaloom.runtime import Trace, TraceEvent, ThreadExecutor, merge, metrics
from megaloom.runtime.errors import TraceFormatError
from megaloom.runtime.plugins import parse_spec
from megaloom.scheduler import Simulator, make_policy
from megaloom.scheduler.fidelity import fidelity, table
from megaloom.scheduler.replay import graph_from_events, replay
from .graphs import random_dag, real_graph, timed_graph

UNITS = {"cube": 2, "vector": 3, "comm": 1}


def placement(trace):
    return sorted((e.task_id, e.engine, e.unit, e.start, e.end) for e in trace.events)


@pytest.mark.parametrize("policy", ["fifo", "critical_path", "static", "expert_interleave:group_size=2", "rotated"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_replay_reproduces_the_recorded_run(tmp_path, policy, seed):
    name, opts = parse_spec(policy)
    make = lambda: make_policy(name, **opts)  # noqa: E731
    recorded = Simulator("ascend-910b", UNITS, make()).run(random_dag(seed, 60)).trace
    recorded.save(tmp_path / "run.mlt")
    loaded = Trace.load(tmp_path / "run.mlt")
    again = replay(loaded, policy=make()).trace
    assert again.makespan == recorded.makespan
    assert placement(again) == placement(recorded)
    assert again.meta["mode"] == "replay" and again.meta["units"] == {**again.meta["units"], **UNITS}


def test_replay_under_other_units_and_policy():
    #  t0 (cube 1) -> t1, t2, t3 (vector 2 each)
    g = timed_graph([("cube", 1.0, []), ("vector", 2.0, [0]), ("vector", 2.0, [0]), ("vector", 2.0, [0])])
    recorded = Simulator("ascend-910b", {"cube": 1, "vector": 3}).run(g).trace
    assert recorded.makespan == 3.0
    assert replay(recorded, units={"vector": 1}).trace.makespan == 7.0
    assert replay(recorded, units={"vector": 2}, policy="critical_path").trace.makespan == 5.0
    text = table(fidelity(recorded, replay(recorded, units={"vector": 1}).trace))
    assert "makespan" in text and "+133.33%" in text and "busy vector" in text and "exposed comm" in text


def test_replay_of_an_executed_trace_keeps_measured_durations():
    g = real_graph()
    inputs = {"x": torch.randn(32, 16), "w0": torch.randn(16, 16), "w1": torch.randn(16, 16)}
    recorded = ThreadExecutor({"cube": 2, "vector": 2}).run(g, inputs).trace
    again = replay(recorded).trace
    assert again.meta["profile"] == "cpu" and again.meta["units"]["cube"] == 2
    a, b = metrics(recorded), metrics(again)
    for k in a.busy:
        assert b.busy[k] == pytest.approx(a.busy[k], rel=1e-9)
    assert b.critical_path == pytest.approx(a.critical_path, rel=1e-9)
    assert b.makespan <= a.makespan * 1.0000001  # no dispatch gaps in the replay


def test_starts_are_compared_from_each_trace_origin():
    """A wall-clock recording starts wherever the clock stood (perf_counter: hours); its replay starts at 0."""
    import dataclasses

    sim = Simulator("ascend-910b", UNITS).run(random_dag(4, 40)).trace
    wall = Trace([dataclasses.replace(e, start=e.start + 12345.0, end=e.end + 12345.0) for e in sim.events],
                 {**sim.meta, "clock": "wall"})
    f = fidelity(wall, replay(wall).trace)
    assert f.on_time == 1.0 and f.worst_start < 1e-9
    assert "largest difference 0.0 us" in table(f)
    g = real_graph()
    inputs = {"x": torch.randn(32, 16), "w0": torch.randn(16, 16), "w1": torch.randn(16, 16)}
    recorded = ThreadExecutor({"cube": 2, "vector": 2}).run(g, inputs).trace
    assert min(e.start for e in recorded.events) > 0  # the executor's clock is not the run's
    assert fidelity(recorded, replay(recorded).trace).worst_start <= recorded.makespan


def test_replay_of_merged_ranks_keeps_them_apart():
    runs = []
    for rank in (0, 1):
        t = Simulator("ascend-910b", UNITS).run(random_dag(10 + rank, 20)).trace
        for e in t.events:
            e.rank = rank
        runs.append(t)
    merged = merge(runs)
    again = replay(merged).trace
    assert again.ranks == [0, 1] and again.meta["world_size"] == 2
    assert placement(Trace([e for e in again.events if e.rank == 1])) == placement(runs[1])


def test_bad_traces():
    e = TraceEvent(0, "a", "noop", "cube", 0, 0, 0.0, 1.0)
    with pytest.raises(TraceFormatError, match="task id 0"):
        graph_from_events([e, TraceEvent(0, "b", "noop", "cube", 0, 0, 0.0, 1.0)])
    g = graph_from_events([e, TraceEvent(1, "b", "mystery_op", "dsp", 0, 0, 1.0, 3.0, deps=[0, 7])])
    assert g.pred == [[], [0]] and g.tasks[1].attrs["duration"] == 2.0  # untraced dep 7 dropped
    assert replay(Trace([e, TraceEvent(1, "b", "mystery_op", "dsp", 0, 0, 1.0, 3.0, deps=[0])])).trace.makespan == 3.0
