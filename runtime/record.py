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

from typing import TYPE_CHECKING, Any, Callable, Iterable

import numpy as np

from megaloom.runtime.files import gc_paused  # noqa: F401  (the executors take it from here)
from megaloom.runtime.trace import Coded, Columns, Trace, TraceEvent

if TYPE_CHECKING:
    from megaloom.runtime.graph import TaskGraph

Record = tuple[int, int, float, float]
"""One task run: ``(task id, unit, start, end)``."""


class Observer:
    """Hooks every executor calls alike; override what you need."""

    def on_run_start(self, graph: TaskGraph, meta: dict[str, Any]) -> None:
        """A run of ``graph`` starts; ``meta`` is the run's (see :class:`Recorder`)."""

    def on_task(self, event: TraceEvent) -> None:
        """A task ran (any worker thread may call this)."""

    def on_run_end(self, trace: Trace) -> None:
        """The run ended; ``trace`` is its trace."""


class _ByID:
    """Values by task id, made when read (names, dependencies, tags: no object per task kept)."""

    __slots__ = ("get",)

    def __init__(self, get: Callable[[int], Any]):
        self.get = get

    def __getitem__(self, tid: int) -> Any:
        return self.get(tid)


_EMPTY: dict = {}


def _task_table(graph: TaskGraph) -> dict[str, Any]:
    """What trace columns take from the graph, kept per graph version: its columns, per cost code
    the work figures and precision, and names, dependencies and tags made when read (tags
    copied, so that traces keep them as they were however the graph changes later)."""
    def make() -> dict[str, Any]:
        a = graph.arrays()
        table, codes = graph.cost_columns()
        precisions = list(dict.fromkeys(c.precision for c in table))
        work = {f: np.array([getattr(c, f) for c in table], dtype=np.float64) for f in ("flops", "bytes", "comm_bytes")}
        ptr, idx, tags = a.pred_ptr, a.pred_idx, {i: dict(t) for i, t in graph.task_tags.items()}
        return {**work, "precision": np.array([precisions.index(c.precision) for c in table]), "codes": codes,
                "precisions": precisions, "names": _ByID(graph.task_name), "arrays": a,
                "deps": _ByID(lambda i: idx[ptr[i]:ptr[i + 1]].tolist()), "tags": _ByID(lambda i: tags.get(i, _EMPTY))}
    return graph.cached("trace_table", make)


def columns_of(graph: TaskGraph, task_id: np.ndarray, unit: np.ndarray, start: np.ndarray, end: np.ndarray,
               rank: int) -> Columns:
    """Trace columns of task runs given as arrays (task id, unit, start, end per run)."""
    t = _task_table(graph)
    a, tid = t["arrays"], np.asarray(task_id, dtype=np.int64)
    cost = t["codes"][tid]
    return Columns(task_id=tid, task=Coded(t["names"], tid), op=Coded(list(a.op_names), a.op[tid]),
                   engine=Coded(list(a.engine_names), a.engine[tid]),
                   unit=np.asarray(unit, dtype=np.int64), rank=np.full(len(tid), rank, dtype=np.int64),
                   start=np.asarray(start, dtype=np.float64), end=np.asarray(end, dtype=np.float64),
                   flops=t["flops"][cost], bytes=t["bytes"][cost], comm_bytes=t["comm_bytes"][cost],
                   deps=Coded(t["deps"], tid), tags=Coded(t["tags"], tid),
                   precision=Coded(t["precisions"], t["precision"][cost]))


def records_columns(graph: TaskGraph, records: Iterable[Record], rank: int) -> Columns:
    """Trace columns of ``records``, in record order."""
    tid, unit, start, end = np.array(list(records), dtype=np.float64).reshape(-1, 4).T  # (ids exact below 2**53)
    return columns_of(graph, tid, unit, start, end, rank)


def events_of(graph: TaskGraph, records: Iterable[Record], rank: int) -> list[TraceEvent]:
    """Trace events of ``records``, in record order."""
    return records_columns(graph, records, rank).events()


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
            event = columns_of(self.graph, [tid], [unit], [start], [end], self.rank).events()[0]
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
