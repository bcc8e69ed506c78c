import pytest
import torch

from megaloom.runtime import ReferenceExecutor, ThreadExecutor
from megaloom.runtime.errors import ConfigError
from megaloom.scheduler import POLICIES, CostModel, Simulator, make_policy
from megaloom.scheduler.policies import StaticPolicy, upward_rank
from .graphs import real_graph, timed_graph


def order(graph, policy, units=None):
    trace = Simulator("ascend-910b", units or {"cube": 1, "vector": 1, "comm": 1}, policy).run(graph).trace
    return [e.task for e in sorted(trace.events, key=lambda e: (e.start, e.unit))]


def independent(n, engine="vector", **kw):
    return timed_graph([(engine, 1.0, [])] * n, **kw)


def test_fifo_and_priority():
    g = independent(4, priorities=[0, 5, 2, 5])
    assert order(g, "fifo") == ["t0", "t1", "t2", "t3"]
    assert order(g, "priority") == ["t1", "t3", "t2", "t0"]


def test_critical_path_runs_the_longest_chain_first():
    #  t0 (1)        t1 (1) -> t2 (5)
    g = timed_graph([("vector", 1.0, []), ("vector", 1.0, []), ("vector", 5.0, [1])])
    assert order(g, "fifo") == ["t0", "t1", "t2"]
    assert order(g, "critical_path") == ["t1", "t2", "t0"]
    assert upward_rank(g, [1.0, 1.0, 5.0]) == [1.0, 6.0, 5.0]


def test_critical_path_without_simulator_uses_a_cost_model():
    g = timed_graph([("vector", 1.0, []), ("vector", 1.0, []), ("vector", 5.0, [1])])
    p = make_policy("critical_path", cost_model=CostModel("h100"))
    p.prepare(g, {"vector": 1})
    for t in (0, 1):
        p.push(t)
    assert p.pop("vector", 0) == 1


def test_static_per_unit_queues_run_in_order():
    #  unit 0: t0 (3), t2 (1)      unit 1: t1 (1), t3 (1, after t0)
    g = timed_graph([("cube", 3.0, []), ("cube", 1.0, []), ("cube", 1.0, []), ("cube", 1.0, [0])])
    units = {"cube": 2}
    static = {e.task: (e.unit, e.start) for e in Simulator("ascend-910b", units, "static").run(g).trace.events}
    assert static == {"t0": (0, 0.0), "t1": (1, 0.0), "t2": (0, 3.0), "t3": (1, 3.0)}
    pooled = {e.task: e.start for e in Simulator("ascend-910b", units, "fifo").run(g).trace.events}
    assert pooled["t2"] == 1.0  # a shared pool lets t2 run early on the idle unit
    assert StaticPolicy.per_unit is True


def test_static_unit_waits_for_its_queue_head_even_when_a_later_task_is_ready():
    #  unit 0: t0 (3), t2 (1)      unit 1: t1 (1), t3 (1, after t0), t5 (1)      t4 on unit 0
    g = timed_graph([("cube", 3.0, []), ("cube", 1.0, []), ("cube", 1.0, []), ("cube", 1.0, [0]),
                     ("cube", 1.0, []), ("cube", 1.0, [])])
    units = {"cube": 2}
    static = {e.task: (e.unit, e.start) for e in Simulator("ascend-910b", units, "static").run(g).trace.events}
    # t5 is ready at 0 but queued behind t3, which waits for t0: unit 1 idles from 1 to 3
    assert static["t3"] == (1, 3.0) and static["t5"] == (1, 4.0)
    assert static["t4"] == (0, 4.0)
    p = make_policy("static")
    p.prepare(g, units)
    for tid in (1, 5):
        p.push(tid)
    assert p.pop("cube", 1) == 1 and p.pop("cube", 1) == -1  # head t3 not ready: t5 must wait
    assert not p.has_ready("cube")


def test_static_assignment_by_tag_and_balanced():
    g = timed_graph([("cube", 4.0, []), ("cube", 1.0, []), ("cube", 1.0, []), ("cube", 1.0, [])],
                    tags=[{}, {"unit": 3}, {}, {}])
    trace = Simulator("ascend-910b", {"cube": 2}, make_policy("static", assign="balanced")).run(g).trace
    assert [e.unit for e in sorted(trace.events, key=lambda e: e.task_id)] == [0, 1, 1, 1]
    with pytest.raises(ConfigError, match="assign"):
        make_policy("static", assign="random")


def test_expert_interleave_round_robin_over_groups():
    experts = [0, 0, 1, 1, 2, 2, 3, 3, 4, 5]
    g = independent(10, tags=[{"expert": e} for e in experts])
    got = order(g, make_policy("expert_interleave", group_size=2))
    groups = [experts[int(t[1:])] // 2 for t in got]
    assert groups == [0, 1, 2, 0, 1, 2, 0, 1, 0, 1]  # group 2 (experts 4, 5) runs dry first
    assert order(g, "fifo") == [f"t{i}" for i in range(10)]
    tagged = independent(3, tags=[{"group": 7}, {"group": 7}, {"group": 2}])
    assert order(tagged, make_policy("expert_interleave")) == ["t2", "t0", "t1"]
    with pytest.raises(ConfigError, match="group_size"):
        make_policy("expert_interleave", group_size=0)


@pytest.mark.parametrize("k,first", [(1, [2, 3, 0, 1]), (0, [1, 2, 3, 0]), (2, [3, 0, 1, 2])])
def test_rotated_peer_order(k, first):
    g = independent(4, engine="comm", tags=[{"rank": 1, "peer": p} for p in range(4)])
    got = order(g, make_policy("rotated", k=k))
    assert [g[t].tags["peer"] for t in got] == first


def test_make_policy_errors():
    with pytest.raises(ConfigError, match="unknown policy 'lifo'"):
        make_policy("lifo")
    with pytest.raises(ConfigError, match="bad options"):
        make_policy("priority", speed=3)
    p = make_policy("fifo")
    assert make_policy(p) is p


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_policies_drive_the_thread_executor(name):
    g = real_graph()
    inputs = {"x": torch.randn(32, 16), "w0": torch.randn(16, 16), "w1": torch.randn(16, 16)}
    ref = ReferenceExecutor().run(g, inputs)
    got = ThreadExecutor({"cube": 2, "vector": 2}, policy=make_policy(name), stall_timeout=10).run(g, inputs)
    torch.testing.assert_close(got["out"], ref["out"])
    assert len(got.trace.events) == len(g)
