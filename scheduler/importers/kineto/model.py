"""The dependency model: how the events of one profiler trace become tasks and edges.

The table in docs/replay.md is the specification; in short:

* **Host threads** are chains of their outermost runtime calls (in a trace with no device
  activity: of their outermost CPU ops). The untraced host time between two calls is kept
  as the later call's delay, so the chain starts each call when the recording did.
* **Launch**: a kernel waits for its launch call. When the kernel started before the call
  returned, the call is split there, so the kernel starts at its launch, not after the call.
* **Stream order**: a device op waits for the previous op on its stream.
* **Event waits**: ``Stream Wait Event`` records (``wait_on_cuda_event_record_corr_id``)
  join the last op launched on the recorded stream before the event record to the first op
  launched on the waiting stream after the wait. A ``cudaStreamWaitEvent`` call with no such
  record (traces without sync events) is inferred from timing: the next op the thread
  launches waits for the op of another stream that ended last before it started, if that
  end explains the op's late start. Inferred edges are counted apart.
* **Host syncs** (device, stream and event syncs, synchronous copies, ``.item()``'s copy
  and stream sync) wait for the device ops they name (by sync record, else by call name and
  launch order). The call is split where the wait ended: its host part before, its return
  after; the time between is waiting, not host work.
* **Annotations** (``ProfilerStep#N``, ``user_annotation``, ``gpu_user_annotation``) and CPU
  ops are tags and context of the tasks beneath them, never tasks. A child that overhangs its
  parent (clock rounding) is clamped to it and counted.
* Every task keeps the untraced time between the moment its dependencies were met and its
  recorded start as its ``delay``. A dependency that contradicts the recording (its producer
  ends after the consumer starts) moves to the latest earlier task on the producer's track
  that had ended, and is counted; with none, it is dropped and counted.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

from megaloom.scheduler.importers.kineto.classes import (
    CONTEXT_CATEGORIES, DEVICE_CATEGORIES, HOST, RUNTIME_CATEGORIES, collective, cpu_class, device_class, sync_kind,
)
from megaloom.scheduler.importers.kineto.read import RawTrace, Slice
from megaloom.scheduler.importers.kineto.report import ImportReport
from megaloom.scheduler.importers.kineto.work import Work, comm_work, copy_work, has_formula, op_work


@dataclass(slots=True)
class Task:
    """One task of the imported graph; times in the file's microseconds."""

    name: str
    op: str
    engine: str
    label: str
    track: tuple
    start: float
    end: float
    deps: list[int] = field(default_factory=list)
    tags: dict[str, Any] = field(default_factory=dict)
    work: Work | None = None


@dataclass(slots=True)
class _Call:
    """An outermost host call and what the model attaches to it."""

    s: Slice
    anns: tuple
    ops: tuple  # enclosing CPU ops, outermost first
    nested: list[Slice] = field(default_factory=list)
    cuts: list[float] = field(default_factory=list)
    waits: list[int] = field(default_factory=list)  # device-op indices a sync waits for
    wait_kind: str = ""
    wait_inferred: bool = False
    launched: list[int] = field(default_factory=list)  # device-op indices
    pieces: list[int] = field(default_factory=list)  # task ids, in time order


@dataclass(slots=True)
class _Op:
    """A device op: its slice, annotations, launching call and task id."""

    s: Slice
    anns: tuple
    corr: int | None
    call: int = -1
    task: int = -1


def _spans(bounds: list[float], shrink_last: bool = False) -> list[tuple[float, float]]:
    """Consecutive ``(start, end)`` pairs of ``bounds``; ``shrink_last``: the last one lasts 0."""
    out = list(zip(bounds, bounds[1:]))
    if shrink_last:
        out[-1] = (out[-1][0], out[-1][0])
    return out


def _to_pageable(copy: str) -> bool:
    """A device-to-host copy into pageable memory: CUDA returns from even an async copy call
    only once such a copy has completed (CUDA runtime API, "API synchronization behavior")."""
    return "DtoH" in copy and "Pageable" in copy


def _corr(s: Slice | dict) -> int | None:
    args = s.args if isinstance(s, Slice) else s.get("args")
    c = args.get("correlation") if isinstance(args, dict) else None
    return c if type(c) is int else None


class Model:
    """Builds the tasks of one trace (:meth:`build`); ``inferred`` names the edges inferred from timing."""

    def __init__(self, raw: RawTrace, report: ImportReport, world_size: int | None):
        self.raw, self.report, self.world_size = raw, report, world_size
        self.tasks: list[Task] = []
        self.calls: list[_Call] = []
        self.ops: list[_Op] = []
        self.corr_call: dict[int, int] = {}
        self.thread_calls: dict[tuple, list[int]] = {}
        self.thread_busy: dict[tuple, list[list[float]]] = {}
        self.stream_ops: dict[tuple, list[int]] = {}
        self.track_tasks: dict[tuple, list[int]] = {}
        self.inferred: dict[int, list[int]] = {}  # consumer task -> producers of its inferred edges
        self.t0 = 0.0

    # -- sweeps ----------------------------------------------------------------------
    def build(self) -> list[Task]:
        host: dict[tuple, list[Slice]] = {}
        dev: dict[tuple, list[Slice]] = {}
        for s in self.raw.slices:
            (dev if s.cat in DEVICE_CATEGORIES or s.cat == "gpu_user_annotation" else host).setdefault((s.pid, s.tid), []).append(s)
        self.has_device = any(s.cat in DEVICE_CATEGORIES for v in dev.values() for s in v)
        if not self.has_device:
            host.update(dev)  # gpu annotations alone: context on their own track
            dev = {}
        starts = [s.start for s in self.raw.slices]
        self.t0 = min(starts, default=0.0)
        for track, items in host.items():
            self._host_sweep(track, items)
        for track, items in dev.items():
            self._device_sweep(track, items)
        self._link_launches()
        self._syncs()
        self._device_tasks()
        self._host_tasks()
        self._device_deps()
        self._flows()
        return self.tasks

    def _host_sweep(self, track: tuple, items: list[Slice]) -> None:
        """Outermost calls of one thread; annotations and CPU ops become their context."""
        items.sort(key=lambda s: (s.start, -s.end, s.seq))
        rep, gpu, calls_all, corr_call = self.report, self.has_device, self.calls, self.corr_call
        calls = self.thread_calls.setdefault(track, [])
        busy = self.thread_busy.setdefault(track, [])  # outermost CPU ops and calls: the thread at work
        context: dict[str, int] = {}
        stack: list[tuple[float, tuple, tuple, int]] = []  # (end, annotations, ops, owning call)
        top = (float("inf"), (), (), -1)
        for s in items:
            start = s.start
            while top[0] <= start:
                stack.pop()
                top = stack[-1] if stack else (float("inf"), (), (), -1)
            end, anns, ops, owner = top
            if s.end > end:  # overhangs its parent (clock rounding): clamp and count
                rep.overhangs += 1
                rep.max_overhang_us = max(rep.max_overhang_us, s.end - end)
                s.end = end
            cat = s.cat
            if cat in CONTEXT_CATEGORIES:
                context[cat] = context.get(cat, 0) + 1
                top = (s.end, anns + (s.name,) if cat == "user_annotation" else anns, ops, owner)
                stack.append(top)
                continue
            runtime = cat in RUNTIME_CATEGORIES
            if not ops and owner < 0:
                if busy and start <= busy[-1][1]:
                    busy[-1][1] = max(busy[-1][1], s.end)
                else:
                    busy.append([start, s.end])
            if owner < 0 and (runtime or not gpu):
                owner = len(calls_all)
                calls_all.append(_Call(s, anns, ops))
                calls.append(owner)
            else:
                if owner >= 0:
                    calls_all[owner].nested.append(s)
                key = cat or "uncategorised"
                context[key] = context.get(key, 0) + 1
            c = s.args.get("correlation")
            if type(c) is int and owner >= 0 and c not in corr_call:
                corr_call[c] = owner
            top = (s.end, anns, ops if runtime else ops + (s,), owner)
            stack.append(top)
        for k, n in context.items():
            rep.count("context", k, n)

    def _device_sweep(self, track: tuple, items: list[Slice]) -> None:
        """Device ops of one stream in start order, tagged with the GPU annotations over them."""
        items.sort(key=lambda s: (s.start, -s.end, s.seq))
        stack: list[tuple[float, tuple]] = []
        mine = self.stream_ops.setdefault(track, [])
        for s in items:
            while stack and stack[-1][0] <= s.start:
                stack.pop()
            anns = stack[-1][1] if stack else ()
            if s.cat == "gpu_user_annotation":
                self.report.count("context", s.cat)
                stack.append((s.end, anns + (s.name,)))
                continue
            mine.append(len(self.ops))
            self.ops.append(_Op(s, anns, _corr(s)))

    # -- correlations and syncs ------------------------------------------------------
    def _link_launches(self) -> None:
        self.by_corr: dict[tuple, tuple[list[int], list[int]]] = {}
        for track, ids in self.stream_ops.items():
            pairs = sorted((self.ops[i].corr, i) for i in ids if self.ops[i].corr is not None)
            self.by_corr[track] = ([c for c, _ in pairs], [i for _, i in pairs])
        for i, op in enumerate(self.ops):
            ci = self.corr_call.get(op.corr) if op.corr is not None else None
            if ci is None:
                self.report.count("deps", "device op without a recorded launch (stream order only)")
                continue
            op.call = ci
            call = self.calls[ci]
            call.launched.append(i)
            if call.s.start < op.s.start < call.s.end:
                call.cuts.append(op.s.start)

    def _last_before(self, stream: tuple, corr: int) -> int | None:
        corrs, ids = self.by_corr.get(stream, ((), ()))
        k = bisect.bisect_left(corrs, corr) - 1
        return ids[k] if k >= 0 else None

    def _first_after(self, stream: tuple, corr: int) -> int | None:
        corrs, ids = self.by_corr.get(stream, ((), ()))
        k = bisect.bisect_right(corrs, corr)
        return ids[k] if k < len(ids) else None

    def _streams_of(self, device: Any) -> list[tuple]:
        return [t for t in self.stream_ops if device is None or t[0] == device]

    def _syncs(self) -> None:
        """Host syncs and GPU-side event waits, from sync records, else from call names and timing."""
        self.explicit_waits: list[tuple[int, int]] = []  # (producer op, consumer op)
        recorded: set[int] = set()
        for e in self.raw.syncs:
            args = e.get("args") if isinstance(e.get("args"), dict) else {}
            kind = str(args.get("cuda_sync_kind", e.get("name", "")))
            c, pid = _corr(e), e.get("pid")
            rec = args.get("wait_on_cuda_event_record_corr_id")
            on = args.get("wait_on_stream")
            if kind == "Stream Wait Event":
                consumer_stream = (pid, args.get("stream", e.get("tid")))
                if c is None or type(rec) is not int or rec < 0 or on is None or on == -1:
                    self.report.count("skipped", "stream waits on an event recorded outside the trace")
                    continue
                recorded.add(c)
                p, q = self._last_before((pid, on), rec), self._first_after(consumer_stream, c)
                if p is not None and q is not None:
                    self.explicit_waits.append((p, q))
                else:
                    self.report.count("skipped", "stream wait on a stream with no op before the event record")
                continue
            call = self.corr_call.get(c) if c is not None else None
            if call is None:
                self.report.count("skipped", f"{kind} record without its host call")
                continue
            if kind == "Context Sync":
                waits = [self._last_before(t, c) for t in self._streams_of(pid)]
            elif kind == "Stream Sync":
                waits = [self._last_before((pid, args.get("stream", e.get("tid"))), c)]
            elif kind == "Event Sync" and type(rec) is int and rec >= 0 and on not in (None, -1):
                waits = [self._last_before((pid, on), rec)]
            else:
                self.report.count("skipped", f"{kind} record naming no stream or event")
                continue
            recorded.add(c)
            self._wait(call, [w for w in waits if w is not None], kind.lower().replace(" ", "_"))
        self.pending_waits: set[int] = set()  # calls whose GPU-side wait is inferred
        for ci, call in enumerate(self.calls):
            c = _corr(call.s)
            if c in recorded:
                continue
            kind = sync_kind(call.s.name)
            copies = [i for i in call.launched if self.ops[i].s.cat in ("gpu_memcpy", "gpu_memset")]
            if kind == "wait":
                self.pending_waits.add(ci)
            elif kind == "device" and c is not None:
                waits = [self._last_before(t, c) for t in self.stream_ops]
                self._wait(ci, [w for w in waits if w is not None], "device_sync", inferred=False)
            elif kind in ("stream", "event") and c is not None:
                cands = [w for w in (self._last_before(t, c) for t in self.stream_ops)
                         if w is not None and self.ops[w].s.end <= call.s.end]
                if cands:
                    self._wait(ci, [max(cands, key=lambda w: self.ops[w].s.end)], f"{kind}_sync", inferred=True)
            elif copies and (kind == "copy" or any(_to_pageable(self.ops[i].s.name) for i in copies)):
                done = [i for i in copies if self.ops[i].s.end <= call.s.end]
                if done:
                    self._wait(ci, done, "synchronous_copy", inferred=False)
                else:
                    self.report.count("skipped", "copy call returned before its copy ended (asynchronous)")

    def _wait(self, ci: int, ops: list[int], kind: str, inferred: bool = False) -> None:
        call = self.calls[ci]
        call.waits.extend(ops)
        call.wait_kind, call.wait_inferred = kind, inferred
        self.report.count("inferred" if inferred else "deps", kind)

    # -- tasks -----------------------------------------------------------------------
    def _new(self, t: Task) -> int:
        self.tasks.append(t)
        self.track_tasks.setdefault(t.track, []).append(len(self.tasks) - 1)
        return len(self.tasks) - 1

    def _device_tasks(self) -> None:
        rep = self.report
        shares: dict[int, list[int]] = {}  # launching CPU op (by seq) -> its kernels
        op_of: dict[int, Slice] = {}
        for track, ids in self.stream_ops.items():
            for i in ids:
                op = self.ops[i]
                s = op.s
                cls = device_class(s.name, s.cat)
                call = self.calls[op.call] if op.call >= 0 else None
                tags: dict[str, Any] = {"category": s.cat, "class": cls.label, "stream": s.tid}
                if op.anns:
                    tags["annotations"] = list(op.anns)
                grid = s.args.get("grid")
                if isinstance(grid, list) and grid and all(type(g) is int and g > 0 for g in grid):
                    blocks = 1
                    for g in grid:
                        blocks *= g
                    tags["blocks"] = blocks
                work, name = None, s.name
                if cls.engine == "copy":
                    work = copy_work(s.name, s.args)
                    if work is not None and work.comm_bytes:
                        tags["link"] = work.link
                elif cls.engine == "comm":
                    work, name = self._comm(s, call, tags)
                elif call is not None:
                    src = self._launching_op(call)
                    if src is not None:
                        shares.setdefault(src.seq, []).append(len(self.tasks))
                        op_of[src.seq] = src
                if call is not None and call.ops:
                    tags["launched_by"] = call.ops[-1].name
                op.task = self._new(Task(s.name, name, cls.engine, cls.label, track, s.start, s.end, tags=tags, work=work))
        for seq, tids in shares.items():  # an op's figures shared among its kernels by recorded duration
            w = op_work(op_of[seq].name, op_of[seq].args)
            if w is None:
                continue
            total = sum(self.tasks[t].end - self.tasks[t].start for t in tids)
            for t in tids:
                f = (self.tasks[t].end - self.tasks[t].start) / total if total > 0 else 1.0 / len(tids)
                self.tasks[t].work = Work(w.flops * f, w.bytes * f, 0.0, w.precision)
        for op in self.ops:
            w = self.tasks[op.task].work
            if w is not None and (w.flops or w.bytes or w.comm_bytes):
                rep.with_work += 1
            else:
                rep.without_work += 1
        rep.device_ops = len(self.ops)

    @staticmethod
    def _launching_op(call: _Call) -> Slice | None:
        """The CPU op whose shapes describe the call's kernels: the nearest one up the stack with
        its own formula (GEMM, convolution), else the innermost one with recorded shapes."""
        for s in reversed(call.ops):
            if has_formula(s.name) and "Input Dims" in s.args:
                return s
        for s in reversed(call.ops):
            if "Input Dims" in s.args:
                return s
        return None

    def _comm(self, s: Slice, call: _Call | None, tags: dict) -> tuple[Work | None, str]:
        """Figures and op name of a comm kernel: its own arguments, else its launching op's."""
        src = s.args if "Collective name" in s.args or "In msg nelems" in s.args else None
        if src is None and call is not None:
            src = next((o.args for o in reversed(call.ops) if "Collective name" in o.args or "In msg nelems" in o.args), None)
        src = src or {}
        kind = collective(str(src.get("Collective name", ""))) or collective(s.name)
        pg, seq = src.get("Process Group Name"), src.get("Seq", src.get("seq"))
        if pg is not None:
            tags["pg"] = str(pg)
        if type(seq) is int:
            tags["seq"] = seq
        work = comm_work(kind, src, self.world_size)
        if work is not None:
            tags["link"] = work.link
        return work, kind or s.name

    def _host_tasks(self) -> None:
        """Each call as one task, or as pieces cut at launch points and at its sync's return."""
        rep = self.report
        for track, ids in self.thread_calls.items():
            prev = None
            busy = self.thread_busy.get(track, [])
            k, at = 0, self.t0
            for ci in ids:
                call = self.calls[ci]
                self._pieces(track, call)
                for p in call.pieces:  # program order on the thread
                    t = self.tasks[p]
                    if prev is not None:
                        t.deps.insert(0, prev)
                    if "sync" not in t.tags:  # the time before a sync's return was waiting
                        k = self._cpu_time(t, busy, k, at)
                    prev, at = p, t.end
            last = busy[-1][1] if busy else at
            if prev is not None and last > at:  # CPU work after the last call: the thread ends later
                t = Task("thread end", "thread end", "host", HOST.label, track, last, last, [prev],
                         {"category": "end of thread", "class": HOST.label, "thread": track[1]})
                self._cpu_time(t, busy, k, at)
                self._new(t)
        rep.host_calls = len(self.calls)

    @staticmethod
    def _cpu_time(t: Task, busy: list[list[float]], k: int, since: float) -> int:
        """Tag ``t`` with the seconds of ``[since, t.start)`` spent inside CPU ops (``cpu``); the
        rest of that gap the thread was idle. ``k``: first busy interval that may overlap."""
        while k < len(busy) and busy[k][1] <= since:
            k += 1
        covered, j = 0.0, k
        while j < len(busy) and busy[j][0] < t.start:
            covered += max(0.0, min(busy[j][1], t.start) - max(busy[j][0], since))
            j += 1
        if covered > 0:
            t.tags["cpu"] = covered * 1e-6
        return k

    def _pieces(self, track: tuple, call: _Call) -> None:
        s, rep = call.s, self.report
        op = s.name
        if self.has_device or s.cat in RUNTIME_CATEGORIES:
            engine, label = "host", HOST.label
        else:
            cls = cpu_class(s.name)
            engine, label = cls.engine, cls.label
            if s.cat not in ("cpu_op", ""):
                rep.opaque += 1
                op = "opaque"
        waits = [w for w in (self._consistent(self.ops[i].task, s.end, "sync") for i in call.waits) if w is not None]
        ret = max((self.tasks[w].end for w in waits), default=s.start)
        cuts = sorted(set(call.cuts)) if call.cuts else call.cuts
        if not cuts and not waits:
            spans, wait_piece = ((s.start, s.end),), 0
        elif ret > s.start:  # the call waited: host part, then (after the waiting) its return
            spans = _spans([s.start, *(c for c in cuts if c < ret), ret], shrink_last=True) + \
                _spans([ret, *(c for c in cuts if c > ret), s.end])
            wait_piece = len(spans) - 1 - sum(1 for c in cuts if c > ret)
        else:
            spans, wait_piece = _spans([s.start, *cuts, s.end]), len(cuts)
        tags: dict[str, Any] = {"category": s.cat or "uncategorised", "class": label, "thread": s.tid}
        if call.anns:
            tags["annotations"] = list(call.anns)
        if call.ops:
            tags["op"] = call.ops[-1].name
        if s.truncated:
            tags["truncated"] = True
            rep.truncated += 1
        work = None
        if not self.has_device:  # the CPU was the device: the nest's GEMM, else the op itself
            src = next((n for n in reversed(call.nested) if has_formula(n.name) and "Input Dims" in n.args), s)
            work = op_work(src.name, src.args)
        if len(spans) == 1:
            call.pieces.append(self._new(Task(s.name, op, engine, label, track, s.start, s.end, [], tags, work)))
        else:
            rep.split_calls += 1
            for k, (a, b) in enumerate(spans):
                call.pieces.append(self._new(Task(s.name, op, engine, label, track, a, b, [], dict(tags, piece=k), work)))
        if waits:
            t = self.tasks[call.pieces[wait_piece]]
            t.deps.extend(waits)
            if call.wait_inferred:
                self.inferred.setdefault(call.pieces[wait_piece], []).extend(waits)
            t.tags = dict(t.tags, sync=call.wait_kind)

    # -- dependencies ----------------------------------------------------------------
    def _consistent(self, producer: int, at: float, kind: str) -> int | None:
        """``producer``, or the latest earlier task on its track that had ended by ``at``."""
        t = self.tasks[producer]
        if t.end <= at:
            return producer
        line = self.track_tasks[t.track]
        k = bisect.bisect_left(line, producer) - 1
        for _ in range(64):
            if k < 0:
                break
            if self.tasks[line[k]].end <= at:
                self.report.count("retargeted", kind)
                return line[k]
            k -= 1
        self.report.count("dropped", f"{kind}: producer ends after the consumer starts, nothing earlier ended")
        return None

    def _device_deps(self) -> None:
        rep = self.report
        for track, ids in self.stream_ops.items():
            prev = None
            for i in ids:
                op = self.ops[i]
                t = self.tasks[op.task]
                if op.call >= 0:
                    launch = self._launch_piece(self.calls[op.call], t.start)
                    if launch is not None:
                        t.deps.append(launch)
                        rep.count("deps", "launch")
                if prev is not None:
                    p = self._consistent(self.ops[prev].task, t.start, "stream order")
                    if p is not None:
                        t.deps.append(p)
                        rep.count("deps", "stream order")
                prev = i
        for p, q in self.explicit_waits:
            t = self.tasks[self.ops[q].task]
            p2 = self._consistent(self.ops[p].task, t.start, "event wait")
            if p2 is not None:
                t.deps.append(p2)
                rep.count("deps", "event wait")
        self._infer_waits()

    def _launch_piece(self, call: _Call, at: float) -> int | None:
        """The piece of ``call`` that ends where a kernel starting at ``at`` was launched."""
        done = [p for p in call.pieces if self.tasks[p].end <= at]
        if done:
            return done[-1]
        # the kernel starts before its launch call: the clocks disagree; the thread's last task done by then
        prev = self._consistent(call.pieces[0], at, "launch (kernel starts before its launch call)")
        return prev

    def _infer_waits(self) -> None:
        """A ``cudaStreamWaitEvent`` with no sync record: the thread's next launched op waits for
        the op of another stream of its device that ended last before it started, when that
        end comes after the op's own dependencies were met."""
        if not self.pending_waits:
            return
        ends = {}
        for track, ids in self.stream_ops.items():
            pairs = sorted((self.ops[i].s.end, self.ops[i].task) for i in ids)
            ends[track] = ([e for e, _ in pairs], [t for _, t in pairs])
        for track, ids in self.thread_calls.items():
            pending = False
            for ci in ids:
                call = self.calls[ci]
                if ci in self.pending_waits:
                    pending = True
                    continue
                if not pending or not call.launched:
                    continue
                pending = False
                op = self.ops[min(call.launched, key=lambda i: self.ops[i].s.start)]
                t = self.tasks[op.task]
                ready = max((self.tasks[d].end for d in t.deps), default=self.t0)
                best = None
                for other, (e, tids) in ends.items():
                    if other[0] != op.s.pid or other == (op.s.pid, op.s.tid):
                        continue  # only another stream of the same device
                    k = bisect.bisect_right(e, t.start) - 1
                    if k >= 0 and e[k] > ready and (best is None or e[k] > self.tasks[best].end):
                        best = tids[k]
                if best is not None:
                    t.deps.append(best)
                    self.inferred.setdefault(op.task, []).append(best)
                    self.report.count("inferred", "event wait (from timing)")
                else:
                    self.report.count("skipped", "stream wait with nothing to wait for")

    def _flows(self) -> None:
        """Flow events other than launch correlations (e.g. forward -> backward) join host tasks."""
        chains: dict[tuple, list[dict]] = {}
        for e in self.raw.flows:
            if e.get("cat") == "ac2g":
                continue  # launch correlations: already edges
            try:
                chains.setdefault((e.get("cat"), e.get("id")), []).append(e)
            except TypeError:  # a list or object as flow id or category: no chain to join
                self.report.count("skipped", "flow event with a malformed id or category")
        starts = {t: [self.tasks[i].start for i in ids] for t, ids in self.track_tasks.items()}
        for chain in chains.values():
            chain.sort(key=lambda e: ("stf".index(e["ph"]), float(e["ts"])))
            for a, b in zip(chain, chain[1:]):
                src, dst = self._at((a.get("pid"), a.get("tid")), float(a["ts"]), starts, False), \
                    self._at((b.get("pid"), b.get("tid")), float(b["ts"]), starts, True)
                if src is None or dst is None or src == dst:
                    self.report.count("dropped", "flow with an end on no task")
                    continue
                p = self._consistent(src, self.tasks[dst].start, "flow")
                if p is not None and p != dst:
                    self.tasks[dst].deps.append(p)
                    self.report.count("deps", f"flow {a.get('cat')}")

    def _at(self, track: tuple, ts: float, starts: dict, after: bool) -> int | None:
        """The task on ``track`` containing ``ts``; else the next one (``after``) or the previous."""
        st = starts.get(track)
        if not st:
            return None
        line = self.track_tasks[track]
        k = bisect.bisect_right(st, ts) - 1
        if k >= 0 and self.tasks[line[k]].end >= ts:
            return line[k]
        if after:
            return line[k + 1] if k + 1 < len(line) else None
        return line[k] if k >= 0 else None
