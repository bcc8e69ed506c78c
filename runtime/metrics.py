"""Metrics of a trace: makespan, busy time and utilisation per engine, comm hidden under
compute, cube/vector overlap, critical path, and a text summary.

Comm hidden, overlap and the critical path are over device engines only: ``host`` work
(runtime calls of an imported trace) is neither compute nor comm, and on the critical path
it only carries dependencies (the path is the longest chain of device work).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from graphlib import CycleError, TopologicalSorter

import numpy as np

from megaloom.runtime.errors import TraceFormatError
from megaloom.runtime.registry import COMM, CUBE, HOST, VECTOR
from megaloom.runtime.trace import Columns, Trace, TraceEvent

COMPUTE = (CUBE, VECTOR)
HOST_ENGINES = frozenset({HOST})
"""Engine kinds that are not device work."""


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint union of intervals."""
    return _union_of(*(np.array(x, dtype=np.float64) for x in zip(*intervals))) if intervals else []


def measure(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def intersect(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> float:
    """Length of the intersection of two disjoint sorted interval lists."""
    i = j = 0
    total = 0.0
    while i < len(x) and j < len(y):
        lo, hi = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if hi > lo:
            total += hi - lo
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def _host(c: Columns) -> np.ndarray:
    """Per event, whether it is host work (not device work)."""
    return np.isin(c.engine.index, [k for k, e in enumerate(c.engine.values) if e in HOST_ENGINES])


def critical_path(events: list[TraceEvent] | Columns) -> float:
    """Longest chain of device task durations along recorded dependencies (per rank); host
    tasks lie on chains but add no time, so the path is at most the device span.

    The events of each rank are taken in task id order when every dependency is an earlier
    task (as executors and the simulator record them), else in an order of the dependencies
    (a cycle raises TraceFormatError)."""
    c = events if isinstance(events, Columns) else Columns.of_events(events)
    keys = list(zip(c.column("rank"), c.column("task_id")))
    row = dict(zip(keys, range(len(keys))))
    deps = [[(k[0], d) for d in ds if (k[0], d) in row] for k, ds in zip(keys, c.column("deps"))]
    weight = np.where(_host(c), 0.0, c.end - c.start).tolist()  # host work carries dependencies only
    if all(d < k for k, ds in zip(keys, deps) for d in ds):
        order = sorted(row)
    else:
        try:
            order = list(TopologicalSorter(dict(zip(keys, deps))).static_order())
        except CycleError as e:
            raise TraceFormatError(f"trace dependencies form a cycle through task "
                                   f"{c.column('task')[row[e.args[1][0]]]!r}") from None
    finish: dict[tuple[int, int], float] = {}
    for k in order:
        i = row[k]
        finish[k] = max((finish[d] for d in deps[i]), default=0.0) + weight[i]
    return max(finish.values(), default=0.0)


def _tag_seconds(e: TraceEvent, key: str) -> float:
    v = e.tags.get(key, 0.0)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 else 0.0


def busy_path(events: list[TraceEvent]) -> tuple[float, dict[str, float]]:
    """The longest chain of busy time along dependencies, host work included, as Holistic Trace
    Analysis defines its critical path: device ops with the delay before them (launch and
    queue latency), host calls with the CPU-op time before them (tag ``cpu``), not idle host
    time nor waiting in syncs. Returns its length and its time per engine kind (``delay``:
    device latency). Events must be in dependency order within a rank (task ids, as traces keep them).
    """
    best, best_key = 0.0, None
    # per (rank, task id): path length to its end, the task before it, (duration, gap before), lane
    finish, via, weight, lane = {}, {}, {}, {}
    for e in sorted(events, key=lambda e: (e.rank, e.task_id)):
        key = (e.rank, e.task_id)
        lane[key] = (e.rank, e.engine, e.unit)
        host = e.engine in HOST_ENGINES
        gap = _tag_seconds(e, "cpu") if host else _tag_seconds(e, "delay")
        # a host call's CPU time before it follows its thread's previous call; via another
        # dependency (a flow from another thread) that time overlaps the path already counted
        prev = max(((finish[(e.rank, d)] + (gap if not host or lane[(e.rank, d)] == lane[key] else 0.0), (e.rank, d))
                    for d in e.deps if (e.rank, d) in finish), default=(gap, None))
        weight[key] = (e.duration, prev[0] - (finish[prev[1]] if prev[1] is not None else 0.0))
        finish[key], via[key] = prev[0] + e.duration, prev[1]
        if finish[key] > best:
            best, best_key = finish[key], key
    parts: Counter[str] = Counter()
    while best_key is not None:
        dur, gap = weight[best_key]
        kind = lane[best_key][1]
        parts[kind] += dur
        if gap:
            parts[HOST if kind in HOST_ENGINES else "delay"] += gap
        best_key = via[best_key]
    return best, dict(parts)


def _device_span(c: Columns) -> float:
    """First device task start to last device task end (the makespan when there is no host work)."""
    dev = ~_host(c)
    return float(c.end[dev].max() - c.start[dev].min()) if dev.any() else 0.0


def _union_of(start: np.ndarray, end: np.ndarray) -> list[tuple[float, float]]:
    """:func:`union` of intervals given as arrays (no arithmetic: the ends are the given ones)."""
    if not len(start):
        return []
    o = np.lexsort((end, start))
    a, b = start[o], end[o]
    reach = np.maximum.accumulate(b)
    new = np.ones(len(a), dtype=bool)
    new[1:] = a[1:] > reach[:-1]
    first = np.flatnonzero(new)
    last = np.append(first[1:] - 1, len(a) - 1)
    return list(zip(a[first].tolist(), reach[last].tolist()))


@dataclass(slots=True)
class Metrics:
    makespan: float
    busy: dict[str, float]
    utilisation: dict[str, float]
    comm_time: float
    comm_hidden: float
    cube_vector_overlap: float
    critical_path: float
    tasks: int
    device_span: float = 0.0

    @property
    def exposed_comm(self) -> float:
        """Comm time (per rank) not hidden under compute."""
        return self.comm_time * (1.0 - self.comm_hidden)


def metrics(trace: Trace) -> Metrics:
    """Per-rank figures averaged over ranks; utilisation uses ``meta['units']`` when present."""
    c = trace.columns
    span = float(c.end.max() - c.start.min()) if len(c) else 0.0
    units = trace.meta.get("units", {})
    rank_ids = np.unique(c.rank).tolist()
    ranks = max(1, len(rank_ids))
    names, eng = c.engine.values, c.engine.index
    used, first = np.unique(eng, return_index=True)
    seen = used[np.argsort(first)].tolist()  # engines in order of first use
    sums = np.bincount(eng, weights=c.end - c.start, minlength=len(names))
    busy = {names[k]: float(sums[k]) for k in seen}
    util = {}
    for k in seen:
        lanes = len(set(zip(c.rank[eng == k].tolist(), c.unit[eng == k].tolist())))
        m = units.get(names[k]) or lanes / ranks
        util[names[k]] = busy[names[k]] / (m * ranks * span) if span > 0 and m else 0.0
    code = {e: k for k, e in enumerate(names)}
    comm_total = hidden = overlap = 0.0
    for r in rank_ids:
        sel = {e: (c.rank == r) & (eng == code.get(e, -1)) for e in (COMM, CUBE, VECTOR)}
        per = {e: _union_of(c.start[s], c.end[s]) for e, s in sel.items()}
        comm_total += measure(per[COMM])
        hidden += intersect(per[COMM], union(per[CUBE] + per[VECTOR]))
        overlap += intersect(per[CUBE], per[VECTOR])
    return Metrics(makespan=span, busy=busy, utilisation=util, comm_time=comm_total / ranks,
                   comm_hidden=hidden / comm_total if comm_total > 0 else 0.0, cube_vector_overlap=overlap / ranks,
                   critical_path=critical_path(c), tasks=len(c), device_span=_device_span(c))


def time_unit(s: float) -> tuple[float, str]:
    """The unit to show ``s`` seconds in: (seconds per unit, its name), the largest of s, ms, us, ns not above it."""
    return next(((f, u) for f, u in ((1.0, "s"), (1e-3, "ms"), (1e-6, "us")) if abs(s) >= f), (1e-9, "ns"))


def _fmt_time(s: float) -> str:
    f, unit = time_unit(s)
    return f"{s / f:.{1 if unit == 'ns' else 3}f} {unit}"


def summary(trace: Trace) -> str:
    """A text table of the trace's metrics."""
    m = metrics(trace)
    meta = trace.meta
    profile = f", profile {meta['profile']}" if meta.get("profile") else ""
    lines = [
        f"trace of {meta.get('graph', '?')!r} ({meta.get('mode', '?')}, {meta.get('clock', '?')} clock{profile})",
        f"  tasks               {m.tasks}",
        f"  makespan            {_fmt_time(m.makespan)}",
        f"  critical path       {_fmt_time(m.critical_path)}",
        f"  {'engine':<10}{'busy':>14}{'utilisation':>14}",
    ]
    lines += [f"  {k:<10}{_fmt_time(m.busy[k]):>14}{m.utilisation[k] * 100:>13.1f}%" for k in sorted(m.busy)]
    lines.append(f"  comm time           {_fmt_time(m.comm_time)} ({m.comm_hidden * 100:.1f}% hidden under compute)")
    lines.append(f"  cube/vector overlap {_fmt_time(m.cube_vector_overlap)}")
    return "\n".join(lines)
