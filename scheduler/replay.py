"""Replay a saved trace: rebuild its graph with measured durations, re-simulate.

Each event becomes a task with the same id, name, op, engine and tags, an explicit
:class:`Cost` (its flops, bytes, comm bytes) and ``attrs['duration']`` = its measured
duration plus its recorded ``delay`` tag (untraced time before it, which imported traces
carry), which the cost model honours; its recorded dependencies become control edges. The
replayed event starts after its delay. So an imported trace replayed on its own device gives
the recording back: every task starts when its dependencies and its delay allow.

Ranks: a trace of several ranks whose events include collectives replays them together
(:mod:`megaloom.scheduler.world`): collectives are matched across ranks (by process group and
sequence number where the trace has them, else by order; send/recv by peer and tag), each
rank's copy starts when that rank reaches it (its dependencies met) and ends when the slowest
rank has arrived plus the time the copy took in the recording after the last rank was ready
(its transfer, and for a collective run by a backend thread such as gloo's, the hand-over its
recorded delay holds; scaled by a what-if that changes it), so a slow rank shows as exposed comm on the others. Other
multi-rank traces replay rank by rank.

What-ifs: another device (``profile``; each task scaled by the cost model's ratio between
the devices), and :class:`~megaloom.scheduler.whatif.WhatIf` knobs, applied to the events
before they are replayed (on the recorded device's figures).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Mapping

from megaloom.runtime.core import Policy
from megaloom.runtime.errors import ConfigError, TraceFormatError
from megaloom.runtime.executors.base import RunResult
from megaloom.runtime.graph import TaskGraph
from megaloom.runtime.registry import Cost
from megaloom.runtime.trace import Trace, TraceEvent, merge
from megaloom.scheduler.contention import FULL_SPEED_ATTR, work
from megaloom.scheduler.cost import DURATION_ATTR, CostModel
from megaloom.scheduler.profile import Contention, HardwareProfile, load_profile
from megaloom.scheduler.simulator import Simulator, gc_paused
from megaloom.scheduler.whatif import WhatIf, event_width, recost
from megaloom.scheduler.world import COLLECTIVE_OPS, P2P_OPS, match_collectives, simulate_world

__all__ = ["WhatIf", "device_ratio", "event_width", "graph_from_events", "replay"]

JOINED = COLLECTIVE_OPS | P2P_OPS
"""Ops every rank of a group (or both ends of a message) take part in."""
DELAY_TAG = "delay"
"""Event tag: seconds of untraced time between the moment its dependencies were met and its start."""
DELAY_ENGINE = "delay"
"""Engine of the explicit delay tasks put before device collectives in a world replay (never queues)."""
Scale = Callable[[TraceEvent], float]


def delay_of(e: TraceEvent) -> float:
    d = e.tags.get(DELAY_TAG, 0.0)
    return float(d) if isinstance(d, (int, float)) and not isinstance(d, bool) and d > 0 else 0.0


def _measured(events: list[TraceEvent], scale: Scale | None = None) -> dict[int, float]:
    """Each event's measured duration (times ``scale(event)``), by task id."""
    return {e.task_id: max(e.end - e.start, 0.0) * (scale(e) if scale else 1.0) for e in events}


def graph_from_events(events: list[TraceEvent], name: str = "replay", durations: Mapping[int, float] | None = None,
                      unfold: Mapping[int, float] | None = None, full_speed: bool = False) -> TaskGraph:
    """A graph of one rank's events: each task lasts its delay plus its measured duration (or
    ``durations[tid]``: :func:`_measured`); recorded dependencies become edges. An event in
    ``unfold`` (task id -> seconds) waits instead for a separate task of those seconds on the
    ``delay`` engine (added after the events' tasks, which keep their ids when the trace's ids
    are ``0..n-1``). ``full_speed``:
    the durations are work at full speed, which the profile's contention slows."""
    by_tid, unfold = {}, unfold or {}
    for e in events:
        if e.task_id in by_tid:
            raise TraceFormatError(f"trace of {name!r}: task id {e.task_id} ({e.task!r}) appears twice in rank {e.rank}")
        by_tid[e.task_id] = e
    g = TaskGraph(name)
    made = {}
    for tid, e in sorted(by_tid.items()):  # task ids keep their recorded order, so ties break the same way
        prio = e.tags.get("priority", 0)
        d = durations[tid] if durations is not None else max(e.end - e.start, 0.0)
        made[tid] = g.task(e.op, name=e.task, engine=e.engine, tags=e.tags, priority=prio if isinstance(prio, int) else 0,
                           attrs={DURATION_ATTR: d + (0.0 if tid in unfold else delay_of(e)),
                                  **({FULL_SPEED_ATTR: True} if full_speed else {})},
                           cost=Cost(flops=e.flops, bytes=e.bytes, comm_bytes=e.comm_bytes, precision=e.precision))
    delays = {tid: g.task("delay", name=f"delay/{by_tid[tid].task}", engine=DELAY_ENGINE, cost=Cost(),
                          attrs={DURATION_ATTR: unfold[tid]}) for tid in sorted(unfold) if tid in by_tid}
    # dependencies on tasks not traced are dropped; an unfolded event waits for its delay task alone
    pred = [[made[d].id for d in e.deps if d in made and d != tid] for tid, e in sorted(by_tid.items())]
    for tid, delay in delays.items():
        pred.append(pred[made[tid].id])
        pred[made[tid].id] = [delay.id]
    g.set_edges(pred)
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


def imported(trace: Trace) -> bool:
    """Whether ``trace`` was imported from another tool (one unit per recorded thread or stream)."""
    return trace.meta.get("mode") == "import"


def device_ratio(recorded: HardwareProfile, target: HardwareProfile, whole_chip: bool = False) -> Scale:
    """Per event, the cost model's duration on ``target`` over its duration on ``recorded``.

    The event's flops, bytes and comm bytes are costed at its recorded precision over its
    width (:func:`event_width`: ``whole_chip`` for imported traces); engines or links a
    profile has no figures for (``host``, copies without a ``host`` link) keep their duration.
    """
    a, b = CostModel(recorded), CostModel(target)
    return lambda e: recost(a, e, whole_chip, on=b)


def _shared_host(recording: Trace, asked: Trace, prof: HardwareProfile, ranks: int) -> tuple[Contention, HardwareProfile]:
    """Ranks sharing a host's cores (the profile's ``contention.cores``) as recorded, and the
    profile whose contention gives each of ``ranks`` its share: every engine of a host thread
    shares them in ``asked``, the run asked about (the ranks run alike: one rank's replay stands for each)."""
    if (c := prof.contention) is None:
        raise ConfigError(f"host ranks: profile {prof.name!r} has no contention section (the cores ranks share): "
                          "run `megaloom calibrate` or add one")
    if len(recording.ranks or [0]) > 1:
        raise ConfigError("host ranks: the trace holds several ranks; this what-if re-shares one rank's host")
    engines = tuple(sorted({e.engine for e in asked.events if "stream" not in e.tags}))
    recorded = Contention(c.cores, engines, c.overlap)
    return recorded, replace(prof, contention=Contention(c.cores / ranks, engines, c.overlap))


def _full_speed(events: list[TraceEvent], recording: Trace, rank: int, c: Contention, scale: Scale | None) -> dict:
    """Each event's duration at full speed: as recorded under ``c`` (:func:`~megaloom.scheduler.contention.work`),
    tasks a what-if added as they are."""
    rec = [e for e in recording.events if e.rank == rank]
    speed = {e.task_id: w / (e.end - e.start) for e, w in zip(rec, work(rec, c)) if e.end > e.start}
    return {tid: d * speed.get(tid, 1.0) for tid, d in _measured(events, scale).items()}


def _handover(e: TraceEvent) -> float:
    """The recorded delay of a collective run by a backend thread (gloo): the hand-over from the
    thread that issued it, part of the collective; a device collective's delay precedes its rank's arrival."""
    return delay_of(e) if "stream" not in e.tags else 0.0


def _shift(events: list[TraceEvent], by_tid: Mapping[int, TraceEvent]) -> None:
    """Replayed events start after their delay (the simulator ran delay and op as one task)."""
    for e in events:
        if e.task_id in by_tid and (d := delay_of(by_tid[e.task_id])):
            e.start = min(e.start + d, e.end)


@gc_paused()  # tens of thousands of tasks: collections would dominate
def replay(trace: Trace, profile: HardwareProfile | str | None = None, units: Mapping[str, int] | None = None,
           policy: Policy | str | None = None, recorded_profile: HardwareProfile | str | None = None,
           whatif: WhatIf | None = None) -> RunResult:
    """Re-simulate ``trace`` with its measured durations.

    ``recorded_profile`` is the device the trace was recorded on (default: the trace's
    ``profile``, else ``cpu``); ``profile`` is the device to predict (default: the recorded
    one). When they differ, each measured duration is scaled by :func:`device_ratio`.
    Units: ``units``, else those recorded in the trace, else the target profile's; an
    imported trace always keeps one unit per recorded thread or stream (more or fewer cannot
    change what its dependencies serialise). ``policy`` defaults to the recorded policy name,
    else FIFO. ``whatif`` applies :class:`WhatIf` knobs; with ``host_ranks``, each duration of a
    single-rank trace becomes the work it did at full speed (the recording's own sharing of the
    profile's ``contention.cores`` taken out) and runs under its share of the cores beside the
    other ranks of its host: its own threads, the data-parallel all-reduces overlapping them.
    """
    meta = trace.meta
    recorded = load_profile(recorded_profile if recorded_profile is not None else meta.get("profile") or "cpu")
    prof = load_profile(profile) if profile is not None else recorded
    whole = imported(trace)
    scale = device_ratio(recorded, prof, whole) if prof.name != recorded.name or prof.path != recorded.path else None
    asked = whatif.apply(trace, recorded, whole) if whatif is not None and not whatif.empty() else trace
    chosen = {**prof.units, **recorded_units(asked), **({} if whole else units or {})}
    pol = policy if policy is not None else meta.get("policy")
    ranks = asked.ranks or [0]
    per_rank = {r: [e for e in asked.events if e.rank == r] for r in ranks}
    name = str(meta.get("graph", "replay"))
    if len(ranks) > 1 and any(e.op in JOINED for e in asked.events):
        out = _replay_world(per_rank, name, prof, chosen, pol, scale, {(e.rank, e.task_id): e for e in trace.events})
    else:
        results = []
        host = _shared_host(trace, asked, prof, whatif.host_ranks) if whatif and whatif.host_ranks else None
        for rank, events in per_rank.items():
            durations = _full_speed(events, trace, rank, host[0], scale) if host else _measured(events, scale)
            graph = graph_from_events(events, name, durations, full_speed=host is not None)
            res = Simulator(host[1] if host else prof, chosen, pol).run(graph, validate=False)
            _shift(res.trace.events, {e.task_id: e for e in events})
            for ev in res.trace.events:
                ev.rank = rank
            results.append(res.trace)
        out = merge(results) if len(results) > 1 else results[0]
    out.meta["units"] = {k: n for k, n in chosen.items() if any(e.engine == k for e in out.events)}
    out.meta.update({"mode": "replay", "replayed_from": meta.get("mode", "?"), "world_size": len(ranks),
                     **({"source": meta.get("source")} if whole else {})})
    return RunResult({}, out)


def _replay_world(per_rank: dict[int, list[TraceEvent]], name: str, prof: HardwareProfile, units: dict[str, int],
                  policy: Policy | str | None, scale: Scale | None, recorded: dict[tuple, TraceEvent]) -> Trace:
    """Every rank at once, collectives joined (see the module docstring); ``recorded``: the
    events before any what-if, by rank and task id."""
    ranks = sorted(per_rank)
    colls = {r: frozenset(e.task_id for e in per_rank[r] if e.op in JOINED) for r in ranks}
    durs = {r: _measured(per_rank[r], scale) for r in ranks}
    tid_of = {r: sorted(e.task_id for e in per_rank[r]) for r in ranks}  # graph task t: the rank's t-th task id
    # each copy lasts what it recorded after the last rank was ready
    for rv in match_collectives([graph_from_events(per_rank[r], f"{name}[{r}]") for r in ranks]):
        members = [(ranks[i], tid_of[ranks[i]][t]) for i, t in rv.members]
        if all((r, t) in recorded for r, t in members):
            last = max(recorded[r, t].start - _handover(recorded[r, t]) for r, t in members)
            for r, t in members:
                e = recorded[r, t]
                durs[r][t] = max(e.end - last, 0.0) * (durs[r][t] / (e.end - e.start) if e.end > e.start else 1.0)
    unfold = {r: {e.task_id: delay_of(e) - _handover(e) for e in per_rank[r] if e.task_id in colls[r]}
              for r in ranks}  # a hand-over is in the copy's time after the last rank was ready
    graphs = [graph_from_events(per_rank[r], f"{name}[{r}]", durations=durs[r], unfold=unfold[r]) for r in ranks]
    world_units = {**units, DELAY_ENGINE: max(1, max(len(c) for c in colls.values()))}
    res = simulate_world(graphs, prof, world_units, policy, validate=False, sync_end=False)
    out: list[TraceEvent] = []
    for i, r in enumerate(ranks):
        by_tid = {e.task_id: e for e in per_rank[r]}
        mine = {e.task_id: e for e in res.trace.events if e.rank == i}
        kept = [e for e in mine.values() if e.engine != DELAY_ENGINE]
        _shift([e for e in kept if e.task_id not in colls[r]], by_tid)
        for e in kept:
            if e.task_id in colls[r]:  # from this rank's arrival (a backend thread's: after its own hand-over)
                arrive = max((mine[p].end for p in graphs[i].pred[e.task_id]), default=e.start)
                e.start = min(arrive + _handover(by_tid[e.task_id]), e.end)
            e.rank = r
            e.deps = list(by_tid[e.task_id].deps)
        out.extend(kept)
    out.sort(key=lambda e: (e.start, e.rank, e.task_id))
    return Trace(out, dict(res.trace.meta))
