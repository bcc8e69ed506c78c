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
run as measured and are not counted, unless marked as full-speed work (:data:`FULL_SPEED_ATTR`).

The compiled loop has no such clock: a run whose contention can slow a task (:func:`applies`)
takes the simulator's Python loop, which calls :func:`rescale` at every instant to set the
running tasks' speeds; when nothing is slowed it gives the plain loops' schedule exactly.
:func:`work` is the inverse, for fitting: each recorded event's full-speed work, from the
overlaps in its trace.
"""
from __future__ import annotations

from heapq import heapify
from itertools import product
from typing import Sequence

import numpy as np

from megaloom.runtime.core import task_engines
from megaloom.runtime.graph import TaskGraph
from megaloom.runtime.registry import MOVERS
from megaloom.runtime.trace import TraceEvent
from megaloom.scheduler.cost import DURATION_ATTR
from megaloom.scheduler.profile import Contention


FULL_SPEED_ATTR = "full_speed"
"""Task attribute: its ``attrs['duration']`` is its work at full speed, which contention slows
(replay sets it when ranks share a host's cores other than as recorded)."""


def measured(graph: TaskGraph) -> list[bool]:
    """Per task, whether it carries a measured duration (which contention leaves as it is)."""
    attrs = graph.task_attrs
    return graph.cached("measured", lambda: [DURATION_ATTR in (a := attrs.get(tid, {})) and not a.get(FULL_SPEED_ATTR)
                                             for tid in range(len(graph))])


def applies(c: Contention | None, units: dict[str, int], graph: TaskGraph) -> bool:
    """Whether ``c`` can slow a task of ``graph`` run with ``units``: more units share the cores
    than there are, or comm slows compute; and some task's duration comes from the cost model."""
    binds = c is not None and (sum(units.get(e, 0) for e in c.engines) > c.cores or c.overlap > 0)
    return binds and not all(measured(graph))


def kinds(graph: TaskGraph, c: Contention) -> tuple[list[bool], list[bool], list[bool]]:
    """Per task, whether it shares the cores, is a comm or copy that slows compute, is compute
    that comm slows (tasks with a measured duration: none of them)."""
    both = list(zip(task_engines(graph), measured(graph)))
    return ([e in c.engines and not m for e, m in both], [e in MOVERS and not m for e, m in both],
            [e not in MOVERS and not m for e, m in both])


def rescale(c: Contention, heap: list[tuple[float, int]], order: Sequence[int], kinds: tuple[list[bool], ...],
            speed: list[float], took: list[float], now: float) -> None:
    """Set the speed of each running task (the simulator's completion ``heap`` of ``(end, dispatch
    number)``) under ``c`` at ``now``: a changed speed moves the end of the work left, and marks the
    task's ``took`` -1 (its duration is then its end minus its start)."""
    shares, moves, slowed = kinds
    running = [order[seq] for _, seq in heap]
    shared = sum(shares[t] for t in running)
    share = min(1.0, c.cores / shared) if shared else 1.0
    slow = 1.0 / (1.0 + c.overlap) if any(moves[t] for t in running) else 1.0
    for i, (end, seq) in enumerate(heap):
        tid, was = order[seq], speed[order[seq]]
        v = (share if shares[tid] else 1.0) * (slow if slowed[tid] else 1.0)
        if v != was:
            heap[i], speed[tid], took[tid] = (now + (end - now) * was / v, seq), v, -1.0
    heapify(heap)


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
