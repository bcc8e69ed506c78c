"""Import of torch.profiler Chrome traces: real traces, hand-written edge cases, fuzzing."""
import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.profiler import ProfilerActivity, profile

from megaloom.runtime import TraceFormatError
from megaloom.runtime.metrics import critical_path
from megaloom.scheduler.importers import import_torch_profiler, op_class


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


def test_real_profiler_trace_imports_with_classes_shapes_and_flows(profiled):
    trace, report = import_torch_profiler(profiled)
    names = [e.op for e in trace.events]
    assert "aten::linear" in names and "aten::silu" in names
    linear = [e for e in trace.events if e.op == "aten::linear"]
    assert all(e.engine == "cube" for e in linear)
    assert sorted(e.flops for e in linear) == [2.0 * 16 * 32 * 64] * 2
    assert next(e for e in trace.events if e.op == "aten::silu").engine == "vector"
    assert report.nested > 0 and report.flows > 0 and report.tasks == len(trace.events)
    for e in trace.events:  # acyclic and time-consistent: every dependency is earlier
        assert all(d < e.task_id for d in e.deps)
    assert 0 < critical_path(trace.events) <= trace.makespan * 1.0001


def test_program_order_and_nesting(tmp_path):
    p = _write(tmp_path, [
        _x("aten::linear", 0, 10), _x("aten::addmm", 1, 8, **{"Input Dims": [[4], [2, 3], [3, 4]]}),
        _x("aten::relu", 12, 2), _x("aten::add", 12.5, 1),
    ])
    trace, report = import_torch_profiler(p)
    assert [e.op for e in trace.events] == ["aten::linear", "aten::relu"]
    assert trace.events[0].engine == "cube" and trace.events[0].flops == 2 * 2 * 3 * 4
    assert trace.events[1].deps == [0] and report.nested == 2


def test_overlapping_siblings_on_one_track_are_kept(tmp_path):
    trace, _ = import_torch_profiler(_write(tmp_path, [_x("a", 0, 10), _x("b", 5, 10)]))
    assert [e.op for e in trace.events] == ["a", "b"] and trace.events[1].deps == [0]


def test_missing_end_is_kept_and_tagged(tmp_path):
    events = [{"ph": "B", "name": "open", "pid": 1, "tid": 1, "ts": 0, "cat": "cpu_op"}, _x("later", 5, 5)]
    trace, report = import_torch_profiler(_write(tmp_path, events))
    ev = {e.op: e for e in trace.events}
    assert ev["open"].tags["truncated"] and ev["open"].end == pytest.approx(10e-6) and report.truncated == 1


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


def test_gpu_launch_correlation_stream_wait_and_contradiction(tmp_path):
    events = [
        _x("cudaLaunchKernel", 0, 2, tid=1, cat="cuda_runtime", correlation=7),
        _x("sm90_xmma_gemm", 3, 10, tid=7, cat="kernel", correlation=7),
        _x("ncclKernel_AllReduce", 4, 20, tid=8, cat="kernel"),
        {"ph": "X", "name": "Stream Wait Event", "cat": "cuda_sync", "pid": 1, "tid": 7, "ts": 25, "dur": 0,
         "args": {"wait_on_stream": 8}},
        _x("vectorized_elementwise_kernel", 26, 3, tid=7, cat="kernel"),
        {"ph": "s", "cat": "ac2g", "id": 1, "pid": 1, "tid": 7, "ts": 27},  # points back in time
        {"ph": "f", "cat": "ac2g", "id": 1, "pid": 1, "tid": 1, "ts": 0.5, "bp": "e"},
    ]
    trace, report = import_torch_profiler(_write(tmp_path, events))
    ev = {e.op: e for e in trace.events}
    assert ev["cudaLaunchKernel"].engine == "host" and ev["sm90_xmma_gemm"].engine == "cube"
    assert ev["ncclKernel_AllReduce"].engine == "comm"
    assert ev["cudaLaunchKernel"].task_id in ev["sm90_xmma_gemm"].deps
    assert ev["ncclKernel_AllReduce"].task_id in ev["vectorized_elementwise_kernel"].deps
    assert report.correlations == 1 and report.stream_waits == 1 and report.contradictions == 1


@pytest.mark.parametrize("name, cat, kind", [
    ("aten::mm", "cpu_op", "cube"), ("aten::conv2d", "cpu_op", "cube"), ("aten::softmax", "cpu_op", "vector"),
    ("Memcpy HtoD (Pageable -> Device)", "gpu_memcpy", "comm"), ("c10d::allreduce_", "cpu_op", "comm"),
    ("cudaMemsetAsync", "cuda_runtime", "comm"), ("cudaLaunchKernel", "cuda_runtime", "host"),
    ("aten::addmm", "cpu_op", "cube"), ("aten::sum", "cpu_op", "vector"),
])
def test_op_classes(name, cat, kind):
    assert op_class(name, cat) == kind


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
                     lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=4), c, max_size=4), max_leaves=12)
_event = st.fixed_dictionaries(
    {"ph": st.sampled_from(["X", "B", "E", "s", "f", "t", "M", "i", "Q"]) | _json},
    optional={"name": st.text(max_size=6) | _json, "cat": st.sampled_from(["cpu_op", "kernel", "cuda_sync", "x"]),
              "pid": st.integers(0, 2) | _json, "tid": st.integers(0, 2), "ts": st.floats(-10, 100) | _json,
              "dur": st.floats(-5, 50) | _json, "id": st.integers(0, 3), "args": _json})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(_event | _json, max_size=12))
def test_fuzzed_input_imports_or_raises_trace_format_error(tmp_path, events):
    p = tmp_path / "fuzz.json"
    p.write_text(json.dumps({"traceEvents": events}))
    try:
        trace, _ = import_torch_profiler(p)
    except TraceFormatError:
        return
    for e in trace.events:
        assert all(d < e.task_id for d in e.deps) and e.end >= e.start
