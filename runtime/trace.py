"""Traces: one event per task run, saved as versioned msgpack.

Each event carries its task's predecessors (task ids within the same rank), so a
trace alone is enough to compute the critical path and to replay the run.
"""
from __future__ import annotations

import gc
import os
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Any, Iterable, Iterator

import msgpack

from megaloom.runtime.errors import TraceFormatError

TRACE_FORMAT = "megaloom-trace"
TRACE_VERSION = 2  # 2: events carry their precision (version 1 files still load)


@dataclass(slots=True)
class TraceEvent:
    """One task run: where (engine kind, unit, rank), when (seconds), and its work."""

    tid: int
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
    "tid": (int,), "task": (str,), "op": (str,), "engine": (str,), "unit": (int,), "rank": (int,),
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
            with gc_paused():
                data = msgpack.packb(payload, use_bin_type=True)
        except TypeError as e:
            raise TraceFormatError(f"{path}: trace meta or tags are not msgpack-encodable: {e}") from e
        atomic_write(path, data)

    @staticmethod
    def load(path: str | os.PathLike) -> Trace:
        """Read a trace; a corrupt, truncated or newer file raises TraceFormatError."""
        with gc_paused():
            return Trace._from_file(path)

    @staticmethod
    def _from_file(path: str | os.PathLike) -> Trace:
        data = read_msgpack(path, TRACE_FORMAT, TRACE_VERSION)
        cols, rows, meta = data.get("columns"), data.get("events"), data.get("meta", {})
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


@contextmanager
def gc_paused(pause: bool = True) -> Iterator[None]:
    """Keep Python's cyclic garbage collector off inside the block (reference counting still
    frees memory): making or reading millions of small objects otherwise triggers collections
    that each walk the whole heap, several times the work itself."""
    was_enabled = gc.isenabled()
    if pause:
        gc.disable()
    try:
        yield
    finally:
        if pause and was_enabled:
            gc.enable()


def atomic_write(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path``, fsync, then rename over it."""
    path = os.fspath(path)
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-", suffix=os.path.basename(path))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def read_msgpack(path: str | os.PathLike, fmt: str, version: int) -> dict[str, Any]:
    """Decode a versioned megaloom msgpack file, turning every failure into TraceFormatError."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise TraceFormatError(f"{path}: cannot read: {e.strerror}") from e
    try:
        data = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated types on bad input
        hint = " (it looks like JSON; megaloom writes its own files as msgpack)" if raw[:1] in (b"{", b"[") else ""
        raise TraceFormatError(f"{path}: not a valid msgpack file ({type(e).__name__}: {e}){hint}") from None
    if not isinstance(data, dict) or data.get("format") != fmt:
        raise TraceFormatError(f"{path}: not a {fmt} file")
    v = data.get("version")
    if not isinstance(v, int) or v < 1:
        raise TraceFormatError(f"{path}: missing or bad schema version {v!r}")
    if v > version:
        raise TraceFormatError(f"{path}: schema version {v} is newer than this megaloom reads ({version})")
    return data


def merge(traces: Iterable[Trace]) -> Trace:
    """One trace of several ranks' traces (events keep their rank)."""
    traces = list(traces)
    events = [e for t in traces for e in t.events]
    meta = dict(traces[0].meta) if traces else {}
    meta["world_size"] = len({e.rank for e in events})
    return Trace(sorted(events, key=lambda e: (e.start, e.rank, e.tid)), meta)
