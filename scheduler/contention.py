"""Contention: units that share cores, and comm that overlaps compute, slow each other.

A profile's optional ``contention`` section states the facts::

    contention:
      cores: 2                        # the engines below share this many cores (a fit may be fractional)
      engines: [cube, vector, comm]
      overlap: 0.0                    # a compute task runs this fraction slower while comm runs

The simulator then shares time as an operating system shares cores (processor sharing):
while ``n`` tasks of the shared engines run, each progresses at ``min(1, cores / n)`` of its
full speed, and a compute task (any engine but ``comm`` and ``copy``) at ``1 / (1 + overlap)``
of that while a comm task runs (Echo fits 37.76% for kernels overlapped with communication on
GPUs). A cost-model duration is a task's work at full speed: the task ends when that work is
done, so every start or end of another task moves its end. Durations measured on a real run
(``attrs['duration']``, as replay builds them) already hold whatever slowed them: those tasks
run as measured and are not counted.

The compiled loop has no such clock: a run whose contention can slow a task (:func:`applies`)
takes :func:`run`, a Python loop over the same Core with the same dispatch order; when nothing
is slowed it gives the plain loops' schedule exactly. :func:`work` is the inverse, for fitting:
each recorded event's full-speed work, from the overlaps in its trace.
"""
from __future__ import annotations

from itertools import product
from typing import TYPE_CHECKING, Sequence

import numpy as np

from megaloom.runtime.core import Core, task_engines
from megaloom.runtime.graph import TaskGraph
from megaloom.runtime.registry import MOVERS
from megaloom.runtime.trace import TraceEvent
from megaloom.scheduler.cost import DURATION_ATTR
from megaloom.scheduler.profile import Contention

if TYPE_CHECKING:
    from megaloom.scheduler.simulator import Simulator


def measured(graph: TaskGraph) -> list[bool]:
    """Per task, whether it carries a measured duration (which contention leaves as it is)."""
    attrs = graph.task_attrs
    return graph.cached("measured", lambda: [DURATION_ATTR in attrs.get(tid, ()) for tid in range(len(graph))])


def applies(c: Contention | None, units: dict[str, int], graph: TaskGraph) -> bool:
    """Whether ``c`` can slow a task of ``graph`` run with ``units``: more units share the cores
    than there are, or comm slows compute; and some task's duration comes from the cost model."""
    binds = c is not None and (sum(units.get(e, 0) for e in c.engines) > c.cores or c.overlap > 0)
    return binds and not all(measured(graph))


def run(sim: Simulator, core: Core, graph: TaskGraph,
        dur: Sequence[float]) -> tuple[list[float], list[int], list[int], list[float]]:
    """``(start, unit, order, durations)`` of ``graph`` under ``sim.cost_model.contention``
    (``durations``: as they came out, ``dur`` where nothing slowed a task). Dispatch as the
    simulator's loop: every free unit, in engine then unit order, before the clock moves;
    completions of one instant in dispatch order. ``sim.progress`` is called once, at the end."""
    c: Contention = sim.cost_model.contention
    engine = task_engines(graph)
    shares = [e in c.engines and not m for e, m in zip(engine, measured(graph))]
    moves = [e in MOVERS and not m for e, m in zip(engine, measured(graph))]
    slowed = [e not in MOVERS and not m for e, m in zip(engine, measured(graph))]
    n = len(dur)
    start, unit_of, order, took = [0.0] * n, [0] * n, [], list(dur)
    end: dict[int, float] = {}    # by dispatch number, of each running task: when it ends at its speed now
    speed: dict[int, float] = {}
    free = {e: list(range(k - 1, -1, -1)) for e, k in sim.units.items()}  # unit 0 on top
    per_unit = getattr(sim.policy, "per_unit", False)
    now, shared, comm = 0.0, 0, 0
    while True:
        for e, f in free.items():
            for u in f[::-1]:
                tid = core.pop(e, u)
                if tid < 0:
                    if per_unit:
                        continue  # each unit has its own queue
                    break
                f.remove(u)
                start[tid], unit_of[tid] = now, u
                end[len(order)], speed[len(order)] = now + dur[tid], 1.0
                order.append(tid)
                shared += shares[tid]
                comm += moves[tid]
        if not end:
            break
        share = min(1.0, c.cores / shared) if shared else 1.0
        slow = 1.0 / (1.0 + c.overlap) if comm else 1.0
        for seq, was in speed.items():  # a changed speed moves the end of the work left
            tid = order[seq]
            v = (share if shares[tid] else 1.0) * (slow if slowed[tid] else 1.0)
            if v != was:
                end[seq], speed[seq], took[tid] = now + (end[seq] - now) * was / v, v, -1.0
        now = min(end.values())
        for seq in sorted(s for s, t in end.items() if t == now):
            tid = order[seq]
            del end[seq], speed[seq]
            if took[tid] < 0:  # slowed at some point
                took[tid] = now - start[tid]
            core.done(tid)
            free[engine[tid]].append(unit_of[tid])
            shared -= shares[tid]
            comm -= moves[tid]
    if sim.progress is not None:
        sim.progress(n - core.remaining, n)
    return start, unit_of, order, took


def work(events: Sequence[TraceEvent], c: Contention) -> np.ndarray:
    """Per event, the seconds it would take at full speed: its recorded duration times its mean
    speed under ``c`` given the events that ran beside it (on its rank)."""
    out = np.zeros(len(events))
    rank = np.array([e.rank for e in events])
    for r in set(rank.tolist()):
        idx = np.flatnonzero(rank == r)
        s, t = np.array([events[i].start for i in idx]), np.array([events[i].end for i in idx])
        shares = np.array([events[i].engine in c.engines for i in idx])
        computes = np.array([events[i].engine not in MOVERS for i in idx])
        times = np.unique(np.concatenate([s, t]))
        i0, i1 = np.searchsorted(times, s), np.searchsorted(times, t)

        def running(mask: np.ndarray) -> np.ndarray:  # events of ``mask`` running in each segment
            d = np.zeros(len(times))
            np.add.at(d, i0[mask], 1)
            np.add.at(d, i1[mask], -1)
            return np.cumsum(d)[:-1]

        share = np.minimum(1.0, c.cores / np.maximum(running(shares), 1))
        slow = np.where(running(~computes) > 0, 1.0 / (1.0 + c.overlap), 1.0)
        for a, b in product((False, True), repeat=2):  # sharing the cores or not, computing or not
            prefix = np.concatenate([[0.0], np.cumsum(share ** a * slow ** b * np.diff(times))])
            mask = (shares == a) & (computes == b)
            out[idx[mask]] = (prefix[i1] - prefix[i0])[mask]
    return out
