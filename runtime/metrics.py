"""Metrics of a trace: makespan, busy time and utilisation per engine, comm hidden under
compute, cube/vector overlap, critical path, and a text summary."""
from __future__ import annotations

from dataclasses import dataclass

from megaloom.runtime.errors import TraceFormatError
from megaloom.runtime.trace import Trace, TraceEvent

COMPUTE = ("cube", "vector")


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint union of intervals."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


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


def critical_path(events: list[TraceEvent]) -> float:
    """Longest chain of task durations along recorded dependencies (per rank)."""
    by_key = {(e.rank, e.task_id): e for e in events}

    def deps(k: tuple[int, int]) -> list[tuple[int, int]]:
        return [(k[0], d) for d in by_key[k].deps if (k[0], d) in by_key]

    finish: dict[tuple[int, int], float] = {}
    for root in by_key:  # iterative depth-first search: dependencies finish first
        if root in finish:
            continue
        stack = [(root, deps(root), 0)]
        open_ = {root}
        while stack:
            k, ds, i = stack[-1]
            while i < len(ds) and ds[i] in finish:
                i += 1
            if i < len(ds):
                d = ds[i]
                if d in open_:
                    raise TraceFormatError(f"trace dependencies form a cycle through task {by_key[d].task!r}")
                stack[-1] = (k, ds, i + 1)
                open_.add(d)
                stack.append((d, deps(d), 0))
                continue
            stack.pop()
            open_.discard(k)
            finish[k] = max((finish[d] for d in ds), default=0.0) + by_key[k].duration
    return max(finish.values(), default=0.0)


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


def metrics(trace: Trace) -> Metrics:
    """Per-rank figures averaged over ranks; utilisation uses ``meta['units']`` when present."""
    ev = trace.events
    span = trace.makespan
    units = trace.meta.get("units", {})
    ranks = max(1, len(trace.ranks))
    busy: dict[str, float] = {}
    for e in ev:
        busy[e.engine] = busy.get(e.engine, 0.0) + e.duration
    util = {}
    for k, b in busy.items():
        n = units.get(k) or len({(e.rank, e.unit) for e in ev if e.engine == k}) / ranks
        util[k] = b / (n * ranks * span) if span > 0 and n else 0.0
    comm_total = hidden = overlap = 0.0
    for r in trace.ranks:
        mine = [e for e in ev if e.rank == r]
        per = {k: union([(e.start, e.end) for e in mine if e.engine == k]) for k in {e.engine for e in mine}}
        compute = union([iv for k in COMPUTE for iv in per.get(k, [])])
        comm = per.get("comm", [])
        comm_total += measure(comm)
        hidden += intersect(comm, compute)
        overlap += intersect(per.get("cube", []), per.get("vector", []))
    return Metrics(
        makespan=span,
        busy=busy,
        utilisation=util,
        comm_time=comm_total / ranks,
        comm_hidden=hidden / comm_total if comm_total > 0 else 0.0,
        cube_vector_overlap=overlap / ranks,
        critical_path=critical_path(ev),
        tasks=len(ev),
    )


def _fmt_time(s: float) -> str:
    for unit, f in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if abs(s) >= f:
            return f"{s / f:.3f} {unit}"
    return f"{s * 1e9:.1f} ns"


def summary(trace: Trace) -> str:
    """A text table of the trace's metrics."""
    m = metrics(trace)
    meta = trace.meta
    head = f"trace of {meta.get('graph', '?')!r} ({meta.get('mode', '?')}, {meta.get('clock', '?')} clock"
    if meta.get("profile"):
        head += f", profile {meta['profile']}"
    lines = [
        head + ")",
        f"  tasks               {m.tasks}",
        f"  makespan            {_fmt_time(m.makespan)}",
        f"  critical path       {_fmt_time(m.critical_path)}",
        f"  {'engine':<10}{'busy':>14}{'utilisation':>14}",
    ]
    for k in sorted(m.busy):
        lines.append(f"  {k:<10}{_fmt_time(m.busy[k]):>14}{m.utilisation[k] * 100:>13.1f}%")
    lines.append(f"  comm time           {_fmt_time(m.comm_time)} ({m.comm_hidden * 100:.1f}% hidden under compute)")
    lines.append(f"  cube/vector overlap {_fmt_time(m.cube_vector_overlap)}")
    return "\n".join(lines)
