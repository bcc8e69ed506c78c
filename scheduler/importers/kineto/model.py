"""The dependency model: how the events of one profiler trace become tasks and edges.

The table in docs/replay.md is the specification. The model is built in passes, one module
each: :mod:`.host` (threads: chains of their outermost calls, annotations and CPU ops as
their context), :mod:`.device` (streams: launches, stream order, work figures), :mod:`.waits`
(what each wait was for: sync records, sync calls, implicit syncs, and the waits a trace does
not record, derived from timing). Here: the records they share, and the edges every pass
draws the same way (:meth:`Model.consistent`, flows).

Every task keeps the untraced time between the moment its dependencies were met and its
recorded start as its ``delay``. A dependency that contradicts the recording (its producer
ends after the consumer starts) moves to the latest earlier task on the producer's track
that had ended, and is counted; with none, it is dropped and counted.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any, Iterable

from megaloom.scheduler.importers.kineto.read import RawTrace, Slice
from megaloom.scheduler.importers.kineto.report import ImportReport
from megaloom.scheduler.importers.kineto.work import Work


@dataclass(slots=True)
class Task:
    """One task of the imported graph; times in the file's microseconds."""

    name: str
    op: str
    engine: str
    track: tuple
    start: float
    end: float
    deps: list[int] = field(default_factory=list)
    tags: dict[str, Any] = field(default_factory=dict)
    work: Work | None = None


@dataclass(slots=True)
class Call:
    """An outermost host call (or CPU op) and what the model attaches to it."""

    s: Slice
    anns: tuple
    ops: tuple  # enclosing CPU ops, outermost first
    nested: list[Slice] = field(default_factory=list)
    waits: list[int] = field(default_factory=list)  # device-op indices a sync waits for
    wait_kind: str = ""
    wait_inferred: bool = False
    launched: list[int] = field(default_factory=list)  # device-op indices
    pieces: list[int] = field(default_factory=list)  # task ids, in time order


@dataclass(slots=True)
class Op:
    """A device op: its slice, annotations, launching call and task id."""

    s: Slice
    anns: tuple
    corr: int | None
    call: int = -1
    task: int = -1


def corr(s: Slice | dict) -> int | None:
    """The correlation id of a slice or raw event, or None."""
    args = s.args if isinstance(s, Slice) else s.get("args")
    c = args.get("correlation") if isinstance(args, dict) else None
    return c if type(c) is int else None


def index(pairs: Iterable[tuple[Any, int]]) -> tuple[list, list[int]]:
    """``(key, id)`` pairs sorted, as the list of keys (to bisect) and the list of ids."""
    pairs = sorted(pairs)
    return [k for k, _ in pairs], [i for _, i in pairs]


class Model:
    """The tasks of one trace and the indexes the passes share."""

    def __init__(self, raw: RawTrace, report: ImportReport, world_size: int | None):
        self.raw, self.report, self.world_size = raw, report, world_size
        self.tasks: list[Task] = []
        self.calls: list[Call] = []
        self.forward_of: dict[int, tuple[str, ...]] = {}  # autograd sequence number -> the forward ops that recorded it
        self.ops: list[Op] = []
        self.corr_call: dict[int, int] = {}
        self.thread_calls: dict[tuple, list[int]] = {}
        self.thread_busy: dict[tuple, list[list[float]]] = {}  # outermost CPU ops and calls: the thread at work
        self.thread_marks: dict[tuple, list[float]] = {}  # every start and end on the thread: when it did anything
        self.stream_ops: dict[tuple, list[int]] = {}
        self.by_corr: dict[tuple, tuple[list, list[int]]] = {}  # stream -> its ops' correlation ids and ops, sorted
        self.track_tasks: dict[tuple, list[int]] = {}
        self.inferred: dict[int, list[int]] = {}  # consumer task -> producers of its inferred edges
        self.explicit_waits: list[tuple[int, int]] = []  # (producer op, consumer op) of stream waits
        self.after_wait: set[int] = set()  # ops launched after a stream wait with no record
        self.has_device = any(s.cat in ("kernel", "gpu_memcpy", "gpu_memset") for s in raw.slices)
        self.t0 = min((s.start for s in raw.slices), default=0.0)

    def new(self, t: Task) -> int:
        self.tasks.append(t)
        self.track_tasks.setdefault(t.track, []).append(len(self.tasks) - 1)
        return len(self.tasks) - 1

    def infer(self, consumer: int, producer: int, kind: str) -> None:
        """An edge derived from timing: kept, counted and tagged as inferred."""
        self.tasks[consumer].deps.append(producer)
        self.inferred.setdefault(consumer, []).append(producer)
        self.report.inferred[kind] += 1

    def consistent(self, producer: int, at: float, kind: str) -> int | None:
        """``producer``, or the latest earlier task on its track that had ended by ``at``."""
        t = self.tasks[producer]
        if t.end <= at:
            return producer
        line = self.track_tasks[t.track]
        k = bisect.bisect_left(line, producer)
        for q in reversed(line[max(0, k - 64):k]):  # the 64 tasks before it at most
            if self.tasks[q].end <= at:
                self.report.retargeted[kind] += 1
                return q
        self.report.dropped[f"{kind}: producer ends after the consumer starts, nothing earlier ended"] += 1
        return None

    def flows(self) -> None:
        """Flow events other than launch correlations (forward -> backward) join tasks; the
        backward task also takes the annotations over its forward op (so a scope covers both)."""
        chains: dict[tuple, list[dict]] = {}
        for e in self.raw.flows:
            try:
                chains.setdefault((e.get("cat"), e.get("id")), []).append(e)
            except TypeError:  # a list or object as flow id or category: no chain to join
                self.report.skipped["flow event with a malformed id or category"] += 1
        starts = {t: [self.tasks[i].start for i in ids] for t, ids in self.track_tasks.items()}
        for chain in chains.values():
            chain.sort(key=lambda e: ("stf".index(e["ph"]), float(e["ts"])))
            for a, b in zip(chain, chain[1:]):
                src, dst = self._at(a, starts, False), self._at(b, starts, True)
                if src is None or dst is None or src == dst:
                    self.report.dropped["flow with an end on no task"] += 1
                    continue
                if (p := self.consistent(src, self.tasks[dst].start, "flow")) is not None and p != dst:
                    self.tasks[dst].deps.append(p)
                    self.report.deps[f"flow {a.get('cat')}"] += 1
                    if (anns := self.tasks[src].tags.get("annotations")) and "annotations" not in self.tasks[dst].tags:
                        self.tasks[dst].tags = dict(self.tasks[dst].tags, annotations=anns)

    def _at(self, e: dict, starts: dict, after: bool) -> int | None:
        """The task on flow event ``e``'s track containing its time; else the next one (``after``) or the previous."""
        track, ts = (e.get("pid"), e.get("tid")), float(e["ts"])
        line = self.track_tasks.get(track, [])
        k = bisect.bisect_right(starts.get(track, []), ts) - 1
        if k >= 0 and self.tasks[line[k]].end >= ts:
            return line[k]
        k = k + 1 if after else k
        return line[k] if 0 <= k < len(line) else None
