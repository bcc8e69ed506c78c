"""Waiting: what each host call and device op waited for, recorded or derived from timing.

Waiting becomes an edge, so a what-if moves it; only what no record or timing explains
stays a fixed delay (the frozen share each replay reports).

* **Sync records** (``cuda_sync``): ``Stream Wait Event`` joins the last op launched on the
  recorded stream before the event record to the first op launched on the waiting stream
  after the wait; ``Context``/``Stream``/``Event Sync`` make the call wait for the last op
  launched before it on every stream / that stream / the event's stream.
* **Sync calls** without a record, by name (:data:`~.classes.SYNC_CALLS`): a device sync
  waits for the last op launched on every stream; a stream or event sync for the op that
  ended last before it returned (inferred); a synchronous copy, or an async copy to
  pageable memory, for its own copy.
* **Implicit syncs** (inferred): a call that lasted far longer than calls of its name
  usually do and returned right after a device op ended was blocked on it: a full launch
  queue, the allocator synchronising, a copy (:data:`~.classes.IMPLICIT_SYNCS` names the cause).
* **Unrecorded waits** (inferred, :func:`explain`): after a ``cudaStreamWaitEvent`` call with
  no record, the next op the thread launches waits for the op of another stream of its device
  that ended last before it started, if that end came after its own dependencies were met; a
  host thread that sat idle and woke just after a collective or another thread's last task
  ended waited for it (``work.wait()``, the autograd engine's join); a host thread idle right
  after handing a collective over, until after that collective ended, waited for it however
  late it woke (a synchronous ``all_reduce`` on a loaded machine).
"""
from __future__ import annotations

import bisect
import statistics

from megaloom.runtime.registry import COMM, HOST
from megaloom.scheduler.importers.kineto.classes import collective, implicit_sync, sync_kind
from megaloom.scheduler.importers.kineto.model import Call, Model, corr, index

LONG_CALL_US = 50.0
"""A call shorter than this never counts as blocked (nor one under 4x its name's median)."""
RETURN_US = 30.0
"""A blocked call returns within this of the device op it waited for."""
HOST_WAIT_US = 200.0
"""A host thread idle for longer than this waited for something ..."""
WAKE_US = 250.0
"""... when it woke within this of that thing's end."""


def _to_pageable(copy: str) -> bool:
    """A device-to-host copy into pageable memory: CUDA returns from even an async copy call
    only once such a copy has completed (CUDA runtime API, "API synchronization behavior")."""
    return "DtoH" in copy and "Pageable" in copy


def _adjacent(m: Model, stream: tuple, c: int, after: bool = False) -> int | None:
    """The last op launched on ``stream`` before correlation id ``c`` (``after``: the first one after it)."""
    corrs, ids = m.by_corr.get(stream, ((), ()))
    k = bisect.bisect_right(corrs, c) if after else bisect.bisect_left(corrs, c) - 1
    return ids[k] if 0 <= k < len(ids) else None


def _wait(call: Call, ops: list, kind: str, inferred: bool = False) -> None:
    call.waits.extend(o for o in ops if o is not None)
    call.wait_kind, call.wait_inferred = kind, inferred


def syncs(m: Model) -> None:
    """Host syncs and GPU-side event waits: sync records, then sync calls, then implicit syncs."""
    recorded: set[int] = set()
    streams = list(m.stream_ops)
    for e in m.raw.syncs:
        args = e.get("args") if isinstance(e.get("args"), dict) else {}
        kind = str(args.get("cuda_sync_kind", e.get("name", "")))
        c, pid = corr(e), e.get("pid")
        rec, on = args.get("wait_on_cuda_event_record_corr_id"), args.get("wait_on_stream")
        event = type(rec) is int and rec >= 0 and on not in (None, -1)
        stream = (pid, args.get("stream", e.get("tid")))
        if kind == "Stream Wait Event":
            if c is None or not event:
                m.report.skipped["stream waits on an event recorded outside the trace"] += 1
                continue
            recorded.add(c)
            p, q = _adjacent(m, (pid, on), rec), _adjacent(m, stream, c, after=True)
            if p is None or q is None:
                m.report.skipped["stream wait on a stream with no op before the event record"] += 1
            else:
                m.explicit_waits.append((p, q))
            continue
        if (ci := m.corr_call.get(c)) is None:
            m.report.skipped[f"{kind} record without its host call"] += 1
            continue
        if kind == "Context Sync":
            waits = [_adjacent(m, t, c) for t in streams if pid is None or t[0] == pid]
        elif kind == "Stream Sync":
            waits = [_adjacent(m, stream, c)]
        elif kind == "Event Sync" and event:
            waits = [_adjacent(m, (pid, on), rec)]
        else:
            m.report.skipped[f"{kind} record naming no stream or event"] += 1
            continue
        recorded.add(c)
        _wait(m.calls[ci], waits, kind.lower().replace(" ", "_"))
    for ids in m.thread_calls.values():  # after a stream wait with no record, the next launched op
        waiting = False
        for ci in ids:
            call = m.calls[ci]
            if sync_kind(call.s.name) == "wait" and corr(call.s) not in recorded:
                waiting = True
            elif waiting and call.launched:
                m.after_wait.add(min(call.launched, key=lambda i: m.ops[i].s.start))
                waiting = False
    for call in m.calls:
        if (c := corr(call.s)) is None or c in recorded:
            continue
        kind = sync_kind(call.s.name)
        copies = [i for i in call.launched if m.ops[i].s.cat in ("gpu_memcpy", "gpu_memset")]
        if kind == "device":
            _wait(call, [_adjacent(m, t, c) for t in streams], "device_sync")
        elif kind in ("stream", "event"):
            cands = [w for w in (_adjacent(m, t, c) for t in streams) if w is not None and m.ops[w].s.end <= call.s.end]
            if cands:
                _wait(call, [max(cands, key=lambda w: m.ops[w].s.end)], f"{kind}_sync", inferred=True)
        elif copies and (kind == "copy" or any(_to_pageable(m.ops[i].s.name) for i in copies)):
            if done := [i for i in copies if m.ops[i].s.end <= call.s.end]:
                _wait(call, done, "synchronous_copy")
            else:
                m.report.skipped["copy call returned before its copy ended (asynchronous)"] += 1
    _implicit(m)


def _implicit(m: Model) -> None:
    """Calls blocked on the device with no sync of their own (see the module docstring)."""
    durations: dict[str, list[float]] = {}
    for call in m.calls:
        durations.setdefault(call.s.name, []).append(call.s.end - call.s.start)
    typical = {k: statistics.median(v) for k, v in durations.items()}
    keys, ops = index((op.s.end, i) for i, op in enumerate(m.ops))
    for call in m.calls:
        s = call.s
        if call.waits or call.wait_kind or s.end - s.start < max(LONG_CALL_US, 4 * typical[s.name]):
            continue
        k = bisect.bisect_right(keys, s.end) - 1
        while k >= 0 and ops[k] in call.launched:
            k -= 1
        if k >= 0 and s.start < keys[k] and s.end - keys[k] <= RETURN_US:
            _wait(call, [ops[k]], f"implicit sync: {implicit_sync(s.name)}", inferred=True)


def handed_over(m: Model) -> dict[int, int]:
    """A backend thread's collective waits for the ``c10d::`` op that handed it over (the k-th
    of each kind issued, in start order, with the k-th that ran); returns op -> collective."""
    handed: dict[int, int] = {}
    issued, ran = {}, {}  # collective kind -> the c10d ops issuing it / the backend's tasks running it
    for i, t in enumerate(m.tasks):
        if t.engine == HOST and t.op.startswith("c10d::") and (kind := collective(t.op)):
            issued.setdefault(kind, []).append(i)
        elif t.engine == COMM and t.tags["class"] == "cpu_comm" and "peer" not in t.tags:
            ran.setdefault(t.op, []).append(i)
    for kind, ids in ran.items():
        ids.sort(key=lambda i: m.tasks[i].start)
        for q, op in zip(ids, sorted(issued.get(kind, ()), key=lambda i: m.tasks[i].start)):
            handed[op] = q
            if (anns := m.tasks[op].tags.get("annotations")) and "annotations" not in m.tasks[q].tags:
                m.tasks[q].tags = dict(m.tasks[q].tags, annotations=anns)  # the scope that issued it
            p = m.consistent(op, m.tasks[q].start, "collective handed over")
            if p is not None and m.tasks[p].track != m.tasks[q].track:
                m.tasks[q].deps.append(p)
                m.report.deps["collective handed over"] += 1
    return handed


def explain(m: Model) -> None:
    """Unrecorded waits of device ops and host threads (see the module docstring)."""
    handed = handed_over(m)
    prev = {b: a for ids in m.track_tasks.values() for a, b in zip(ids, ids[1:])}
    by_end = {track: index((m.tasks[i].end, i) for i in ids) for track, ids in m.track_tasks.items()}
    next_start = {a: m.tasks[b].start for ids in m.track_tasks.values() for a, b in zip(ids, ids[1:])}
    waited = {m.ops[i].task for i in m.after_wait}
    for i, t in enumerate(m.tasks):
        if not t.deps:
            continue
        ready = max(m.tasks[d].end for d in t.deps)
        if i in waited:  # the latest end on another stream of its device
            others = [tr for tr in m.stream_ops if tr != t.track and tr[0] == t.track[0]]
            if (best := _latest(by_end, others, t.start, ready)) is not None:
                m.infer(i, best, "event wait (from timing)")
            else:
                m.report.skipped["stream wait with nothing to wait for"] += 1
        elif "stream" not in t.tags and t.start - ready > HOST_WAIT_US:
            q = handed.get(prev.get(i, -1))
            if q is not None and m.tasks[prev[i]].end < m.tasks[q].end <= t.start:  # a synchronous collective
                m.infer(i, q, "host waits for the collective it handed over (from timing)")
                continue
            marks = m.thread_marks.get(t.track, [])
            lo, hi = bisect.bisect_right(marks, ready), bisect.bisect_left(marks, t.start)
            times = [ready, *marks[lo:hi], t.start]
            gap, woke = max((b - a, b) for a, b in zip(times, times[1:]))
            if gap <= HOST_WAIT_US:
                continue
            if (best := _woken_by(m, by_end, t.track, woke, woke - gap, next_start)) is not None:
                kind = "collective" if m.tasks[best].engine == COMM else "another thread"
                m.infer(i, best, f"host waits for {kind} (from timing)")


def _woken_by(m: Model, by_end: dict, track: tuple, woke: float, since: float, next_start: dict) -> int | None:
    """The last task of another thread that ended in ``(since, woke]``, after which that thread
    did nothing until ``woke`` (its last activity within :data:`WAKE_US` of it)."""
    best, best_at = None, since
    for other, (ends, ids) in by_end.items():
        if other == track or other in m.stream_ops:
            continue
        k = bisect.bisect_right(ends, woke) - 1
        if k < 0 or ends[k] <= since or next_start.get(ids[k], woke) < woke:
            continue
        marks = m.thread_marks.get(other, ())
        j = bisect.bisect_right(marks, woke) - 1
        last = max(ends[k], marks[j] if j >= 0 else ends[k])
        if woke - last <= WAKE_US and last > best_at:
            best, best_at = ids[k], last
    return best


def _latest(by_end: dict, tracks: list[tuple], at: float, after: float) -> int | None:
    """The task ending last in ``(after, at]`` on ``tracks``."""
    best, best_end = None, after
    for track in tracks:
        ends, ids = by_end.get(track, ((), ()))
        k = bisect.bisect_right(ends, at) - 1
        if k >= 0 and ends[k] > best_end:
            best, best_end = ids[k], ends[k]
    return best
