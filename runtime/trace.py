"""Traces: one event per task run, saved as versioned msgpack.

Each event carries its task's predecessors (task ids within the same rank), so a
trace alone is enough to compute the critical path and to replay the run.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any, Iterable

import msgpack

from megaloom.runtime.errors import TraceFormatError
from megaloom.runtime.files import atomic_write, read_msgpack

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
        """Write atomically: a crash mid-write leaves any earlier file intact."""
        payload = {
            "format": TRACE_FORMAT,
            "version": TRACE_VERSION,
            "meta": self.meta,
            "columns": _COLUMNS,
            "events": [[getattr(e, c) for c in _COLUMNS] for e in self.events],
        }
        try:
            data = msgpack.packb(payload, use_bin_type=True)
        except TypeError as e:
            raise TraceFormatError(f"{path}: trace meta or tags are not msgpack-encodable: {e}") from e
        atomic_write(path, data)

    @staticmethod
    def load(path: str | os.PathLike) -> Trace:
        """Read a trace; a corrupt, truncated or newer file raises TraceFormatError."""
        data = read_msgpack(path, TRACE_FORMAT, TRACE_VERSION, TraceFormatError)
        cols, rows, meta = data.get("columns"), data.get("events"), data.get("meta", {})
        if data["version"] < 3 and isinstance(cols, list):
            cols = [_RENAMED.get(c, c) for c in cols]
        if not isinstance(cols, list) or len(cols) < REQUIRED_COLUMNS or cols != _COLUMNS[: len(cols)] \
                or not isinstance(rows, list) or not isinstance(meta, dict):
            raise TraceFormatError(f"{path}: bad trace layout (columns {cols!r})")
        events = []
        for i, row in enumerate(rows):
            if not isinstance(row, list) or len(row) != len(cols):
                raise TraceFormatError(f"{path}: event {i} has {len(row) if isinstance(row, list) else 'no'} fields, expected {len(cols)}")
            for c, v in zip(cols, row):
                if not isinstance(v, FIELD_TYPES[c]) or isinstance(v, bool):
                    raise TraceFormatError(f"{path}: event {i} field {c!r} has type {type(v).__name__}")
            events.append(TraceEvent(*row))
        return Trace(events, meta)


def merge(traces: Iterable[Trace]) -> Trace:
    """One trace of several ranks' traces (events keep their rank)."""
    traces = list(traces)
    events = [e for t in traces for e in t.events]
    meta = dict(traces[0].meta) if traces else {}
    meta["world_size"] = len({e.rank for e in events})
    return Trace(sorted(events, key=lambda e: (e.start, e.rank, e.task_id)), meta)
