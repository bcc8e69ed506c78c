"""The run recorder: one run's bookkeeping, kept alike by every executor.

Observers follow Taskflow's observer interface: a run start, one call per task run, a run
end. :class:`Recorder` is the one object an executor talks to: it writes the run's
``meta``, makes the observer calls, and builds the :class:`~megaloom.runtime.trace.Trace`
from ``(task id, unit, start, end)`` records, so the reference executor, the thread
executor and the simulator differ only in how they produce records. Exporters (the
Perfetto writer, the trace streamer) are observers like any other.

The executors' loops allocate no reference cycles, so they run with the cyclic garbage
collector paused (:func:`gc_paused`): a collection over many live objects would dominate
dispatch; reference counting still frees memory.
"""
from __future__ import annotations

from operator import attrgetter
from typing import Any, Iterable

import numpy as np

from megaloom.runtime.files import gc_paused  # noqa: F401  (the executors take it from here)
from megaloom.runtime.graph import TaskGraph
from megaloom.runtime.trace import Coded, Columns, Trace, TraceEvent

Record = tuple[int, int, float, float]
"""One task run: ``(task id, unit, start, end)``."""


class Observer:
    """Hooks every executor calls alike; override what you need."""

    def on_run_start(self, graph: TaskGraph, meta: dict[str, Any]) -> None:
        pass

    def on_task(self, event: TraceEvent) -> None:
        pass

    def on_run_end(self, trace: Trace) -> None:
        pass


def _task_rows(graph: TaskGraph) -> list[tuple]:
    """Per task, the trace-event fields that no run changes (cached per graph version)."""
    def make() -> list[tuple]:
        return [(t.id, t.name, t.op, t.engine, c.flops, c.bytes, c.comm_bytes, graph.pred[t.id], t.tags, c.precision)
                for t, c in zip(graph.tasks, graph.costs())]
    return graph.cached("trace_rows", make)


def _task_table(graph: TaskGraph) -> Columns:
    """One row per task (by task id) of the trace columns that no run changes (cached per graph version;
    deps and tags copied, so that traces keep them as they were however the graph changes later)."""
    def make() -> Columns:
        tasks, costs = graph.tasks, graph.costs()
        n = len(tasks)
        names, ops, engines, tags = (list(map(attrgetter(f), tasks)) for f in ("name", "op", "engine", "tags"))
        work = {f: np.fromiter(map(attrgetter(f), costs), np.float64, n) for f in ("flops", "bytes", "comm_bytes")}
        zeros = np.zeros(n, dtype=np.int64)
        none, empty = [], {}  # shared by the tasks without deps or tags (events get their own)
        return Columns(task_id=np.arange(n, dtype=np.int64), task=Coded.of(names), op=Coded.of(ops, True),
                       engine=Coded.of(engines, True), unit=zeros, rank=zeros, start=np.zeros(n), end=np.zeros(n),
                       **work, deps=Coded.of([list(d) if d else none for d in graph.pred]),
                       tags=Coded.of([dict(t) if t else empty for t in tags]),
                       precision=Coded.of(list(map(attrgetter("precision"), costs)), True))
    return graph.cached("trace_table", make)


def columns_of(graph: TaskGraph, task_id: np.ndarray, unit: np.ndarray, start: np.ndarray, end: np.ndarray,
               rank: int) -> Columns:
    """Trace columns of task runs given as arrays (task id, unit, start, end per run)."""
    cols = _task_table(graph).take(np.asarray(task_id, dtype=np.int64))
    cols.unit = np.asarray(unit, dtype=np.int64)
    cols.rank = np.full(len(cols.unit), rank, dtype=np.int64)
    cols.start, cols.end = np.asarray(start, dtype=np.float64), np.asarray(end, dtype=np.float64)
    return cols


def records_columns(graph: TaskGraph, records: Iterable[Record], rank: int) -> Columns:
    """Trace columns of ``records``, in record order."""
    recs = records if isinstance(records, list) else list(records)
    if not recs:
        z = np.zeros(0)
        return columns_of(graph, z, z, z, z, rank)
    tid, unit, start, end = zip(*recs)
    return columns_of(graph, np.array(tid, dtype=np.int64), np.array(unit, dtype=np.int64), np.array(start),
                      np.array(end), rank)


def events_of(graph: TaskGraph, records: Iterable[Record], rank: int) -> list[TraceEvent]:
    """Trace events of ``records``, in record order."""
    rows = _task_rows(graph)
    out = []
    for tid, unit, start, end in records:
        i, name, op, engine, flops, nbytes, comm, deps, tags, prec = rows[tid]
        out.append(TraceEvent(i, name, op, engine, unit, rank, start, end, flops, nbytes, comm, list(deps),
                              dict(tags) if tags else {}, prec))
    return out


class Recorder:
    """Records one run of ``graph``: created as the run starts, finished as it ends.

    ``meta`` holds ``graph``, ``mode``, ``clock``, ``units``, ``rank``, ``world_size`` and the
    executor's ``extra`` keys. Observers see ``on_run_start`` on creation, ``on_task`` from
    :meth:`task` (any worker thread may call it) and ``on_run_end`` from :meth:`finish`.
    """

    __slots__ = ("graph", "meta", "observers", "rank", "records")

    def __init__(self, graph: TaskGraph, observers: Iterable[Observer] = (), *, mode: str, clock: str,
                 units: dict[str, int], rank: int = 0, world_size: int = 1, **extra: Any):
        self.graph, self.observers, self.rank = graph, list(observers), rank
        self.meta: dict[str, Any] = {"graph": graph.name, "mode": mode, "clock": clock, "units": dict(units),
                                     "rank": rank, "world_size": world_size, **extra}
        self.records: list[Record] = []
        for o in self.observers:
            o.on_run_start(graph, self.meta)

    def task(self, tid: int, unit: int, start: float, end: float, *, keep: bool = True) -> None:
        """One task ran: keep its record (unless ``keep=False``: the caller keeps it) and
        show it to the observers now."""
        if keep:
            self.records.append((tid, unit, start, end))
        if self.observers:
            event = events_of(self.graph, ((tid, unit, start, end),), self.rank)[0]
            for o in self.observers:
                o.on_task(event)

    def finish(self, records: Iterable[Record] | None = None, *, replay: bool = False,
               columns: Columns | None = None) -> Trace:
        """The run's trace, of ``records`` (default: those kept by :meth:`task`) in their order,
        or of ``columns`` (:func:`columns_of`) when given.

        ``replay``: the observers saw no task during the run, so show them every event now,
        in completion order (ties by record order).
        """
        if columns is None:
            columns = records_columns(self.graph, self.records if records is None else records, self.rank)
        trace = Trace(meta=self.meta, columns=columns)
        if self.observers:
            if replay:
                events = trace.events
                for i in np.lexsort((np.arange(len(columns)), columns.end)).tolist():
                    for o in self.observers:
                        o.on_task(events[i])
            for o in self.observers:
                o.on_run_end(trace)
        return trace
