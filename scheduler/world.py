"""Simulate every rank of an expert-parallel (or any SPMD) step at once: the world graph.

``simulate_world(graphs, profile)`` takes one graph per rank (``graphs[r]`` is rank r's)
and builds one *world graph* that the ordinary :class:`~megaloom.scheduler.simulator.Simulator`
runs (same Core, same policies, the compiled loop when the policy allows):

- every rank's tasks, named ``r{rank}/{name}``, on engine kinds ``{kind}@{rank}`` (each rank
  has its own pools with the profile's unit counts, or ``units``), with the rank's edges;
- durations precomputed per rank with the cost model, times ``slowdown.get(rank, 1.0)``, and
  carried as ``attrs['duration']`` (which the cost model honours);
- one zero-duration **rendezvous** task per collective instance, on engine ``sync`` (one unit
  per rendezvous, so it never queues): it waits for the predecessors of that collective on
  every rank, and the collective of every rank waits for it. So a collective starts on no
  rank before every participant has reached it, and a slow rank delays the others exactly
  there. With ``sync_end`` (default) every participant's copy lasts as long as the slowest
  one (a collective completes together), so it also ends at the same time on every rank.

Matching: collectives (ops in :data:`COLLECTIVE_OPS`) tagged with a process group and a
sequence number (``tags['pg']``, ``tags['seq']``, as imported profiler traces record them)
are matched by that pair, among the ranks that have it (a sub-group). The others are matched
across ranks by the order each rank issues them: a topological order of its graph, ties by
task id, which is the ``chain`` order when the collectives are chained
(:func:`megaloom.comm.ops.chain`, as real ranks must). Every rank must issue the same number
of them with the same ops in that order, else :class:`ScheduleError` names the first
mismatch; they span the whole world. Point-to-point ``send``/``recv`` pairs are
matched by (source, destination, ``tag``) in issue order (``attrs``, else the ``peer`` and
``tag`` tags of imported traces) and rendezvous pairwise; one
without its partner raises ScheduleError. Orders that would deadlock real ranks (a cycle
through rendezvous) raise ScheduleError too.

The result maps back to the ranks: each event has ``rank`` r, its original engine kind,
task name and task id (``deps`` are the rank's own edges). Rendezvous tasks are dropped
from the trace (their instants are the collectives' start times).
"""
from __future__ import annotations

import math
from heapq import heapify, heappop, heappush
from itertools import accumulate
from typing import Any, Callable, Collection, Mapping, NamedTuple, Sequence

from megaloom.runtime.core import Policy
from megaloom.runtime.errors import ConfigError, GraphError, ScheduleError
from megaloom.runtime.executors.base import RunResult
from megaloom.runtime.graph import Task, TaskGraph
from megaloom.runtime.metrics import summary
from megaloom.runtime.record import events_of
from megaloom.runtime.registry import Cost
from megaloom.runtime.trace import Trace
from megaloom.scheduler.cost import DURATION_ATTR, CostModel
from megaloom.scheduler.profile import HardwareProfile
from megaloom.scheduler.simulator import Simulator

COLLECTIVE_OPS = frozenset({"all_to_all", "all_gather", "reduce_scatter", "all_reduce", "barrier", "broadcast",
                            "shard_all_gather", "shard_reduce_scatter"})
"""Ops that every rank joins (matched by issue order)."""
P2P_OPS = frozenset({"send", "recv"})
"""Point-to-point ops (matched by source, destination and tag)."""
SYNC_ENGINE = "sync"
"""Engine kind of the rendezvous tasks."""


class Rendezvous(NamedTuple):
    """One collective (or send/recv pair) instance: its label and the ``(rank, task id)`` that join it."""

    label: str
    members: list[tuple[int, int]]


def heap_order(preds: Sequence[Collection[int]], key: Callable[[int], Any] = int) -> list[int]:
    """Indices in a topological order of ``preds`` (each one's predecessors, no repeats), ready ties
    broken by the smaller ``key(i)``, then ``i`` (Kahn with a heap); shorter than ``preds`` on a cycle."""
    succ: list[list[int]] = [[] for _ in preds]
    for i, ps in enumerate(preds):
        for p in ps:
            succ[p].append(i)
    unmet = list(map(len, preds))
    ready = [(key(i), i) for i, n in enumerate(unmet) if n == 0]
    heapify(ready)
    out: list[int] = []
    while ready:
        out.append(i := heappop(ready)[1])
        for s in succ[i]:
            unmet[s] -= 1
            if unmet[s] == 0:
                heappush(ready, (key(s), s))
    return out


def _group_key(task: Task) -> tuple[str, int] | None:
    pg, seq = task.tags.get("pg"), task.tags.get("seq")
    return (str(pg), seq) if pg is not None and isinstance(seq, int) and not isinstance(seq, bool) else None


def _issues(rank: int, task: Task | None, colls: list[int]) -> str:
    what = f"none (it has {len(colls)} collectives)" if task is None else f"{task.op} {task.name!r}"
    return f"rank {rank} issues {what}"


def match_collectives(graphs: Sequence[TaskGraph]) -> list[Rendezvous]:
    """Every collective instance (by issue order) and send/recv pair (by peer and tag)."""
    world = len(graphs)
    keyed: dict[tuple[str, int], list[tuple[int, int]]] = {}
    colls: list[list[int]] = [[] for _ in graphs]  # each rank's unkeyed collectives in issue order
    sends: dict[tuple[int, int, object], list[tuple[int, int]]] = {}
    recvs: dict[tuple[int, int, object], list[tuple[int, int]]] = {}
    for r, g in enumerate(graphs):
        order = heap_order(g.pred)  # the issue order: ready ties broken by the smaller task id
        if len(order) != len(g.tasks):
            g.topological_order()  # raises GraphError naming the cycle
        for t in order:
            task = g.tasks[t]
            if task.op in P2P_OPS:
                peer = task.attrs.get("peer", task.tags.get("peer"))  # imported traces: a tag
                if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < world or peer == r:
                    raise ScheduleError(f"rank {r}: {task.op} {task.name!r} has peer {peer!r}, "
                                        f"not another rank of a world of {world}")
                tag = task.attrs.get("tag", task.tags.get("tag", 0))
                key = (r, peer, tag) if task.op == "send" else (peer, r, tag)
                (sends if task.op == "send" else recvs).setdefault(key, []).append((r, t))
            elif task.op in COLLECTIVE_OPS and _group_key(task) is None:
                colls[r].append(t)
            elif task.op in COLLECTIVE_OPS:
                keyed.setdefault(_group_key(task), []).append((r, t))
    out: list[Rendezvous] = [Rendezvous(f"{graphs[m[0][0]].tasks[m[0][1]].op} {k[0]}#{k[1]}", m)
                             for k, m in sorted(keyed.items()) if len(m) > 1]
    for k in range(max(map(len, colls), default=0)):
        ref = graphs[0].tasks[colls[0][k]] if k < len(colls[0]) else None
        for r in range(world):
            mine = graphs[r].tasks[colls[r][k]] if k < len(colls[r]) else None
            if ref is None or mine is None or mine.op != ref.op:
                raise ScheduleError(f"collective #{k} does not match across ranks: "
                                    f"{_issues(0, ref, colls[0])}, {_issues(r, mine, colls[r])}")
        out.append(Rendezvous(f"{ref.op}#{k}", [(r, colls[r][k]) for r in range(world)]))
    for key in sorted(set(sends) | set(recvs), key=repr):
        s, v = sends.get(key, []), recvs.get(key, [])
        if len(s) != len(v):
            r, t = (s if len(s) > len(v) else v)[min(len(s), len(v))]
            raise ScheduleError(f"rank {key[0]} sends {len(s)} message(s) with tag {key[2]!r} to rank {key[1]}, which "
                                f"receives {len(v)}: {graphs[r].tasks[t].name!r} on rank {r} has no partner")
        out += [Rendezvous(f"p2p {key[0]}->{key[1]} tag {key[2]!r} #{i}", [a, b]) for i, (a, b) in enumerate(zip(s, v))]
    return out


def world_graph(graphs: Sequence[TaskGraph], units: Mapping[str, int], cost_model: CostModel, slow: dict[int, float],
                sync_end: bool) -> tuple[TaskGraph, dict[str, int], list[tuple[int, int] | None], int]:
    """The world graph of ``graphs`` (see the module docstring; ``units`` per rank, ``slow``: the
    checked slowdown), its units, the owner of each world task (``(rank, task id)``, None for a
    rendezvous) and the number of rendezvous."""
    rdv = match_collectives(graphs)
    durs = [[d * slow.get(r, 1.0) for d in cost_model.durations(g)] for r, g in enumerate(graphs)]
    if sync_end:
        for rv in rdv:
            longest = max(durs[r][t] for r, t in rv.members)
            for r, t in rv.members:
                durs[r][t] = longest
    w = TaskGraph(f"world[{len(graphs)}]")
    world_units = {f"{kind}@{r}": units[kind] for r, g in enumerate(graphs) for kind in g.engines() if kind in units}
    owner = [(r, t) for r, g in enumerate(graphs) for t in range(len(g))] + [None] * len(rdv)
    offset = [0, *accumulate(map(len, graphs))]  # the world id of each rank's task 0
    for r, g in enumerate(graphs):
        costs = g.costs()
        for t, d in zip(g.tasks, durs[r]):
            w.task(t.op, name=f"r{r}/{t.name}", engine=f"{t.engine}@{r}", attrs={DURATION_ATTR: d},
                   priority=t.priority, tags=t.tags, cost=costs[t.id])
    pred = [[base + p for p in ps] for base, g in zip(offset, graphs) for ps in g.pred]  # each rank's own edges
    for i, rv in enumerate(rdv):  # a rendezvous waits for what each member waits for; each member waits for it
        w.task("rendezvous", name=f"sync/{i}.{rv.label}", engine=SYNC_ENGINE, attrs={DURATION_ATTR: 0.0},
               cost=Cost(), tags={"collective": i})
        pred.append([offset[r] + p for r, t in rv.members for p in graphs[r].pred[t]])
        for r, t in rv.members:
            pred[offset[r] + t].append(len(pred) - 1)
    w.set_edges(pred)
    if rdv:
        world_units[SYNC_ENGINE] = len(rdv)
    try:
        w.topological_order()
    except GraphError as e:
        raise ScheduleError(f"the ranks' collectives deadlock (a cycle through rendezvous; check that every rank "
                            f"issues its collectives and send/recv in a matching order): {e}") from None
    return w, world_units, owner, len(rdv)


def simulate_world(graphs: Sequence[TaskGraph], profile: HardwareProfile | str, units: Mapping[str, int] | None = None,
                   policy: Policy | str | None = None, cost_model: CostModel | None = None, *,
                   slowdown: Mapping[int, float] | None = None, sync_end: bool = True,
                   validate: bool = True) -> RunResult:
    """Simulate rank r's graph ``graphs[r]`` for every r together, collectives synchronised.

    ``units`` override the profile's unit counts on every rank; ``slowdown[r]`` multiplies
    every duration of rank r; ``sync_end`` makes each collective last as long as its slowest
    participant on every rank. Returns one trace of every rank's events (``rank`` set;
    ``meta['world_size']``, ``meta['slowdown']``, ``meta['collectives']``).
    """
    if not graphs:
        raise ConfigError("simulate_world needs at least one rank's graph")
    base = Simulator(profile, units, policy, cost_model)
    if validate:
        for g in graphs:
            g.validate()
    for r, f in (slowdown or {}).items():
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < len(graphs):
            raise ConfigError(f"slowdown names rank {r!r}, outside a world of {len(graphs)}")
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not math.isfinite(f) or f <= 0:
            raise ConfigError(f"slowdown[{r}] must be a positive finite number, got {f!r}")
    slow = {r: float(f) for r, f in (slowdown or {}).items()}
    graph, world_units, owner, collectives = world_graph(graphs, base.units, base.cost_model, slow, sync_end)
    sim = Simulator(base.profile, world_units, base.policy, base.cost_model)
    sched = sim.schedule(graph)
    records: list[list[tuple[int, int, float, float]]] = [[] for _ in graphs]
    for wid in sched.order:
        if (own := owner[wid]) is not None:
            records[own[0]].append((own[1], sched.unit[wid], sched.start[wid], sched.start[wid] + sched.duration[wid]))
    events = [e for r, g in enumerate(graphs) for e in events_of(g, records[r], r)]
    events.sort(key=lambda e: (e.start, e.rank, e.task_id))
    used = {k: n for k, n in base.units.items() if any(k in g.engines() for g in graphs)}
    meta = {"graph": graphs[0].name if len({g.name for g in graphs}) == 1 else graph.name,
            "graphs": [g.name for g in graphs], "mode": "simulate", "clock": "virtual", "profile": base.profile.name,
            "units": used, "policy": base.policy.name, "world_size": len(graphs), "loop": sim.last_loop,
            "slowdown": {str(r): f for r, f in slow.items()}, "collectives": collectives}
    return RunResult({}, Trace(events, meta))


def rank_ends(trace: Trace) -> dict[int, float]:
    """When each rank's last task ends."""
    out: dict[int, float] = {}
    for e in trace.events:
        out[e.rank] = max(out.get(e.rank, 0.0), e.end)
    return out


def world_summary(trace: Trace) -> str:
    """The summary of each rank's events, then when each rank ends and the world makespan."""
    ends = rank_ends(trace)
    names = trace.meta.get("graphs") or []
    parts = []
    for r in sorted(ends):
        meta = {**trace.meta, "graph": names[r] if r < len(names) else trace.meta.get("graph", "?")}
        parts.append(f"rank {r}: " + summary(Trace([e for e in trace.events if e.rank == r], meta)))
    slow = trace.meta.get("slowdown") or {}
    last = max(ends, key=ends.get) if ends else 0
    parts.append(f"world of {len(ends)} ranks, {trace.meta.get('collectives', 0)} collective instances"
                 + (f", slowdown {slow}" if slow else "") + "\n"
                 + "".join(f"  rank {r} ends at {ends[r] * 1e6:.3f} us\n" for r in sorted(ends))
                 + f"  world makespan      {ends.get(last, 0.0) * 1e6:.3f} us (rank {last} ends last)")
    return "\n".join(parts)
