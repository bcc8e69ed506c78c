"""Replay a saved megaloom trace: rebuild its graph with measured durations, re-simulate.

Each event becomes a task with the same id, name, op, engine and tags, an explicit
:class:`Cost` (its flops, bytes, comm bytes) and ``attrs['duration']`` = the measured
duration, which the cost model honours; its recorded dependencies become control edges.
Ranks are replayed independently (each rank is one chip with its own units; traces do not
record cross-rank edges) and merged back.
"""
from __future__ import annotations

from typing import Callable, Mapping

from megaloom.runtime.core import Policy
from megaloom.runtime.errors import ConfigError, TraceFormatError
from megaloom.runtime.executors.base import RunResult
from megaloom.runtime.graph import TaskGraph
from megaloom.runtime.metrics import metrics
from megaloom.runtime.registry import Cost
from megaloom.runtime.trace import Trace, TraceEvent, merge
from megaloom.scheduler.cost import DURATION_ATTR, CostModel
from megaloom.scheduler.profile import HardwareProfile, load_profile
from megaloom.scheduler.simulator import Simulator


def graph_from_events(events: list[TraceEvent], name: str = "replay",
                      scale: Callable[[TraceEvent], float] | None = None) -> TaskGraph:
    """A graph of one rank's events: measured durations (times ``scale(event)``), recorded dependencies."""
    by_tid = {}
    for e in events:
        if e.task_id in by_tid:
            raise TraceFormatError(f"trace of {name!r}: task id {e.task_id} ({e.task!r}) appears twice in rank {e.rank}")
        by_tid[e.task_id] = e
    g = TaskGraph(name)
    made = {}
    for tid in sorted(by_tid):  # task ids keep their recorded order, so ties break the same way
        e = by_tid[tid]
        prio = e.tags.get("priority", 0)
        made[tid] = g.task(e.op, name=e.task, engine=e.engine, tags=e.tags, priority=prio if isinstance(prio, int) else 0,
                           attrs={DURATION_ATTR: max(e.end - e.start, 0.0) * (scale(e) if scale else 1.0)},
                           cost=Cost(flops=e.flops, bytes=e.bytes, comm_bytes=e.comm_bytes, precision=e.precision))
    for tid in sorted(by_tid):  # successor lists in task id order, as the builder makes them
        e = by_tid[tid]
        for d in e.deps:
            if d in made and d != tid:  # dependencies on tasks not traced are dropped
                g.edge(made[d], made[tid])
    g.topological_order()  # a cyclic trace raises GraphError naming the cycle
    return g


def recorded_units(trace: Trace) -> dict[str, int]:
    """Unit counts of the recorded run: ``meta['units']``, else the units seen per engine kind."""
    meta_units = trace.meta.get("units") or {}
    units = {str(k): int(v) for k, v in meta_units.items()}
    for e in trace.events:
        if e.engine not in meta_units:
            units[e.engine] = max(units.get(e.engine, 0), e.unit + 1)
    return units


def device_ratio(recorded: HardwareProfile, target: HardwareProfile) -> Callable[[TraceEvent], float]:
    """Per event, the cost model's duration on ``target`` over its duration on ``recorded``.

    The event's flops, bytes and comm bytes are costed at its recorded precision; engines a
    profile has no figures for (``host``) keep their duration.
    """
    a, b = CostModel(recorded), CostModel(target)

    def ratio(e: TraceEvent) -> float:
        cost = Cost(e.flops, e.bytes, e.comm_bytes, e.precision)
        link = str(e.tags.get("link", "intra"))
        try:
            was, now = a.duration(cost, e.engine, link, op=e.op), b.duration(cost, e.engine, link, op=e.op)
        except ConfigError:
            return 1.0
        return now / was if was > 0 else 1.0

    return ratio


def replay(
    trace: Trace,
    profile: HardwareProfile | str | None = None,
    units: Mapping[str, int] | None = None,
    policy: Policy | str | None = None,
    recorded_profile: HardwareProfile | str | None = None,
) -> RunResult:
    """Re-simulate ``trace`` with its measured durations.

    ``recorded_profile`` is the device the trace was recorded on (default: the trace's
    ``profile``, else ``cpu``); ``profile`` is the device to predict (default: the recorded
    one). When they differ, each measured duration is scaled by :func:`device_ratio`.
    Units: ``units``, else those recorded in the trace, else the target profile's.
    ``policy`` defaults to the recorded policy name, else FIFO.
    """
    meta = trace.meta
    recorded = load_profile(recorded_profile if recorded_profile is not None else meta.get("profile") or "cpu")
    prof = load_profile(profile) if profile is not None else recorded
    scale = device_ratio(recorded, prof) if prof.name != recorded.name or prof.path != recorded.path else None
    chosen = {**prof.units, **recorded_units(trace), **(units or {})}
    pol = policy if policy is not None else meta.get("policy")
    results = []
    for rank in trace.ranks or [0]:
        graph = graph_from_events([e for e in trace.events if e.rank == rank], str(meta.get("graph", "replay")), scale)
        res = Simulator(prof, chosen, pol).run(graph, validate=False)
        for ev in res.trace.events:
            ev.rank = rank
        results.append(res.trace)
    out = merge(results) if len(results) > 1 else results[0]
    out.meta.update({"mode": "replay", "replayed_from": meta.get("mode", "?"), "world_size": len(results)})
    return RunResult({}, out)


def compare(recorded: Trace, replayed: Trace) -> str:
    """A side-by-side table: makespan, busy time per engine, exposed (unhidden) comm."""
    a, b = metrics(recorded), metrics(replayed)

    def row(label: str, x: float, y: float) -> str:
        ratio = f"{y / x:8.3f}x" if x > 0 else "       -"
        return f"  {label:<20}{x * 1e6:>14.3f}{y * 1e6:>14.3f} {ratio}"

    lines = [f"  {'(microseconds)':<20}{'recorded':>14}{'replayed':>14}    ratio", row("makespan", a.makespan, b.makespan)]
    for k in sorted(set(a.busy) | set(b.busy)):
        lines.append(row(f"busy {k}", a.busy.get(k, 0.0), b.busy.get(k, 0.0)))
    lines.append(row("exposed comm", a.comm_time * (1 - a.comm_hidden), b.comm_time * (1 - b.comm_hidden)))
    lines.append(row("critical path", a.critical_path, b.critical_path))
    return "\n".join(lines)
