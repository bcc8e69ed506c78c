"""Fuzzed trace (.mlt) and graph (.mlg) files: loading them and everything downstream
(metrics, summary, Perfetto export, replay, validation, simulation) raises only megaloom's
errors, never a raw TypeError, OverflowError, MemoryError or a hang."""
from __future__ import annotations

import math

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import megaloom.ops  # noqa: F401
from megaloom.runtime import MegaloomError, TaskGraph, Trace
from megaloom.runtime.metrics import summary
from megaloom.runtime.perfetto import to_chrome
from megaloom.runtime.trace import TRACE_FORMAT, TRACE_VERSION, TraceEvent, _COLUMNS

_leaf = (st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=4)
         | st.sampled_from([0, 1, -1, 2**31, 2**62, 10**12, math.inf, -math.inf, math.nan, 1e300, "", "cube", []]))
_values = st.recursive(_leaf, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.text(max_size=4) | st.integers(0, 3), inner, max_size=3), max_leaves=8)


def _trace_dict() -> dict:
    events = [
        TraceEvent(0, "a", "matmul", "cube", 0, 0, 0.0, 1.5, 10.0, 20.0, 0.0, [], {"expert": 1}, "bf16"),
        TraceEvent(1, "b", "copy", "comm", 1, 0, 0.25, 2.0, 0.0, 0.0, 64.0, [0], {"priority": 2}),
        TraceEvent(2, "c", "silu", "vector", 0, 1, 0.5, 0.75, 5.0, 5.0, 0.0, [], {}),
    ]
    return {"format": TRACE_FORMAT, "version": TRACE_VERSION, "columns": list(_COLUMNS),
            "meta": {"graph": "t", "mode": "simulate", "clock": "virtual", "units": {"cube": 1, "comm": 2, "vector": 1}},
            "events": [[getattr(e, c) for c in _COLUMNS] for e in events]}


def _mutate(d: dict, where: list, value) -> None:
    """Set one field (by a path of keys/indices drawn at random) to ``value``."""
    node = d
    for i, key in enumerate(where):
        if isinstance(node, dict) and node:
            k = sorted(node, key=str)[key % len(node)]
        elif isinstance(node, list) and node:
            k = key % len(node)
        else:
            return
        if i == len(where) - 1 or not isinstance(node[k], (dict, list)):
            node[k] = value
            return
        node = node[k]


def _everything_downstream_of_a_trace(path) -> None:
    from megaloom.scheduler.replay import replay

    trace = Trace.load(path)
    summary(trace)
    to_chrome(trace)
    replay(trace)


_SETTINGS = settings(max_examples=400, deadline=None, derandomize=True,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@_SETTINGS
@given(paths=st.lists(st.lists(st.integers(0, 50), min_size=1, max_size=4), min_size=1, max_size=3),
       values=st.lists(_values, min_size=3, max_size=3))
def test_fuzzed_trace_files_raise_only_megaloom_errors(tmp_path, paths, values):
    d = _trace_dict()
    for where, value in zip(paths, values):
        _mutate(d, where, value)
    p = tmp_path / "t.mlt"
    try:
        p.write_bytes(msgpack.packb(d, use_bin_type=True))
    except (OverflowError, TypeError, ValueError):
        return  # not msgpack-encodable: no such file can exist
    try:
        _everything_downstream_of_a_trace(p)
    except MegaloomError:
        pass


def _graph_dict() -> dict:
    g = TaskGraph("f")
    x, w = g.input("x", (8, 4)), g.input("w", (4, 4))
    h, y = g.buffer("h", (8, 4)), g.output("y", (8, 4))
    for a in (0, 4):
        g.task("matmul", [x[a:a + 4], w], [h[a:a + 4]], priority=a, tags={"stage": a})
    g.task("silu", [h], [y], cost=None)
    return g.to_dict()


@_SETTINGS
@given(paths=st.lists(st.lists(st.integers(0, 50), min_size=1, max_size=5), min_size=1, max_size=3),
       values=st.lists(_values, min_size=3, max_size=3))
def test_fuzzed_graph_files_raise_only_megaloom_errors(paths, values):
    from megaloom.scheduler import Simulator

    d = _graph_dict()
    for where, value in zip(paths, values):
        _mutate(d, where, value)
    try:
        g = TaskGraph.from_dict(msgpack.unpackb(msgpack.packb(d, use_bin_type=True), raw=False, strict_map_key=False))
        g.validate()
        Simulator("ascend-910b").run(g)
    except (OverflowError, TypeError, ValueError) as e:
        if "msgpack" in type(e).__module__ or isinstance(e, OverflowError) and "pack" in str(e).lower():
            return
        raise
    except MegaloomError:
        pass


@pytest.mark.parametrize("change", [
    {"deps": [{}]}, {"task_id": 2**64 - 1}, {"unit": 10**9}, {"start": math.inf}, {"end": -1e300},
    {"flops": math.nan}, {"tags": {1: 2}}, {"deps": [True]},
])
def test_bad_event_values_name_the_event_and_field(tmp_path, change):
    from megaloom.runtime import TraceFormatError

    d = _trace_dict()
    row = dict(zip(_COLUMNS, d["events"][1]))
    row.update(change)
    d["events"][1] = list(row.values())
    p = tmp_path / "t.mlt"
    p.write_bytes(msgpack.packb(d, use_bin_type=True))
    with pytest.raises(TraceFormatError, match=f"event 1 field '{next(iter(change))}'"):
        Trace.load(p)


@pytest.mark.parametrize("key, value", [("units", "abc"), ("units", {"cube": 10**9}), ("units", {"cube": 0}),
                                        ("units", {"cube": 1.5}), ("units", [1]), ("profile", [1]), ("policy", {"x": 1})])
def test_bad_meta_is_refused(tmp_path, key, value):
    from megaloom.runtime import TraceFormatError

    d = _trace_dict()
    d["meta"][key] = value
    p = tmp_path / "t.mlt"
    p.write_bytes(msgpack.packb(d, use_bin_type=True))
    with pytest.raises(TraceFormatError, match=f"trace meta '{key}'"):
        Trace.load(p)


def test_infinity_is_refused_when_writing_json(tmp_path):
    from megaloom.runtime import TraceFormatError
    from megaloom.runtime.perfetto import write_chrome

    t = Trace([TraceEvent(0, "a", "noop", "vector", 0, 0, 0.0, 1.0, tags={"x": math.inf})], {})
    with pytest.raises(TraceFormatError, match="not finite"):
        write_chrome(t, tmp_path / "t.json")
    assert not (tmp_path / "t.json").exists()
    for bad in (TraceEvent(0, "a", "noop", "vector", 0, 0, 0.0, math.inf),  # an imported Infinity duration
                TraceEvent(0, "\ud800", "noop", "vector", 0, 0, 0.0, 1.0)):  # a lone surrogate
        with pytest.raises(TraceFormatError, match="not written|not msgpack-encodable"):
            Trace([bad], {}).save(tmp_path / "t.mlt")  # a trace file is written only if it reads back
    assert not (tmp_path / "t.mlt").exists()
