"""Traces: one event per task run, saved as versioned msgpack.

Each event carries its task's predecessors (task ids within the same rank), so a
trace alone is enough to compute the critical path and to replay the run.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Iterable

import msgpack

from megaloom.runtime.core import MAX_UNITS
from megaloom.runtime.errors import TraceFormatError
from megaloom.runtime.files import atomic_write, gc_paused, read_msgpack

TRACE_FORMAT = "megaloom-trace"
TRACE_VERSION = 3  # 2: events carry their precision; 3: ``tid`` renamed ``task_id`` (older files still load)
_RENAMED = {"tid": "task_id"}  # columns of version 2 and before under their current names


@dataclass(slots=True)
class TraceEvent:
    """One task run: which task (its id in its rank's graph), where (engine kind, unit,
    rank), when (seconds), and its work."""

    task_id: int
    task: str
    op: str
    engine: str
    unit: int
    rank: int
    start: float
    end: float
    flops: float = 0.0
    bytes: float = 0.0
    comm_bytes: float = 0.0
    deps: list[int] = field(default_factory=list)
    tags: dict[str, Any] = field(default_factory=dict)
    precision: str = "fp32"

    @property
    def duration(self) -> float:
        return self.end - self.start


_COLUMNS = [f.name for f in fields(TraceEvent)]
REQUIRED_COLUMNS = _COLUMNS.index("end") + 1  # the leading columns without a default
FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "task_id": (int,), "task": (str,), "op": (str,), "engine": (str,), "unit": (int,), "rank": (int,),
    "start": (int, float), "end": (int, float), "flops": (int, float), "bytes": (int, float),
    "comm_bytes": (int, float), "deps": (list,), "tags": (dict,), "precision": (str,),
}
MAX_TIME = 1e12  # seconds: any clock a trace uses (wall, perf_counter, simulated) stays far below
MAX_WORK = 1e30  # flops or bytes of one task


def _within(lo: float, hi: float):
    return lambda v: None if math.isfinite(v) and lo <= v <= hi else f"is {v!r}, outside [{lo:g}, {hi:g}]"


def _ids(v: list) -> str | None:
    bad = [d for d in v if isinstance(d, bool) or not isinstance(d, int) or not 0 <= d < 1 << 63]
    return f"holds {bad[0]!r:.40}, not a task id" if bad else None


# value checks beyond the type, by field (the same for trace files and the collector)
FIELD_CHECKS: dict[str, Callable[[Any], str | None]] = {
    "task_id": _within(0, (1 << 63) - 1), "unit": _within(0, MAX_UNITS - 1), "rank": _within(0, (1 << 31) - 1),
    "start": _within(-MAX_TIME, MAX_TIME), "end": _within(-MAX_TIME, MAX_TIME), "flops": _within(0, MAX_WORK),
    "bytes": _within(0, MAX_WORK), "comm_bytes": _within(0, MAX_WORK), "deps": _ids,
    "tags": lambda v: None if all(isinstance(k, str) for k in v) else "has a key that is not a string",
}


def row_problem(cols: list[str], row: Any) -> str | None:
    """Why ``row`` (values in ``cols`` order) is not a valid trace event, or None."""
    if not isinstance(row, list) or len(row) != len(cols):
        return f"has {len(row) if isinstance(row, list) else 'no'} fields, expected {len(cols)}"
    for c, v in zip(cols, row):
        if not isinstance(v, FIELD_TYPES[c]) or isinstance(v, bool):
            return f"field {c!r} has type {type(v).__name__}"
        if c in FIELD_CHECKS and (why := FIELD_CHECKS[c](v)):
            return f"field {c!r} {why}"
    if row[7] < row[6]:
        return f"ends ({row[7]!r}) before it starts ({row[6]!r})"
    return None


def meta_problem(meta: Any) -> str | None:
    """Why ``meta`` is not valid trace metadata (the keys readers use), or None."""
    if not isinstance(meta, dict):
        return "is not a mapping"
    units = meta.get("units")
    if units is not None and not (isinstance(units, dict) and all(
            isinstance(k, str) and isinstance(n, int) and not isinstance(n, bool) and 0 < n <= MAX_UNITS
            for k, n in units.items())):
        return f"'units' is {units!r:.60}, not a mapping of engine kind to a unit count in 1..{MAX_UNITS}"
    for key in ("profile", "policy"):  # names replay looks up
        if meta.get(key) is not None and not isinstance(meta[key], str):
            return f"{key!r} is {meta[key]!r:.60}, not a string"
    return None


@dataclass(slots=True)
class Trace:
    """Events of one run (or several ranks merged) plus metadata.

    ``meta`` keys: ``graph``, ``mode`` (reference / execute / simulate), ``clock``
    (wall / virtual), ``units`` (engine kind -> unit count), ``world_size``, ``profile``.
    """

    events: list[TraceEvent]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def makespan(self) -> float:
        if not self.events:
            return 0.0
        return max(e.end for e in self.events) - min(e.start for e in self.events)

    @property
    def ranks(self) -> list[int]:
        return sorted({e.rank for e in self.events})

    def save(self, path: str | os.PathLike) -> None:
        """Write atomically: a crash mid-write leaves any earlier file intact. Only what
        :meth:`load` reads back is written: a bad value (``inf``, say) raises TraceFormatError."""
        with gc_paused():
            rows = [[getattr(e, c) for c in _COLUMNS] for e in self.events]
            bad = meta_problem(self.meta) or next((f"event {i} {why}" for i, r in enumerate(rows)
                                                   if (why := row_problem(_COLUMNS, r))), None)
            if bad:
                raise TraceFormatError(f"{path}: not written: {bad}")
            try:
                data = msgpack.packb({"format": TRACE_FORMAT, "version": TRACE_VERSION, "meta": self.meta,
                                      "columns": _COLUMNS, "events": rows}, use_bin_type=True)
            except (TypeError, ValueError) as e:  # ValueError: UnicodeEncodeError of a lone surrogate
                raise TraceFormatError(f"{path}: trace meta or tags are not msgpack-encodable: {e}") from e
        atomic_write(path, data)

    @staticmethod
    def load(path: str | os.PathLike) -> Trace:
        """Read a trace; a corrupt, truncated or newer file raises TraceFormatError."""
        with gc_paused():
            data = read_msgpack(path, TRACE_FORMAT, TRACE_VERSION, TraceFormatError)
            cols, rows, meta = data.get("columns"), data.get("events"), data.get("meta", {})
            if data["version"] < 3 and isinstance(cols, list):
                cols = [_RENAMED.get(c, c) for c in cols]
            if not isinstance(cols, list) or len(cols) < REQUIRED_COLUMNS or cols != _COLUMNS[: len(cols)] \
                    or not isinstance(rows, list):
                raise TraceFormatError(f"{path}: bad trace layout (columns {cols!r:.80})")
            if why := meta_problem(meta):
                raise TraceFormatError(f"{path}: trace meta {why}")
            events = []
            for i, row in enumerate(rows):
                if why := row_problem(cols, row):
                    raise TraceFormatError(f"{path}: event {i} {why}")
                events.append(TraceEvent(*row))
            return Trace(events, meta)


def merge(traces: Iterable[Trace]) -> Trace:
    """One trace of several ranks' traces (events keep their rank)."""
    traces = list(traces)
    events = [e for t in traces for e in t.events]
    meta = dict(traces[0].meta) if traces else {}
    meta["world_size"] = len({e.rank for e in events})
    return Trace(sorted(events, key=lambda e: (e.start, e.rank, e.task_id)), meta)
