"""The profiler-JSON oddities of the bad-input audit: each imports or raises TraceFormatError,
and what imports is saved only if it reads back."""
from __future__ import annotations

import json

import pytest

from megaloom.runtime.errors import TraceFormatError
from megaloom.scheduler.importers import import_torch_profiler

_LAUNCH = {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": 5, "dur": 2,
           "args": {"correlation": 1}}
_KERNEL = {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 10, "dur": 5,
           "args": {"stream": 7, "correlation": 1}}


def _doc(*events) -> str:
    return json.dumps({"traceEvents": [_LAUNCH, _KERNEL, *events]})


@pytest.mark.parametrize("text", [
    _doc({"ph": "s", "id": [1, 2], "pid": 1, "tid": 1, "ts": 5, "cat": "fwdbwd", "name": "f"},
         {"ph": "f", "id": [1, 2], "pid": 0, "tid": 7, "ts": 10, "cat": "fwdbwd", "name": "f", "bp": "e"}),
    _doc({"ph": "s", "cat": [], "ts": 0.0}),  # a flow whose category is a list
    _doc({"ph": "X", "cat": "cuda_sync", "name": "Stream Wait Event", "pid": 0, "tid": 7, "ts": 20, "dur": 1,
          "args": {"wait_on_stream": [1], "stream": 7}}),
    _doc(dict(_KERNEL, ts=30, args={"stream": 7, "Input Dims": [[10**400]]})),
], ids=["flow id list", "flow category list", "wait_on_stream list", "dims 10**400"])
def test_odd_but_readable_traces_import(tmp_path, text):
    p = tmp_path / "t.json"
    p.write_text(text)
    trace, _ = import_torch_profiler(p)
    trace.save(tmp_path / "t.mlt")


@pytest.mark.parametrize("text, needle", [
    ('{"traceEvents": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
    (_doc(dict(_KERNEL, ts=30, dur="INF")).replace('"INF"', "Infinity"), "finite"),  # Python's json reads it
])
def test_unreadable_traces_raise_trace_format_error(tmp_path, text, needle):
    p = tmp_path / "t.json"
    p.write_text(text)
    with pytest.raises(TraceFormatError, match=needle):
        import_torch_profiler(p)


def test_a_lone_surrogate_is_refused_when_saving(tmp_path):
    p = tmp_path / "t.json"
    p.write_text(_doc(dict(_KERNEL, name="bad \\ud800", ts=30)).replace("\\\\ud800", "\\ud800"))
    trace, _ = import_torch_profiler(p)
    with pytest.raises(TraceFormatError):
        trace.save(tmp_path / "t.mlt")
