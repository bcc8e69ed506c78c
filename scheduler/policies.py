"""Ordering policies: which ready task a free unit takes next.

All subclass :class:`megaloom.runtime.core.Policy`, so the simulator and the real
executors use them alike. Ties always break by task id, so one graph gives one trace.

| name                | order among ready tasks of an engine kind                               |
|---------------------|--------------------------------------------------------------------------|
| fifo                | the order they became ready                                              |
| priority            | ``task.priority``, higher first                                          |
| critical_path       | upward rank (longest duration path to a sink), longest first             |
| static              | per-unit queues fixed before the run; a unit runs its queue in order     |
| expert_interleave   | round-robin across expert groups (tag ``group``, else ``expert // size``) |
| rotated             | comm tasks by peer, starting at ``(rank + k) mod world`` (tags rank/peer) |
"""
from __future__ import annotations

from collections import deque
from heapq import heappop, heappush
from itertools import cycle
from typing import Any, Callable, Sequence

from megaloom.runtime.core import FIFO, Policy, task_engines
from megaloom.runtime.errors import ConfigError
from megaloom.runtime.graph import TaskGraph
from megaloom.runtime.plugins import Registry
from megaloom.scheduler import fastpath
from megaloom.scheduler.cost import CostModel


class _Keyed(Policy):
    """A heap per engine kind ordered by ``key(tid)`` (smaller first), ties by task id
    (``has_ready`` is the FIFO's: whether the engine's queue, here its heap, holds any)."""

    def keys(self, graph: TaskGraph) -> Sequence[Any]:
        raise NotImplementedError

    def prepare(self, graph: TaskGraph, units: dict[str, int]) -> None:
        self._engine = task_engines(graph)
        self._key = self.keys(graph)
        self._queues = {e: [] for e in units}  # heaps of (key, task id)

    def push(self, tid: int) -> None:
        heappush(self._queues[self._engine[tid]], (self._key[tid], tid))

    def pop(self, engine: str, unit: int) -> int:
        h = self._queues[engine]
        return heappop(h)[1] if h else -1


class PriorityPolicy(_Keyed):
    """Higher ``task.priority`` first; equal priorities by task id."""

    name = "priority"

    def keys(self, graph: TaskGraph) -> list[int]:
        return [-t.priority for t in graph.tasks]


class DurationAware:
    """Mixin for policies that need task durations.

    The simulator hands over its cost-model durations through :meth:`use_durations`
    before a run; otherwise (e.g. under the ThreadExecutor) durations come from
    ``cost_model``, or from the ``cpu`` profile when none is given.
    """

    _given: list[float] | None = None

    def __init__(self, cost_model: Any = None):
        self.cost_model = cost_model

    def use_durations(self, durations: Sequence[float]) -> None:
        self._given = list(durations)

    def durations(self, graph: TaskGraph) -> list[float]:
        given, self._given = self._given, None
        if given is not None and len(given) == len(graph.tasks):
            return given
        self.cost_model = self.cost_model or CostModel("cpu")
        return self.cost_model.durations(graph)


def upward_rank(graph: TaskGraph, durations: Sequence[float], *, compiled: bool = True) -> list[float]:
    """Each task's duration plus the longest duration path from it to a sink (HEFT's rank_u).

    Runs in C when the extension is built (``compiled=False``: this Python loop, the
    specification; both give identical floats)."""
    order = graph.topological_order()
    if compiled and fastpath.AVAILABLE:
        return fastpath.upward_rank(graph.succ, order, durations)
    rank = [0.0] * len(graph.tasks)
    succ, at = graph.succ, rank.__getitem__
    for tid in reversed(order):
        rank[tid] = durations[tid] + max(map(at, succ[tid]), default=0.0)
    return rank


class CriticalPathPolicy(DurationAware, _Keyed):
    """Largest upward rank first: tasks on the longest remaining path go before the rest."""

    name = "critical_path"

    def keys(self, graph: TaskGraph) -> list[float]:
        return [-r for r in upward_rank(graph, self.durations(graph))]


class StaticPolicy(DurationAware, Policy):
    """Per-unit queues fixed before the run, as a MegaKernel's per-core instruction lists.

    Tasks are assigned in topological order: to ``tags['unit'] % units`` when tagged,
    else (``assign="round_robin"``) to the next unit in turn, or (``assign="balanced"``)
    to the unit with the least assigned duration so far. A unit runs its queue strictly
    in order and waits when its head is not ready, even if later tasks are.
    """

    name = "static"
    per_unit = True
    ASSIGN = ("round_robin", "balanced")

    def __init__(self, assign: str = "round_robin", cost_model: Any = None):
        if assign not in self.ASSIGN:
            raise ConfigError(f"static policy: assign must be one of {self.ASSIGN}, got {assign!r}")
        super().__init__(cost_model)
        self.assign = assign

    def prepare(self, graph: TaskGraph, units: dict[str, int]) -> None:
        self._queues: dict[str, list[deque[int]]] = {e: [deque() for _ in range(n)] for e, n in units.items()}
        self._ready = bytearray(len(graph.tasks))
        durs = self.durations(graph) if self.assign == "balanced" else None
        load = {e: [0.0] * n for e, n in units.items()}
        turn = {e: cycle(range(n)) for e, n in units.items()}
        for tid in graph.topological_order():  # the core checked that every engine kind has units
            t = graph.tasks[tid]
            if "unit" in t.tags:
                u = int(t.tags["unit"]) % units[t.engine]
            elif durs is None:
                u = next(turn[t.engine])
            else:
                ld = load[t.engine]
                u = ld.index(min(ld))  # the first least loaded
                ld[u] += durs[tid]
            self._queues[t.engine][u].append(tid)

    def push(self, tid: int) -> None:
        self._ready[tid] = 1

    def pop(self, engine: str, unit: int) -> int:
        q = self._queues[engine][unit]
        return q.popleft() if q and self._ready[q[0]] else -1

    def has_ready(self, engine: str) -> bool:
        return any(q and self._ready[q[0]] for q in self._queues[engine])


class ExpertInterleavePolicy(Policy):
    """Round-robin across expert groups: after serving group g, the next pop serves the
    next group (in ascending order, wrapping) that has a ready task.

    A task's group is ``tags['group']`` when present, else ``tags['expert'] // group_size``;
    untagged tasks form group -1. Within a group, tasks run in the order they became ready.
    """

    name = "expert_interleave"

    def __init__(self, group_size: int = 1):
        if not isinstance(group_size, int) or group_size <= 0:
            raise ConfigError(f"expert_interleave: group_size must be a positive integer, got {group_size!r}")
        self.group_size = group_size

    def prepare(self, graph: TaskGraph, units: dict[str, int]) -> None:
        self._engine = [t.engine for t in graph.tasks]
        self._group = [int(t.tags["group"]) if "group" in t.tags else
                       int(t.tags["expert"]) // self.group_size if "expert" in t.tags else -1 for t in graph.tasks]
        self._queues: dict[str, dict[int, deque[int]]] = {e: {} for e in units}  # group -> its ready tasks
        self._last: dict[str, float] = dict.fromkeys(units, float("-inf"))  # the group served last

    def push(self, tid: int) -> None:
        self._queues[self._engine[tid]].setdefault(self._group[tid], deque()).append(tid)

    def pop(self, engine: str, unit: int) -> int:
        if not (ready := [g for g, q in self._queues[engine].items() if q]):
            return -1
        g = self._last[engine] = min((g for g in ready if g > self._last[engine]), default=min(ready))
        return self._queues[engine][g].popleft()

    def has_ready(self, engine: str) -> bool:
        return any(self._queues[engine].values())


class RotatedPolicy(_Keyed):
    """All-to-all peer order rotated by rank: a comm task tagged ``rank`` r and ``peer`` p
    gets distance ``(p - r - k) mod world``; rank r serves peer ``(r + k) mod world`` first.

    ``world`` defaults to one more than the largest rank or peer tag in the graph.
    Untagged tasks get distance 0; ties by task id.
    """

    name = "rotated"

    def __init__(self, k: int = 1, world: int | None = None):
        if not isinstance(k, int):
            raise ConfigError(f"rotated: k must be an integer, got {k!r}")
        if world is not None and (not isinstance(world, int) or world <= 0):
            raise ConfigError(f"rotated: world must be a positive integer, got {world!r}")
        self.k, self.world = k, world

    def keys(self, graph: TaskGraph) -> list[int]:
        pairs = [(int(t.tags["rank"]), int(t.tags["peer"])) if "rank" in t.tags and "peer" in t.tags else None
                 for t in graph.tasks]
        world = self.world or 1 + max((max(p) for p in pairs if p), default=0)
        return [(p[1] - p[0] - self.k) % world if p else 0 for p in pairs]


POLICIES: Registry[Callable[..., Policy]] = Registry("policy", "megaloom.policies")
"""Policies by name; plug-ins add theirs through the ``megaloom.policies`` entry-point group
(each entry point loads a Policy class, registered under the entry point's name)."""
for _cls in (FIFO, PriorityPolicy, CriticalPathPolicy, StaticPolicy, ExpertInterleavePolicy, RotatedPolicy):
    POLICIES.register(_cls.name, _cls)


def make_policy(name: str | Policy | None, **opts: Any) -> Policy:
    """A policy by name (see :data:`POLICIES`) with its options; a Policy passes through."""
    if name is None:
        return FIFO()
    if isinstance(name, Policy):
        if opts:
            raise ConfigError(f"policy options {sorted(opts)} given with a ready-made policy {name.name!r}")
        return name
    try:
        return POLICIES.get(name)(**opts)  # an unknown name: ConfigError
    except TypeError as e:
        raise ConfigError(f"policy {name!r}: bad options {opts}: {e}") from None
