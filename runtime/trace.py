"""Traces: one event per task run, held as columns, saved as versioned msgpack.

Each event carries its task's predecessors (task ids within the same rank), so a
trace alone is enough to compute the critical path and to replay the run.

A :class:`Trace` made by an executor or the simulator holds :class:`Columns` (NumPy arrays
for numbers; repeated values such as op and engine names as a list of distinct values and
an index per event). ``trace.events`` makes the :class:`TraceEvent` objects the first time
it is read; from then on the event list is the trace (edits to events show everywhere).
Metrics, the Perfetto export and :meth:`Trace.save` read the columns.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Iterable, Sequence

import msgpack
import numpy as np

from megaloom.runtime.core import MAX_UNITS
from megaloom.runtime.errors import TraceFormatError
from megaloom.runtime.files import atomic_write, gc_paused, read_msgpack

TRACE_FORMAT = "megaloom-trace"
TRACE_VERSION = 4  # 2: events carry their precision; 3: ``tid`` renamed ``task_id``; 4: stored by column
# ("data": one list per column; files of row lists, "events", still load, as do older versions)
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
_TYPES = {"int": (int,), "float": (int, float), "str": (str,), "list[int]": (list,), "dict[str, Any]": (dict,)}
FIELD_TYPES: dict[str, tuple[type, ...]] = {f.name: _TYPES[f.type] for f in fields(TraceEvent)}
"""The types a stored value of each field may have (a float field takes an int)."""
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


_NUMBERS = {c: np.float64 if float in t else np.int64 for c, t in FIELD_TYPES.items() if int in t}  # NumPy columns
_SHARED = ("op", "engine", "precision")  # few distinct values: kept as codes


@dataclass(slots=True)
class Coded:
    """A column as a list of values and, per event, the index of its value."""

    values: list
    index: np.ndarray

    def tolist(self) -> list:
        v = self.values
        return [v[i] for i in self.index.tolist()]

    def __getitem__(self, rows: np.ndarray) -> Coded:
        """The values at ``rows`` (an index array), as a NumPy column's ``column[rows]``."""
        return Coded(self.values, self.index[rows])

    @staticmethod
    def of(items: list, shared: bool = False) -> Coded:
        """``items`` as a column; ``shared``: store each distinct (hashable) value once."""
        if not shared:
            return Coded(items, np.arange(len(items), dtype=np.int64))
        values = list(dict.fromkeys(items))  # in order of first use
        code = {v: i for i, v in enumerate(values)}
        return Coded(values, np.fromiter(map(code.__getitem__, items), np.int64, len(items)))


class Columns:
    """Events as columns: a NumPy array per number field (:data:`_NUMBERS`) and a
    :class:`Coded` column each for ``task``, ``op``, ``engine``, ``deps``, ``tags``, ``precision``."""

    __slots__ = tuple(_COLUMNS)

    def __init__(self, **cols: Any):
        for c in _COLUMNS:
            setattr(self, c, cols[c])

    def __len__(self) -> int:
        return len(self.task_id)

    def column(self, name: str) -> list:
        """The values of one column as a Python list."""
        return getattr(self, name).tolist()

    def take(self, rows: np.ndarray) -> Columns:
        """The events at ``rows`` (an index array), in that order."""
        return Columns(**{c: getattr(self, c)[rows] for c in _COLUMNS})

    def events(self) -> list[TraceEvent]:
        """The events as :class:`TraceEvent` objects, each with its own ``deps`` and ``tags``."""
        cols = [self.column(c) for c in _COLUMNS]
        cols[11] = [list(d) for d in cols[11]]
        cols[12] = [dict(t) if t else {} for t in cols[12]]
        return list(map(TraceEvent, *cols))

    @staticmethod
    def of_lists(cols: Sequence[list]) -> Columns:
        """Columns of one Python list per field, in :data:`_COLUMNS` order (values checked already)."""
        return Columns(**{c: np.array(v, dtype=_NUMBERS[c]) if c in _NUMBERS else Coded.of(list(v), c in _SHARED)
                          for c, v in zip(_COLUMNS, cols)})

    @staticmethod
    def of_events(events: Sequence[TraceEvent]) -> Columns:
        return Columns.of_lists([[getattr(e, c) for e in events] for c in _COLUMNS])


def _columns_ok(cols: list[list]) -> bool:
    """True when every value of ``cols`` (lists in :data:`_COLUMNS` order) passes :func:`row_problem`;
    checked by column, so that a large trace needs no check per event."""
    for name, col in zip(_COLUMNS, cols):
        types = set(map(type, col))
        if not types <= set(FIELD_TYPES[name]):
            return False
        check = FIELD_CHECKS.get(name)
        if check is None or not col:
            continue
        if name in _NUMBERS:
            try:
                if float in types and not np.isfinite(np.array(col, dtype=np.float64)).all():
                    return False
                if check(min(col)) or check(max(col)):
                    return False
            except OverflowError:
                return False
        elif any(map(check, col)):
            return False
    return not cols[0] or bool((np.array(cols[7], dtype=np.float64) >= np.array(cols[6], dtype=np.float64)).all())


class Trace:
    """Events of one run (or several ranks merged) plus metadata.

    ``Trace(events, meta)`` holds a list of events; ``Trace(columns=..., meta=...)`` holds
    :class:`Columns` and makes the events when :attr:`events` is first read.
    ``meta`` keys: ``graph``, ``mode`` (reference / execute / simulate), ``clock``
    (wall / virtual), ``units`` (engine kind -> unit count), ``world_size``, ``profile``.
    """

    __slots__ = ("meta", "_events", "_columns")

    def __init__(self, events: list[TraceEvent] | None = None, meta: dict[str, Any] | None = None, *,
                 columns: Columns | None = None):
        self.meta = meta if meta is not None else {}
        self._events = events if events is not None or columns is not None else []
        self._columns = columns if events is None else None

    @property
    def events(self) -> list[TraceEvent]:
        if self._events is None:
            with gc_paused():  # many small objects, no cycles: collections would cost more than the making
                self._events, self._columns = self._columns.events(), None
        return self._events

    @property
    def columns(self) -> Columns:
        """The events as columns (made from the event list, when the trace holds one)."""
        return self._columns if self._columns is not None else Columns.of_events(self._events)

    def __len__(self) -> int:
        return len(self._columns) if self._columns is not None else len(self._events)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Trace) and self.meta == other.meta and self.events == other.events

    def __repr__(self) -> str:
        return f"Trace({len(self)} events, meta={self.meta!r})"

    def _numbers(self, name: str) -> np.ndarray:
        """One number field of every event as an array (without making columns of an event list)."""
        if self._columns is not None:
            return getattr(self._columns, name)
        return np.array([getattr(e, name) for e in self._events], dtype=_NUMBERS[name])

    @property
    def makespan(self) -> float:
        return float(self._numbers("end").max() - self._numbers("start").min()) if len(self) else 0.0

    @property
    def ranks(self) -> list[int]:
        return np.unique(self._numbers("rank")).tolist()

    def save(self, path: str | os.PathLike) -> None:
        """Write atomically: a crash mid-write leaves any earlier file intact. Only what
        :meth:`load` reads back is written: a bad value (``inf``, say) raises TraceFormatError."""
        with gc_paused():
            if self._columns is not None:
                data = [self._columns.column(c) for c in _COLUMNS]
            else:
                data = [[getattr(e, c) for e in self._events] for c in _COLUMNS]
            if bad := meta_problem(self.meta) or _data_problem(data):
                raise TraceFormatError(f"{path}: not written: {bad}")
            try:
                raw = msgpack.packb({"format": TRACE_FORMAT, "version": TRACE_VERSION, "meta": self.meta,
                                     "columns": _COLUMNS, "data": data}, use_bin_type=True)
            except (TypeError, ValueError) as e:  # ValueError: UnicodeEncodeError of a lone surrogate
                raise TraceFormatError(f"{path}: trace meta or tags are not msgpack-encodable: {e}") from e
        atomic_write(path, raw)

    @staticmethod
    def load(path: str | os.PathLike) -> Trace:
        """Read a trace; a corrupt, truncated or newer file raises TraceFormatError."""
        with gc_paused():
            data = read_msgpack(path, TRACE_FORMAT, TRACE_VERSION, TraceFormatError)
            cols, meta = data.get("columns"), data.get("meta", {})
            rows, by_col = data.get("events"), data.get("data")
            if data["version"] < 3 and isinstance(cols, list):
                cols = [_RENAMED.get(c, c) for c in cols]
            stored = rows if rows is not None or data["version"] < 4 else by_col
            if not isinstance(cols, list) or len(cols) < REQUIRED_COLUMNS or cols != _COLUMNS[: len(cols)] \
                    or not isinstance(stored, list) or (stored is by_col and len(by_col) != len(cols)):
                raise TraceFormatError(f"{path}: bad trace layout (columns {cols!r:.80})")
            if why := meta_problem(meta):
                raise TraceFormatError(f"{path}: trace meta {why}")
            if stored is rows:  # one list per event: made columns once every event has every field
                bad = next((i for i, row in enumerate(rows) if not isinstance(row, list) or len(row) != len(cols)), -1)
                if bad >= 0:
                    raise TraceFormatError(f"{path}: event {bad} {row_problem(cols, rows[bad])}")
                by_col = [list(c) for c in zip(*rows)] if rows else [[] for _ in cols]
            if why := _data_problem(by_col, cols):
                raise TraceFormatError(f"{path}: {why}")
            defaults = [[getattr(_DEFAULT, c)] * len(by_col[0]) for c in _COLUMNS[len(cols):]]
            return Trace(meta=meta, columns=Columns.of_lists(by_col + defaults))


_DEFAULT = TraceEvent(0, "", "", "", 0, 0, 0.0, 0.0)


def _data_problem(data: list, cols: list[str] = _COLUMNS) -> str | None:
    """Why columns ``data`` (one list per name in ``cols``) are not valid events, or None."""
    if not all(isinstance(c, list) for c in data) or len({len(c) for c in data}) > 1:
        return "bad trace layout (columns of different lengths)"
    full = data + [[getattr(_DEFAULT, c)] * len(data[0]) for c in _COLUMNS[len(cols):]]
    if _columns_ok(full):
        return None
    for i, row in enumerate(zip(*data)):  # find and name the first bad event
        if why := row_problem(cols, list(row)):
            return f"event {i} {why}"
    return None


def merge(traces: Iterable[Trace]) -> Trace:
    """One trace of several ranks' traces (events keep their rank)."""
    traces = list(traces)
    meta = dict(traces[0].meta) if traces else {}
    parts = [t.columns for t in traces] or [Columns.of_events([])]
    cols = Columns.of_lists([np.concatenate([getattr(p, c) for p in parts]) if c in _NUMBERS
                             else [x for p in parts for x in p.column(c)] for c in _COLUMNS])
    meta["world_size"] = len(np.unique(cols.rank))
    return Trace(meta=meta, columns=cols.take(np.lexsort((cols.task_id, cols.rank, cols.start))))
