"""The microkernel: dependency counters, per-engine ready queues, completion propagation.

It knows nothing of ops, tensors or time. Executors differ only in what "run a task"
and "now" mean: the reference executor loops over :meth:`Core.pop`/:meth:`Core.done`,
the thread executor makes the same calls from its workers, the simulator adds a clock.

A task's state lives in one counter, as in graphlib: ``unmet[t] > 0`` waits for that many
predecessors, ``0`` is ready (queued), ``RUNNING`` was handed out, ``DONE`` finished.
"""
from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from megaloom.runtime.errors import DeadlockError, ScheduleError

if TYPE_CHECKING:
    from megaloom.runtime.graph import TaskGraph

RUNNING = -1
DONE = -2
_WAITS_FOR_NONE = {RUNNING: "(running)", 0: "(ready, no unit took it)"}  # what Core.blocked says of a task
MAX_UNITS = 1 << 16  # units of one engine kind: far above any chip, low enough that per-unit state stays small


class Policy:
    """Orders ready tasks. Subclasses override :meth:`prepare`, :meth:`push`, :meth:`pop`.

    ``prepare`` sees the graph and the unit count of each engine kind before a run;
    ``push`` receives a task that became ready; ``pop`` returns the next task for a free
    unit of an engine kind, or -1 when it has none for that unit.
    """

    name = "fifo"

    def prepare(self, graph: TaskGraph, units: dict[str, int]) -> None:
        self._engine = task_engines(graph)
        self._queues: dict[str, deque[int]] = {e: deque() for e in units}

    def push(self, tid: int) -> None:
        self._queues[self._engine[tid]].append(tid)

    def pop(self, engine: str, unit: int) -> int:
        q = self._queues[engine]
        return q.popleft() if q else -1

    def has_ready(self, engine: str) -> bool:
        return bool(self._queues[engine])

    def fifo_queues(self) -> dict[str, deque[int]] | None:
        """The per-engine deques when this policy is the plain FIFO (its methods not overridden),
        which :class:`Core` then works on directly; else None."""
        plain = all(getattr(type(self), m) is getattr(Policy, m) for m in ("prepare", "push", "pop", "has_ready"))
        return self._queues if plain and not getattr(self, "per_unit", False) else None


def task_engines(graph: TaskGraph) -> list[str]:
    """The engine kind of each task, by id (kept per graph version)."""
    def make() -> list[str]:
        a = graph.arrays()
        return list(map(a.engine_names.__getitem__, a.engine.tolist()))
    return graph.cached("task_engines", make)


class FIFO(Policy):
    """Ready tasks run in the order they became ready (ties: task id)."""


class Core:
    """Counts unmet dependencies and hands out ready tasks through a policy."""

    __slots__ = ("graph", "policy", "unmet", "remaining", "succ", "fifo", "push_of")

    def __init__(self, graph: TaskGraph, units: dict[str, int], policy: Policy | None = None):
        engines, unmet, roots = graph.cached("core_start", lambda: (
            graph.engines(), [len(p) for p in graph.pred], [t for t, p in enumerate(graph.pred) if not p]))
        if missing := [e for e in engines if units.get(e, 0) <= 0]:
            raise ScheduleError(f"graph {graph.name!r} uses engine kinds {missing} with no units; given {units}")
        if many := [e for e, n in units.items() if n > MAX_UNITS]:
            raise ScheduleError(f"engine kinds {many} have more than {MAX_UNITS} units; given {units}")
        self.graph = graph
        self.policy = policy if policy is not None else FIFO()
        self.policy.prepare(graph, units)
        self.succ = graph.succ
        self.unmet = unmet.copy()  # the cached start state: predecessors per task, tasks without any
        self.remaining = len(unmet)
        # plain FIFO: the engine deques, worked on directly (a task's push is its deque's append)
        self.fifo = self.policy.fifo_queues()
        push = self.policy.push
        self.push_of = [push] * len(unmet) if self.fifo is None else \
            list(map({e: q.append for e, q in self.fifo.items()}.__getitem__, self.policy._engine))
        for tid in roots:
            push(tid)

    def pop(self, engine: str, unit: int = 0) -> int:
        """Hand out the next ready task for ``unit`` of ``engine``, or -1 if none."""
        q = self.fifo
        if q is not None:
            q = q[engine]
            if not q:
                return -1
            tid = q.popleft()
        else:
            tid = self.policy.pop(engine, unit)
            if tid < 0:
                return tid
        self.unmet[tid] = RUNNING
        return tid

    def done(self, tid: int) -> None:
        """Mark a handed-out task finished and queue successors that became ready.
        (The thread executor's workers do the same inline: ``push_of[s](s)`` queues ``s``.)"""
        unmet = self.unmet
        if unmet[tid] != RUNNING:
            state = "already done" if unmet[tid] == DONE else "not handed out"
            raise ScheduleError(f"done() for task {self.graph.task_name(tid)!r}, which is {state}")
        unmet[tid] = DONE
        self.remaining -= 1
        push = self.push_of
        for s in self.succ[tid]:
            n = unmet[s] - 1
            unmet[s] = n
            if n == 0:
                push[s](s)

    @property
    def is_active(self) -> bool:
        """True while some task is not done."""
        return self.remaining > 0

    def blocked(self) -> dict[str, list[str]]:
        """Every task not done, with the predecessors it still waits for; a task that
        waits for none is ``["(running)"]`` or ``["(ready, no unit took it)"]``."""
        name, unmet, preds_of, alone = self.graph.task_name, self.unmet, self.graph.preds_of, _WAITS_FOR_NONE
        return {name(t): [alone[n]] if n in alone else [name(p) for p in preds_of(t) if unmet[p] != DONE]
                for t, n in enumerate(unmet) if n != DONE}

    def deadlock(self, why: str, shown: int = 20) -> DeadlockError:
        """The error of a run that stalled: ``why``, then each task not done (the first
        ``shown``) with what it waits for; ``blocked`` on the error holds them all."""
        blocked = self.blocked()
        lines = [f"{t} waits for {', '.join(w) or 'nothing'}" for t, w in list(blocked.items())[:shown]]
        more = f"\n  ... and {len(blocked) - shown} more" if len(blocked) > shown else ""
        return DeadlockError(f"{why}:\n  " + "\n  ".join(lines) + more, blocked)
