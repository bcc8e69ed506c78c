"""The compiled event loop gives exactly the Python loop's schedule (the specification)."""
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megaloom.runtime import Cost, TaskGraph
from megaloom.runtime.errors import ScheduleError
from megaloom.scheduler import Simulator, fastpath, make_policy
from megaloom.scheduler.policies import _Keyed, upward_rank

from .graphs import ENGINES, timed_graph

needs_ext = pytest.mark.skipif(not fastpath.AVAILABLE, reason="the compiled extension megaloom.scheduler._fastsim "
                                                                "is not built (no C compiler at install time)")


class HalfPriority(_Keyed):
    """A user policy that only overrides ``keys``, with float keys and many ties."""

    name = "half"

    def keys(self, graph):
        return [t.priority / 2 for t in graph.tasks]


class TupleKeys(_Keyed):
    """Keys the C loop cannot compare: the Python loop must run."""

    name = "tuple"

    def keys(self, graph):
        return [(t.priority, -t.id) for t in graph.tasks]


KEYED = ["fifo", "priority", "critical_path", "rotated", "half"]


def policy(name):
    return HalfPriority() if name == "half" else make_policy(name)


@st.composite
def cases(draw):
    n = draw(st.integers(1, 60))
    spec, tags = [], []
    for i in range(n):
        preds = sorted(draw(st.sets(st.integers(0, i - 1), max_size=min(i, 4)))) if i else []
        spec.append((draw(st.sampled_from(ENGINES)), 0.0, preds))
        tags.append({"rank": draw(st.integers(0, 3)), "peer": draw(st.integers(0, 3))})
    prios = draw(st.lists(st.integers(-3, 3) | st.integers(-2 ** 40, 2 ** 40), min_size=n, max_size=n))
    g = timed_graph(spec, "fast", tags, prios)
    # a few control edges from later to earlier tasks (not forward-only; stays acyclic)
    for _ in range(draw(st.integers(0, 3))):
        a, b = draw(st.integers(0, n - 1)), draw(st.integers(0, n - 1))
        if a > b and not g.reaches(b, a):  # b waits for a; a must not depend on b
            g.edge(g.tasks[a], g.tasks[b])
    ties = st.sampled_from([0.0, 0.25, 0.5, 1.0, 1.5])
    dur = draw(st.lists(ties | st.floats(0, 10, allow_nan=False), min_size=n, max_size=n))
    engines = draw(st.permutations(ENGINES + ("spare",)))  # engine order decides dispatch order
    units = {e: draw(st.integers(1, 3)) for e in engines}
    return g, dur, units


@needs_ext
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(), name=st.sampled_from(KEYED))
def test_compiled_loop_equals_python_loop(case, name):
    g, dur, units = case
    fast, slow = Simulator("cpu", units, policy(name)), Simulator("cpu", units, policy(name), fast=False)
    a, b = fast.schedule(g, dur), slow.schedule(g, dur)
    assert (fast.last_loop, slow.last_loop) == ("compiled", "python")
    assert a.order == b.order
    assert a.unit == b.unit
    assert a.start == b.start
    assert [s + d for s, d in zip(a.start, a.duration)] == [s + d for s, d in zip(b.start, b.duration)]
    arrays = fast._simulate(g, dur)  # what run() puts in the trace
    assert fast.last_loop == "compiled" and [x.tolist() for x in arrays[:3]] == [a.start, a.unit, a.order]
    trace, python = fast.run(g, validate=False, durations=dur).trace, slow.run(g, validate=False, durations=dur).trace
    assert trace.events == python.events and fast.last_loop == "compiled"


@needs_ext
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(), data=st.data())
def test_compiled_upward_rank_equals_python(case, data):
    g, dur, _ = case
    odd = st.sampled_from([math.nan, math.inf, -0.0, -1.5, 2])  # ints, signed zeros, NaN, inf: same floats
    dur = [data.draw(odd) if data.draw(st.booleans()) else d for d in dur]
    assert list(map(repr, upward_rank(g, dur))) == list(map(repr, upward_rank(g, dur, compiled=False)))


@needs_ext
def test_traces_and_progress_calls_are_identical():
    spec = [(ENGINES[i % 3], (i % 5) / 4, [j for j in (i - 1, i - 7) if j >= 0]) for i in range(200)]
    g = timed_graph(spec, "chain", priorities=[i % 4 for i in range(200)])
    for name in KEYED:
        runs = []
        for fast in (True, False):
            calls = []
            sim = Simulator("ascend-910b", {"cube": 2, "vector": 3, "comm": 1}, policy(name),
                            progress=lambda d, t: calls.append((d, t)), progress_every=7, fast=fast)
            runs.append((sim.run(g).trace.events, calls, sim.last_loop))
        (ea, ca, la), (eb, cb, lb) = runs
        assert (la, lb) == ("compiled", "python")
        assert ea == eb and len(ea) == 200
        assert ca == cb and ca[-1] == (200, 200) and len(ca) > 20


@needs_ext
@pytest.mark.parametrize("name,dur", [("static", 1.0), ("expert_interleave", 1.0), ("tuple", 1.0), ("fifo", math.nan)])
def test_python_loop_when_the_compiled_one_does_not_apply(name, dur):
    g = timed_graph([("cube", 1.0, []), ("vector", 1.0, [0]), ("cube", 1.0, [0])], priorities=[0, 1, 2])
    sim = Simulator("cpu", {"cube": 1, "vector": 1}, TupleKeys() if name == "tuple" else make_policy(name))
    sim.schedule(g, [dur] * 3)
    assert sim.last_loop == "python"


@needs_ext
def test_errors_match_the_python_loop():
    g = TaskGraph("cyc")
    a = g.task("noop", name="a", engine="cube", cost=Cost())
    b = g.task("noop", name="b", engine="cube", cost=Cost(), after=[a])
    g.edge(b, a)
    for fast in (True, False):
        with pytest.raises(ScheduleError, match="stalled with 2 tasks left"):
            Simulator("cpu", {"cube": 1}, fast=fast).schedule(g, [1.0, 1.0])
    g2 = timed_graph([("dma", 1.0, [])])
    for fast in (True, False):
        with pytest.raises(ScheduleError, match="engine kinds \\['dma'\\] with no units"):
            Simulator("cpu", {"cube": 1}, fast=fast).schedule(g2, [1.0])


@needs_ext
def test_progress_errors_propagate():
    def boom(done, total):
        raise RuntimeError(f"stop at {done}/{total}")

    g = timed_graph([("cube", 1.0, [])] * 5)
    with pytest.raises(RuntimeError, match="stop at 0/5"):
        Simulator("cpu", {"cube": 1}, progress=boom, progress_every=1).schedule(g, [1.0] * 5)


def test_policy_classification():
    assert [fastpath.ready_order(policy(n)) for n in KEYED] == ["fifo", "keyed", "keyed", "keyed", "keyed"]
    assert fastpath.ready_order(make_policy("static")) is None
    assert fastpath.ready_order(make_policy("expert_interleave")) is None
