"""Export a trace to Chrome Trace Event JSON, which Perfetto and chrome://tracing open.

One process per rank, one thread track per engine unit (Perfetto does not draw
overlapping slices on one track); task name as slice name, op as category, tags and
work figures in ``args``. :class:`PerfettoObserver` writes the file of every run an
executor makes, as Taskflow's ChromeObserver does.
"""
from __future__ import annotations

import json
import os
from typing import Any

from megaloom.runtime.errors import TraceFormatError
from megaloom.runtime.files import atomic_write
from megaloom.runtime.record import Observer
from megaloom.runtime.registry import COMM, CUBE, VECTOR
from megaloom.runtime.trace import Trace

_ENGINE_ORDER = {COMM: 0, CUBE: 1, VECTOR: 2}  # other engine kinds follow, by name
_US = 1e6


def _track_ids(tracks: list[tuple[int, str, int]]) -> dict[tuple[str, int], int]:
    """A distinct thread id per (engine kind, unit), grouped by engine kind."""
    kinds = sorted({e for _, e, _ in tracks}, key=lambda e: (_ENGINE_ORDER.get(e, len(_ENGINE_ORDER)), e))
    width = 1 + max((u for _, _, u in tracks), default=0)
    return {(e, u): 1 + kinds.index(e) * width + u for _, e, u in tracks}


def _named(pid: int, tid: int, name: str, sort_index: int) -> list[dict[str, Any]]:
    """The metadata events that name a process (``tid`` 0) or a thread track, and place it."""
    kind = "thread" if tid else "process"
    return [{"ph": "M", "name": f"{kind}_name", "pid": pid, "tid": tid, "args": {"name": name}},
            {"ph": "M", "name": f"{kind}_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": sort_index}}]


def to_chrome(trace: Trace) -> dict[str, Any]:
    """The trace as a Chrome Trace Event JSON object (timestamps in microseconds, to 1 ns)."""
    c = trace.columns
    rank, unit, task_id = c.column("rank"), c.column("unit"), c.column("task_id")
    engine, start, end = c.column("engine"), c.column("start"), c.column("end")
    t0 = min(start, default=0.0)
    tracks = sorted(set(zip(rank, engine, unit)))
    tid_of = _track_ids(tracks)
    out = [m for r in sorted({r for r, _, _ in tracks}) for m in _named(r, 0, f"rank {r}", r)]
    out += [m for r, e, u in tracks for m in _named(r, tid_of[e, u], f"{e}.{u}", tid_of[e, u])]
    work = [c.column(k) for k in ("flops", "bytes", "comm_bytes")]
    for i, (name, op, tags) in enumerate(zip(c.column("task"), c.column("op"), c.column("tags"))):
        args: dict[str, Any] = {"task_id": task_id[i], "op": op, **{str(k): v for k, v in tags.items()}}
        args.update((k, col[i]) for k, col in zip(("flops", "bytes", "comm_bytes"), work) if col[i])
        # start and end are rounded alike, so back-to-back tasks share a boundary exactly
        ts, te = round((start[i] - t0) * _US, 3), round((end[i] - t0) * _US, 3)
        out.append({"ph": "X", "name": name, "cat": op, "pid": rank[i], "tid": tid_of[engine[i], unit[i]],
                    "ts": ts, "dur": max(0.0, round(te - ts, 3)), "args": args})
    other = {"megaloom": "trace", **{k: str(v) for k, v in trace.meta.items()}}  # first: it names the writer
    return {"otherData": other, "traceEvents": out, "displayTimeUnit": "ms"}


def write_chrome(trace: Trace, path: str | os.PathLike) -> None:
    """Write the Chrome JSON atomically; a value JSON cannot hold (NaN, Infinity) raises TraceFormatError."""
    try:
        data = json.dumps(to_chrome(trace), default=str, allow_nan=False)
    except ValueError as e:  # the only ValueError json.dumps raises: an out-of-range float
        raise TraceFormatError(f"{path}: a tag or meta value is not finite, which JSON cannot hold ({e})") from None
    atomic_write(path, data.encode())


class PerfettoObserver(Observer):
    """An executor observer writing each run's Chrome JSON to ``path`` as the run ends.

    ``path`` may name ``{graph}`` (the graph's name) and ``{run}`` (0, 1, ... per run this
    observer saw), so that the runs of several graphs keep a file each.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self.runs = 0

    def on_run_end(self, trace: Trace) -> None:
        write_chrome(trace, self.path.format(graph=trace.meta.get("graph", "graph"), run=self.runs))
        self.runs += 1
