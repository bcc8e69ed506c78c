"""Trace metrics on hand-built traces with known answers, and the Chrome JSON export."""
import json

import pytest
import torch

from megaloom.runtime import (
    ThreadExecutor, Trace, TraceEvent, TraceFormatError, merge, metrics, summary, to_chrome, write_chrome,
)
from megaloom.runtime.metrics import critical_path


def ev(tid, engine, start, end, unit=0, rank=0, deps=(), **tags):
    return TraceEvent(tid, f"t{tid}", "noop", engine, unit, rank, float(start), float(end), deps=list(deps), tags=tags)


def rank_events(rank: int = 0) -> list[TraceEvent]:
    #   cube   [0, 4]           vector.0 [2, 6]      vector.1 [2, 3]
    #   comm   [1, 3]  [5, 8]   (t4 waits for t0)
    return [ev(0, "cube", 0, 4, rank=rank), ev(1, "vector", 2, 6, rank=rank), ev(2, "vector", 2, 3, unit=1, rank=rank),
            ev(3, "comm", 1, 3, rank=rank), ev(4, "comm", 5, 8, rank=rank, deps=[0])]


UNITS = {"cube": 1, "vector": 2, "comm": 1}


@pytest.mark.parametrize("ranks", [1, 2])
def test_metrics_known_answers(ranks):
    m = metrics(Trace([e for r in range(ranks) for e in rank_events(r)], {"units": UNITS}))
    assert m.makespan == 8 and m.tasks == 5 * ranks
    assert m.busy == {"cube": 4 * ranks, "vector": 5 * ranks, "comm": 5 * ranks}
    assert m.utilisation == pytest.approx({"cube": 4 / 8, "vector": 5 / 16, "comm": 5 / 8})
    assert m.comm_time == 5                     # per rank
    assert m.comm_hidden == pytest.approx(3 / 5)  # [1,3] under cube, [5,6] under vector
    assert m.cube_vector_overlap == 2           # [2,4]
    assert m.critical_path == 7                 # t0 (4) then t4 (3)


def test_utilisation_without_units_counts_units_seen():
    m = metrics(Trace(rank_events()))
    assert m.utilisation["vector"] == pytest.approx(5 / 16)


def test_nothing_hidden_and_empty_trace():
    m = metrics(Trace([ev(0, "comm", 0, 2), ev(1, "cube", 2, 3)]))
    assert m.comm_hidden == 0 and m.cube_vector_overlap == 0 and m.critical_path == 2
    e = metrics(Trace([]))
    assert e.makespan == 0 and e.critical_path == 0 and e.comm_hidden == 0


def test_critical_path_follows_deps_not_start_order():
    # zero-length tasks share a start time with their dependants; input order is reversed
    events = [ev(2, "cube", 1, 3, deps=[1]), ev(1, "vector", 1, 1, deps=[0]), ev(0, "cube", 0, 1)]
    assert critical_path(events) == 3
    dense = [ev(i, "cube", i, i + 1, deps=range(i)) for i in range(200)]
    assert critical_path(dense) == 200
    with pytest.raises(TraceFormatError, match="cycle"):
        critical_path([ev(0, "cube", 0, 1, deps=[1]), ev(1, "cube", 1, 2, deps=[0])])


def test_summary_table_lists_engines_and_figures():
    text = summary(Trace(rank_events(), {"graph": "g", "mode": "simulate", "clock": "virtual", "units": UNITS,
                                          "profile": "h100"}))
    assert "trace of 'g' (simulate, virtual clock, profile h100)" in text
    assert "makespan            8.000 s" in text and "60.0% hidden" in text
    for line in ("cube", "vector", "comm"):
        assert line in text
    assert "31.2%" in text   # vector utilisation


def check_chrome(doc: dict, trace: Trace) -> None:
    """One pid per rank, one tid per (engine, unit), names given, slices on a track never overlap."""
    evs = doc["traceEvents"]
    slices = [e for e in evs if e["ph"] == "X"]
    assert len(slices) == len(trace.events)
    procs = {e["pid"]: e["args"]["name"] for e in evs if e["name"] == "process_name"}
    assert procs == {r: f"rank {r}" for r in trace.ranks}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in evs if e["name"] == "thread_name"}
    want = {(e.rank, f"{e.engine}.{e.unit}") for e in trace.events}
    assert sorted((p, n) for (p, _), n in threads.items()) == sorted(want)
    for pid in procs:   # distinct tracks within a rank
        names = [n for (p, _), n in threads.items() if p == pid]
        assert len(names) == len(set(names))
    where = {(e.rank, e.task): f"{e.engine}.{e.unit}" for e in trace.events}
    by_track: dict = {}
    for s in slices:
        assert threads[s["pid"], s["tid"]] == where[s["pid"], s["name"]]
        by_track.setdefault((s["pid"], s["tid"]), []).append((s["ts"], s["ts"] + s["dur"]))
    for spans in by_track.values():
        spans.sort()
        for (a0, a1), (b0, b1) in zip(spans, spans[1:]):
            assert a1 <= b0 + 1e-6, (a0, a1, b0, b1)
    json.dumps(doc)


def test_chrome_export_of_hand_built_trace(tmp_path):
    trace = Trace(rank_events(0) + rank_events(1) + [ev(9, "dma", 0, 1, unit=3, rank=1, expert=2)], {"graph": "g"})
    doc = to_chrome(trace)
    check_chrome(doc, trace)
    t9 = next(e for e in doc["traceEvents"] if e.get("name") == "t9")
    assert t9["args"] == {"task_id": 9, "op": "noop", "expert": 2} and t9["ts"] == 0 and t9["dur"] == 1e6
    write_chrome(trace, tmp_path / "t.json")
    assert json.loads((tmp_path / "t.json").read_text()) == json.loads(json.dumps(doc))


def test_chrome_export_of_a_real_run_has_no_overlaps():
    from megaloom.runtime import TaskGraph

    g = TaskGraph("chain")
    x = g.input("x", (64, 64))
    prev = x
    for i in range(12):
        nxt = g.buffer(f"b{i}", (64, 64))
        g.task("matmul" if i % 2 else "silu", [prev, x] if i % 2 else [prev], [nxt], name=f"s{i}")
        g.task("copy", [prev], [g.buffer(f"c{i}", (64, 64))], engine="comm", name=f"c{i}")
        prev = nxt
    res = ThreadExecutor({"cube": 2, "vector": 2, "comm": 1}).run(g, {"x": torch.randn(64, 64) / 8})
    other = Trace([TraceEvent(e.task_id, e.task, e.op, e.engine, e.unit, 1, e.start, e.end) for e in res.trace.events])
    both = merge([res.trace, other])
    assert both.meta["world_size"] == 2
    check_chrome(to_chrome(both), both)
