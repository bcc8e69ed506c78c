"""Import of torch.profiler Chrome traces: a real CPU trace, hand-written edge cases, unknown
files, fuzzing."""
import gzip
import json
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.profiler import ProfilerActivity, profile

from megaloom.runtime import Trace, TraceEvent, TraceFormatError
from megaloom.runtime.metrics import critical_path
from megaloom.scheduler.importers import import_torch_profiler, load_trace

from .kineto import identity


def _write(tmp_path, events, name="t.json"):
    p = tmp_path / name
    p.write_text(json.dumps({"traceEvents": events}))
    return p


def _x(name, ts, dur, tid=1, cat="cpu_op", **args):
    return {"ph": "X", "name": name, "cat": cat, "pid": 1, "tid": tid, "ts": ts, "dur": dur, "args": args}


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.SiLU(), torch.nn.Linear(64, 32))
    x = torch.randn(16, 32)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        model(x).sum().backward()
    path = tmp_path_factory.mktemp("prof") / "trace.json"
    prof.export_chrome_trace(str(path))
    return path


def test_real_cpu_profiler_trace_imports_with_classes_shapes_and_flows(profiled):
    trace, report = import_torch_profiler(profiled)
    names = [e.op for e in trace.events]
    assert "aten::linear" in names and "aten::silu" in names
    linear = [e for e in trace.events if e.op == "aten::linear"]
    assert all(e.engine == "cube" for e in linear)
    assert sorted(e.flops for e in linear) == [2.0 * 16 * 32 * 64] * 2
    assert next(e for e in trace.events if e.op == "aten::silu").engine == "vector"
    assert report.context["cpu_op"] > 0 and report.tasks == len(trace.events) and trace.meta["cpu_only"]
    for e in trace.events:  # acyclic and time-consistent: every dependency is earlier
        assert all(d < e.task_id for d in e.deps)
    assert 0 < critical_path(trace.events) <= trace.makespan * 1.0001
    identity(trace)


def test_cpu_only_trace_nesting_and_gaps(tmp_path):
    p = _write(tmp_path, [
        _x("aten::linear", 0, 10), _x("aten::addmm", 1, 8, **{"Input Dims": [[4], [2, 3], [3, 4]]}),
        _x("aten::relu", 12, 2), _x("aten::add", 12.5, 1),
    ])
    trace, report = import_torch_profiler(p)
    assert [e.op for e in trace.events] == ["aten::linear", "aten::relu"]
    assert trace.events[0].engine == "cube" and trace.events[0].flops == 2 * 2 * 3 * 4
    assert trace.events[1].deps == [0] and trace.events[1].tags["delay"] == pytest.approx(2e-6)
    assert report.context == {"cpu_op": 2}


def test_overlapping_sibling_is_an_overhanging_child(tmp_path):
    trace, report = import_torch_profiler(_write(tmp_path, [_x("a", 0, 10), _x("b", 5, 10)]))
    assert [e.op for e in trace.events] == ["a"] and report.overhangs == 1 and report.max_overhang_us == 5


def test_missing_end_is_kept_and_tagged(tmp_path):
    events = [{"ph": "B", "name": "open", "pid": 1, "tid": 1, "ts": 0, "cat": "cpu_op"}, _x("later", 5, 5, tid=2)]
    trace, report = import_torch_profiler(_write(tmp_path, events))
    ev = {e.op: e for e in trace.events}
    assert ev["open"].tags["truncated"] and ev["open"].duration == 0 and report.truncated == 1


def test_missing_end_lasts_to_the_last_timestamp_of_its_track(tmp_path):
    events = [{"ph": "B", "name": "open", "pid": 1, "tid": 1, "ts": 0, "cat": "cpu_op"}, _x("inner", 2, 8),
              _x("other", 5, 20, tid=2)]
    trace, _ = import_torch_profiler(_write(tmp_path, events))
    assert {e.op: e for e in trace.events}["open"].duration == pytest.approx(10e-6)


def test_begin_end_pairs(tmp_path):
    events = [{"ph": "B", "name": "mm", "pid": 1, "tid": 1, "ts": 0, "cat": "cpu_op"},
              {"ph": "E", "pid": 1, "tid": 1, "ts": 4}]
    trace, _ = import_torch_profiler(_write(tmp_path, events))
    assert trace.events[0].duration == pytest.approx(4e-6) and trace.events[0].engine == "cube"


@pytest.mark.parametrize("events, where", [
    ([_x("a", 10, -5)], "event 0"),
    ([{"ph": "B", "name": "a", "pid": 1, "tid": 1, "ts": 10}, {"ph": "E", "pid": 1, "tid": 1, "ts": 3}], "event 1"),
    ([{"ph": "E", "pid": 1, "tid": 1, "ts": 3}], "event 0"),
    ([_x("a", 0, 1), {"ph": "X", "name": "b", "pid": 1, "tid": 1, "ts": "soon", "dur": 1}], "event 1"),
    ([_x("a", 0, 1), {"ph": "X", "name": "b", "pid": 1, "tid": 1, "ts": float("nan"), "dur": 1}], "event 1"),
    ([_x("a", 0, 1), 7], "event 1"),
])
def test_clock_wrap_and_malformed_events_name_the_position(tmp_path, events, where):
    with pytest.raises(TraceFormatError, match=where):
        import_torch_profiler(_write(tmp_path, events))


def test_bad_json_names_line_and_column(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text('{"traceEvents": [\n {"ph": "X",, }]}')
    with pytest.raises(TraceFormatError, match="line 2 column"):
        import_torch_profiler(p)


def test_unknown_category_is_kept_as_opaque(tmp_path):
    trace, report = import_torch_profiler(_write(tmp_path, [_x("mystery", 0, 3, cat="vendor_magic")]))
    assert report.opaque == 1 and trace.events[0].op == "opaque" and trace.events[0].tags["category"] == "vendor_magic"


@pytest.mark.parametrize("content, says", [
    (b"", "an empty file"), (b"PK\x03\x04rest", "a zip archive"), (b"hello world", "text starting with 'hello world'"),
    (b"\x00\x01\x02\xff", "binary data"), (b'{"foo": 1}', "no 'traceEvents' list"),
])
def test_unknown_files_say_what_they_look_like(tmp_path, content, says):
    p = tmp_path / "x.bin"
    p.write_bytes(content)
    with pytest.raises(TraceFormatError, match=re.escape(says)):
        load_trace(p)


def test_megaloom_trace_and_gzip_are_recognised_by_content(tmp_path):
    Trace([TraceEvent(0, "a", "a", "cube", 0, 0, 0.0, 1.0)], {}).save(tmp_path / "run.anything")
    assert load_trace(tmp_path / "run.anything").events[0].task == "a"
    (tmp_path / "t.gz").write_bytes(gzip.compress(json.dumps({"traceEvents": [_x("aten::mm", 0, 2)]}).encode()))
    assert load_trace(tmp_path / "t.gz").events[0].op == "aten::mm"
    (tmp_path / "bad.gz").write_bytes(gzip.compress(b'{"traceEvents": []}')[:-6])
    with pytest.raises(TraceFormatError, match="gzip data is corrupt"):
        load_trace(tmp_path / "bad.gz")


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
                     lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=4), c, max_size=4), max_leaves=12)
_cats = st.sampled_from(["cpu_op", "kernel", "cuda_runtime", "cuda_sync", "gpu_memcpy", "user_annotation",
                         "gpu_user_annotation", "fwdbwd", "x"])
_args = st.fixed_dictionaries({}, optional={
    "correlation": st.integers(0, 4), "stream": st.integers(-1, 3), "wait_on_stream": st.integers(-1, 3),
    "wait_on_cuda_event_record_corr_id": st.integers(-1, 4), "cuda_sync_kind": st.sampled_from(
        ["Stream Wait Event", "Event Sync", "Context Sync", "Stream Sync", "?"]),
    "grid": st.lists(st.integers(0, 4), max_size=3), "Input Dims": _json, "Input type": _json, "bytes": _json,
    "Collective name": st.sampled_from(["allreduce", "x"]), "In msg nelems": _json, "dtype": _json, "Group size": _json})
_names = st.sampled_from(["cudaLaunchKernel", "cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaStreamWaitEvent",
                          "cudaMemcpy", "aten::mm", "ncclKernel_AllReduce", "Memcpy HtoD", "k", ""])
_event = st.fixed_dictionaries(
    {"ph": st.sampled_from(["X", "X", "X", "B", "E", "s", "f", "t", "M", "i", "Q"]) | _json},
    optional={"name": _names | _json, "cat": _cats | _json, "pid": st.integers(0, 2) | _json, "tid": st.integers(-1, 2),
              "ts": st.floats(-10, 100) | st.integers(-10, 100) | _json, "dur": st.floats(-5, 50) | st.integers(0, 9) | _json,
              "id": st.integers(0, 3), "args": _args | _json})


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(_event | _json, max_size=14), st.sampled_from([{}, {"deviceProperties": 3}, {"distributedInfo": []}]))
def test_fuzzed_input_imports_and_replays_exactly_or_raises_trace_format_error(tmp_path, events, header):
    p = tmp_path / "fuzz.json"
    p.write_text(json.dumps({"traceEvents": events, **header}))
    try:
        trace, report = import_torch_profiler(p)
    except TraceFormatError:
        return
    assert report.tasks == len(trace.events)
    for e in trace.events:
        assert all(d < e.task_id for d in e.deps) and e.end >= e.start
    identity(trace)
