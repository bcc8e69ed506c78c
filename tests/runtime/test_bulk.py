"""TaskGraph.from_arrays against the task-by-task builder, the columns behind every graph,
errors that name the task at fault, and validation that happens once per graph version."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import megaloom.ops  # noqa: F401
from megaloom.runtime import Cost, GraphError, ReferenceExecutor, TaskGraph
from megaloom.runtime import validate as validate_module
from megaloom.runtime.bulk import split_rows
from megaloom.runtime.serialize import graph_to_dict
from megaloom.scheduler import Simulator

OPS = ["noop", "matmul", "silu"]
ENGINES = ["cube", "vector", "comm"]
COSTS = [None, Cost(flops=2e6, bytes=1e4, precision="bf16"), Cost(bytes=3e5), Cost(comm_bytes=1e5)]


@st.composite
def columns(draw, backward: bool = False):
    """Per-task op, engine and cost codes, priorities, maybe names, and predecessor lists (with
    repeats and in any order; ``backward``: edges to later tasks too, acyclic by a hidden order)."""
    n = draw(st.integers(0, 30))
    rank = draw(st.permutations(range(n))) if backward else list(range(n))  # rank[i]: position in a valid order
    preds = []
    for b in range(n):
        earlier = [a for a in range(n) if rank[a] < rank[b]]
        preds.append(draw(st.lists(st.sampled_from(earlier), max_size=5)) if earlier else [])
    op = draw(st.lists(st.integers(0, len(OPS) - 1), min_size=n, max_size=n))
    cost = [c if c or OPS[o] == "noop" else 1
            for o, c in zip(op, draw(st.lists(st.integers(0, len(COSTS) - 1), min_size=n, max_size=n)))]
    engine = draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))
    prio = draw(st.lists(st.integers(-3, 3), min_size=n, max_size=n))
    names = [f"t{i}" if draw(st.booleans()) else f"{OPS[o]}#{i}" for i, o in enumerate(op)] \
        if draw(st.booleans()) else None
    return op, engine, cost, prio, names, preds


def built_by_tasks(op, engine, cost, prio, names, preds, backward: bool) -> TaskGraph:
    g = TaskGraph("g")
    for i in range(len(op)):
        g.task(OPS[op[i]], name=None if names is None else names[i], engine=ENGINES[engine[i]], cost=COSTS[cost[i]],
               priority=prio[i], after=[] if backward else [g.tasks[a] for a in preds[i]])
    if backward:  # every edge after every task, into earlier tasks too
        for b, ps in enumerate(preds):
            for a in ps:
                g.edge(g.tasks[a], g.tasks[b])
    return g


def csr(preds):
    ptr = np.zeros(len(preds) + 1, np.int64)
    np.cumsum([len(p) for p in preds], out=ptr[1:])
    return ptr, np.array([a for p in preds for a in p], np.int64)


def assert_same(g: TaskGraph, h: TaskGraph):
    assert graph_to_dict(g) == graph_to_dict(h)  # tasks (name, op, engine, cost, priority, attrs, tags), edges
    assert g.pred == h.pred and g.succ == h.succ and g.forward_only == h.forward_only
    a, b = g.arrays(), h.arrays()
    for field in a.__dataclass_fields__:
        x, y = getattr(a, field), getattr(b, field)
        assert (x.tolist() if isinstance(x, np.ndarray) else x) == (y.tolist() if isinstance(y, np.ndarray) else y)
    assert [t.name for t in g.tasks] == [t.name for t in h.tasks]
    assert all(g[t.name] is t for t in g.tasks)


@settings(max_examples=60, deadline=None)
@given(columns(), st.booleans())
def test_array_built_graph_equals_the_builders(cols, coded):
    op, engine, cost, prio, names, preds = cols
    g = built_by_tasks(*cols, backward=False)
    n = len(op)
    form = (lambda table, codes: (table, np.array(codes, np.int32))) if coded \
        else (lambda table, codes: [table[c] for c in codes])
    h = TaskGraph.from_arrays(form(OPS, op), csr(preds) if coded else preds, engines=form(ENGINES, engine),
                              costs=form(COSTS, cost), priorities=np.array(prio), names=names, name="g")
    assert len(h) == n
    assert_same(g, h)
    r = TaskGraph.from_dict(h.to_dict())  # serialisation round trip
    assert graph_to_dict(r) == graph_to_dict(h) and r.succ == h.succ
    sim = Simulator("ascend-910b", policy="fifo")
    s, t = sim.schedule(g), sim.schedule(h)
    assert (s.start, s.duration, s.unit, s.order) == (t.start, t.duration, t.unit, t.order)


@settings(max_examples=40, deadline=None)
@given(columns(backward=True))
def test_edges_into_earlier_tasks_match_the_builders_lists(cols):
    op, engine, cost, prio, names, preds = cols
    g = built_by_tasks(*cols, backward=True)  # edge() into earlier tasks: the builder's edges become lists
    h = TaskGraph.from_arrays((OPS, op), csr(preds), engines=(ENGINES, engine), costs=(COSTS, cost),
                              priorities=prio, names=names, name="g")
    assert_same(g, h)
    order = h.topological_order()
    pos = {t: k for k, t in enumerate(order)}
    assert all(pos[a] < pos[b] for b, ps in enumerate(preds) for a in ps)


def test_a_graph_built_from_arrays_grows_with_the_builder():
    g = TaskGraph.from_arrays("noop", [[], [0], [0, 1]], engines=["cube", "vector", "cube"])
    assert [t.name for t in g.tasks] == ["noop#0", "noop#1", "noop#2"] and g.engines() == ["cube", "vector"]
    t = g.task("noop", name="last", after=[g["noop#2"]])
    u = g.task("noop")
    assert g["noop#4"] is u and t.predecessors == [g.tasks[2]] and g.tasks[0].successors == g.tasks[1:3]
    g.edge(u, t)  # into an earlier task: a backward edge
    assert not g.forward_only and g.pred[3] == [2, 4] and g.succ[4] == [3]
    assert g.topological_order().index(4) < g.topological_order().index(3)
    with pytest.raises(GraphError, match="'noop#1' is used twice"):
        g.task("noop", name="noop#1")
    with pytest.raises(GraphError, match="has no task 'noop#9'"):
        g["noop#9"]
    assert g.validate().validated


def test_columns_are_kept_only_for_tasks_that_have_them():
    g = TaskGraph("g")
    x, y = g.input("x", (4,)), g.output("y", (4,))
    a = g.task("copy", [x], [y])
    b = g.task("noop", attrs={"k": 1}, tags={"stage": "fwd"}, priority=2)
    assert g._io.keys() == {0} and g._attrs.keys() == {1} and g._tags.keys() == {1} and g._prio == {1: 2}
    assert a.attrs == {} and a.tags == {} and a.priority == 0 and b.inputs == () and b.cost is None
    assert 0 not in g._attrs and 0 not in g._tags  # reading empty attrs and tags stores nothing
    tags = a.tags
    tags["stage"] = "bwd"  # a task's own dict: stored on its first change
    tags.update(k=2)
    assert g.tasks[0].tags == {"stage": "bwd", "k": 2} and g._tags[0] is tags and g._names is None
    arr = g.arrays()
    assert arr is g.arrays() and not arr.op.flags.writeable
    g.task("noop")
    assert g.arrays() is not arr and len(g.arrays().op) == 3


@pytest.mark.parametrize("preds, message", [
    ((np.array([0, 0, 2]), np.array([0, 7])), "task 'noop#1' waits for task id 7, but the graph has 2 tasks"),
    ([[], [-1]], "task 'noop#1' waits for task id -1"),
    ([[], [1]], "task 'noop#1' cannot wait for itself"),
    ((np.array([0, 2, 1]), np.array([0])), "indptr must start at 0, never decrease"),
    ((np.array([0, 1]), np.array([0.5])), "1-d integer arrays"),
    ("01", "give \\(indptr, indices\\)"),
    ([[], [0.0]], "1-d integer arrays"),
    ([[], 0], "one sequence of task ids per task"),
])
def test_bad_predecessors_name_the_task(preds, message):
    with pytest.raises(GraphError, match=message):
        TaskGraph.from_arrays("noop", preds)


def test_a_cycle_in_the_arrays_is_named():
    with pytest.raises(GraphError, match="cycle in graph 'c'") as e:
        TaskGraph.from_arrays("noop", [[2], [0], [1], []], names=["a", "b", "c", "d"], name="c")
    assert set(e.value.cycle) == {"a", "b", "c"} and "d" not in e.value.tasks


@pytest.mark.parametrize("kw, message", [
    (dict(ops=(["noop"], [0, 1])), "ops: task 1 has code 1, outside the table of 1"),
    (dict(ops=["noop"]), "ops: 1 values for 2 tasks"),
    (dict(ops=([3], [0, 0])), "ops: task 0 has 3, not a name"),
    (dict(ops=[["noop"], ["noop"]]), "ops: one name per task expected"),
    (dict(engines=(["cube"], [0.0, 1.0])), "engines: codes must be 2 integers"),
    (dict(costs=[Cost(), 3]), "costs: 3 is not a Cost"),
    (dict(priorities=[0.5, 1]), "priorities: 2 integers expected"),
    (dict(names=["a", "a"]), "task name 'a' is used twice"),
])
def test_bad_columns_are_named(kw, message):
    kw = {"ops": "noop", **kw}
    with pytest.raises(GraphError, match=message):
        TaskGraph.from_arrays(preds=[[], [0]], **kw)


def test_duplicate_predecessors_count_once():
    g = TaskGraph.from_arrays("noop", [[], [0, 0], [1, 0, 1]])
    assert g.pred == [[], [0], [1, 0]] and g.succ == [[1, 2], [2], []]


def test_validation_happens_once_per_graph_version(monkeypatch):
    calls = []
    rules = [(rule, lambda g, check=check, rule=rule: calls.append(rule) or check(g))
             for rule, check in validate_module.RULES]
    monkeypatch.setattr(validate_module, "RULES", rules)
    g = TaskGraph("g")
    x, y = g.input("x", (4,)), g.output("y", (4,))
    g.task("copy", [x], [y])
    assert not g.validated
    ex = ReferenceExecutor()
    for _ in range(3):
        ex.run(g, {"x": torch.arange(4.0)})  # each run asks validate(): checked the first time only
    assert g.validated and len(calls) == len(rules)
    g.task("noop")  # a change: checked again on the next run
    assert not g.validated
    g.validate().validate()
    assert len(calls) == 2 * len(rules)


def test_an_array_built_graph_validates_in_linear_time():
    n = 300_000
    rng = np.random.default_rng(0)
    k = rng.integers(0, 3, n)
    k[:2] = 0
    ptr = np.concatenate([[0], np.cumsum(k)])
    idx = np.repeat(np.arange(n), k) - 1 - rng.integers(0, 2, ptr[-1])  # one or two tasks back
    g = TaskGraph.from_arrays((["noop"], np.zeros(n, np.int8)), (ptr, idx), engines=(ENGINES, rng.integers(0, 3, n)))
    t0 = time.perf_counter()
    g.validate()
    assert time.perf_counter() - t0 < 15.0  # about 0.05 s: a few passes over the columns
    bad = TaskGraph.from_arrays((["noop", "nope"], (np.arange(n) == n - 1).astype(np.int8)), (ptr, idx))
    with pytest.raises(GraphError, match=f"task 'nope#{n - 1}': unknown op 'nope'"):
        bad.validate()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.lists(st.integers(0, 40), max_size=3), st.booleans()), max_size=25))
def test_edges_read_during_the_build_stay_in_step(steps):
    """Each step adds a task waiting for some earlier ones (0), adds edges between existing
    tasks, into earlier ones too (1), or neither (2); ``peek`` reads ``pred``/``succ`` then, which
    makes the lists kept up to date from there on. Reading or not, the edges come out the same,
    and ``arrays()`` says what the lists say."""
    graphs = [TaskGraph("a"), TaskGraph("b")]
    for g in graphs:
        for kind, ids, peek in steps:
            n = len(g)
            if kind == 0 or n < 2:
                g.task("noop", after=[g.tasks[i % n] for i in ids] if n else [])
            elif kind == 1:
                for i, j in zip(ids, ids[1:]):
                    if i % n != j % n and not g.reaches(j % n, i % n):  # keep it acyclic
                        g.edge(g.tasks[i % n], g.tasks[j % n])
            if peek and g is graphs[0]:
                assert len(g.pred) == len(g.succ) == len(g)
    a, b = graphs
    assert a.pred == b.pred and a.succ == b.succ and a.forward_only == b.forward_only
    arr = b.arrays()
    assert split_rows(arr.pred_ptr, arr.pred_idx) == a.pred and split_rows(arr.succ_ptr, arr.succ_idx) == a.succ
    assert [list(a.preds_of(i)) for i in range(len(a))] == [list(b.preds_of(i)) for i in range(len(b))] == a.pred
