"""Export a trace to Chrome Trace Event JSON, which Perfetto and chrome://tracing open.

One process per rank, one thread track per engine unit (Perfetto does not draw
overlapping slices on one track); task name as slice name, op as category, tags and
work figures in ``args``.
"""
from __future__ import annotations

import json
import os
from typing import Any

from megaloom.runtime.trace import Trace, atomic_write

_ENGINE_ORDER = {"comm": 0, "cube": 1, "vector": 2}


def _track(engine: str, unit: int) -> int:
    return (_ENGINE_ORDER.get(engine, 3 + (sum(map(ord, engine)) % 97))) * 10000 + unit


def to_chrome(trace: Trace) -> dict[str, Any]:
    """The trace as a Chrome Trace Event JSON object (timestamps in microseconds)."""
    t0 = min((e.start for e in trace.events), default=0.0)
    out: list[dict[str, Any]] = []
    tracks = sorted({(e.rank, e.engine, e.unit) for e in trace.events})
    for rank in sorted({r for r, _, _ in tracks}):
        out.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
    for rank, engine, unit in tracks:
        tid = _track(engine, unit)
        out.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": f"{engine}.{unit}"}})
        out.append({"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": tid, "args": {"sort_index": tid}})
    for e in trace.events:
        args: dict[str, Any] = {"task_id": e.tid, "op": e.op, **{str(k): v for k, v in e.tags.items()}}
        for k in ("flops", "bytes", "comm_bytes"):
            if getattr(e, k):
                args[k] = getattr(e, k)
        out.append({
            "ph": "X", "name": e.task, "cat": e.op, "pid": e.rank, "tid": _track(e.engine, e.unit),
            "ts": (e.start - t0) * 1e6, "dur": max(e.duration, 0.0) * 1e6, "args": args,
        })
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": {k: str(v) for k, v in trace.meta.items()}}


def write_chrome(trace: Trace, path: str | os.PathLike) -> None:
    """Write the Chrome JSON atomically."""
    atomic_write(path, json.dumps(to_chrome(trace), default=str).encode())
