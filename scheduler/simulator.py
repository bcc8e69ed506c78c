"""Discrete-event simulation of a task graph on a hardware profile.

The same microkernel :class:`~megaloom.runtime.core.Core` as the executors counts
dependencies and hands out ready tasks through the policy; the simulator only adds a
virtual clock: a heap of ``(finish time, sequence number)`` completions, the sequence
number breaking ties so one graph always gives one trace. All completions at one instant
are retired before free units take new work.

The hot loop works on flat lists (duration and engine per task id, start time and unit per
task id, task ids in dispatch order) and builds the trace events in bulk afterwards; the
garbage collector is paused for the run, since it allocates no cycles.

Fast path: when the policy's ready order is a static key per task (``fifo``, ``priority``,
``critical_path``, ``rotated``, or a ``_Keyed`` subclass that only overrides ``keys``) and
the compiled extension ``megaloom.scheduler._fastsim`` is built, the same loop runs in C
(:mod:`megaloom.scheduler.fastpath`), with identical start, end and unit per task and the
same dispatch order; ``progress`` is called from it at the same points. Observers need no
per-task calls during the loop (they are fed from the trace afterwards), so they do not
matter. Any other policy (``static``, ``expert_interleave``, custom push/pop), inputs the C
loop declines (NaN durations or keys, keys that are not exact doubles) and stalls run the
Python loop through the shared Core, which stays the specification. ``fast=False`` forces
the Python loop; :attr:`Simulator.last_loop` says which loop the last run used.

Contention: when the cost model's ``contention`` can bind (more units of the engines that
share cores than cores, or comm slowing compute), the run takes the Python loop, whose clock
then shares the cores (:func:`megaloom.scheduler.contention.rescale` sets the running tasks'
speeds at every instant; ``last_loop`` is ``"python"``), never the compiled one.
"""
from __future__ import annotations

from dataclasses import astuple, dataclass
from heapq import heappop, heappush
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np

from megaloom.runtime.core import Core, Policy, task_engines
from megaloom.runtime.errors import ConfigError, ScheduleError
from megaloom.runtime.executors.base import RunResult
from megaloom.runtime.graph import Task, TaskGraph
from megaloom.runtime.plugins import parse_options
from megaloom.runtime.record import Observer, Recorder, columns_of, gc_paused
from megaloom.scheduler import contention, fastpath
from megaloom.scheduler.cost import DURATION_ATTR, CostModel
from megaloom.scheduler.policies import DurationAware, make_policy
from megaloom.scheduler.profile import HardwareProfile, checked_units, load_profile

@dataclass(slots=True)
class Schedule:
    """A simulated schedule as flat lists indexed by task id, plus the dispatch order."""

    start: list[float]
    duration: list[float]
    unit: list[int]
    order: list[int]

    @property
    def makespan(self) -> float:
        return max((s + d for s, d in zip(self.start, self.duration)), default=0.0)


def parse_units(text: str) -> dict[str, int]:
    """``"cube=24,vector=48,comm=4"`` as a dict; bad items raise ConfigError."""
    out = checked_units(parse_options(text, what="unit count"))
    if not out:
        raise ConfigError(f"no unit counts in {text!r}: expected e.g. cube=24,vector=48,comm=4")
    return out


class Simulator:
    """Simulate graphs on ``profile`` with ``units`` (overriding the profile's counts).

    ``policy``: a Policy or a policy name; ``cost_model`` defaults to ``CostModel(profile)``;
    ``observers`` are called like the executors call them (events in completion order);
    ``progress(done, total)`` is called every ``progress_every`` dispatched tasks and at the end;
    ``fast``: use the compiled loop when the policy allows it (see the module docstring).
    """

    def __init__(self, profile: HardwareProfile | str, units: Mapping[str, int] | None = None,
                 policy: Policy | str | None = None, cost_model: CostModel | None = None, *,
                 observers: Iterable[Observer] = (), progress: Callable[[int, int], None] | None = None,
                 progress_every: int = 65536, fast: bool = True):
        self.profile = load_profile(profile)
        self.units = {**self.profile.units, **checked_units(units or {})}
        self.policy = make_policy(policy)
        self.cost_model = cost_model if cost_model is not None else CostModel(self.profile)
        self.observers = list(observers)
        self.progress = progress
        self.progress_every = max(1, int(progress_every))
        self.fast = fast
        self.last_loop: str | None = None
        """``"compiled"`` or ``"python"``: the loop the last :meth:`schedule` used."""

    def schedule(self, graph: TaskGraph, durations: Sequence[float] | None = None) -> Schedule:
        """Simulate ``graph``; the schedule as flat lists (no trace events are built)."""
        start, unit, order, dur = self._simulate(graph, durations)
        return Schedule(*(x.tolist() if isinstance(x, np.ndarray) else x for x in (start, dur, unit, order)))

    @gc_paused()
    def _simulate(self, graph: TaskGraph, durations: Sequence[float] | None) -> tuple:
        """``(start, unit, order, durations)``: NumPy arrays from the compiled loop, lists from
        the Python loop (durations an array either way)."""
        dur = np.ascontiguousarray(durations if durations is not None else task_durations(self.cost_model, graph),
                                   dtype=np.float64)
        if len(dur) != len(graph):
            raise ScheduleError(f"graph {graph.name!r} has {len(graph)} tasks but {len(dur)} durations")
        if isinstance(self.policy, DurationAware):
            self.policy.use_durations(dur)
        contended = contention.applies(self.cost_model.contention, self.units, graph)
        if self.fast and not contended:
            out = fastpath.run(graph, self.units, self.policy, dur, self.progress, self.progress_every)
            if out is not None:
                self.last_loop = "compiled"
                return (*out, dur)
        self.last_loop = "python"
        core = Core(graph, self.units, self.policy)
        start, unit, order, took = self._loop(core, graph, dur.tolist(), contended)
        if core.remaining:
            raise core.deadlock(f"simulation of graph {graph.name!r} stalled with {core.remaining} tasks left "
                                "(a cycle, or a policy that never hands them out)")
        return start, unit, order, np.asarray(took, dtype=np.float64)

    def _loop(self, core: Core, graph: TaskGraph, dur: list[float],
              contended: bool) -> tuple[list[float], list[int], list[int], list[float]]:
        """``(start, unit, order, durations)``; ``contended``: the running tasks' speeds follow
        :func:`contention.rescale` (``durations`` as they came out; else ``dur`` itself)."""
        n = len(dur)
        took, speed = (list(dur), [1.0] * n) if contended else (dur, None)
        kinds = contention.kinds(graph, self.cost_model.contention) if contended else None
        engine = task_engines(graph)
        start, unit_of = [0.0] * n, [0] * n  # by task id
        order: list[int] = []
        heap: list[tuple[float, int]] = []
        free = {e: list(range(k - 1, -1, -1)) for e, k in self.units.items()}  # unit 0 on top
        free_of = [free[e] for e in engine]  # the free-unit stack of each task's engine kind
        per_unit = getattr(self.policy, "per_unit", False)
        pop, done, append, has_ready = core.pop, core.done, order.append, self.policy.has_ready
        progress, every = self.progress, self.progress_every
        mark = every if progress is not None else n + 1
        now = 0.0
        while True:
            # hand every free unit a ready task, in engine order then unit order
            for e, f in free.items():
                i = len(f) - 1  # the free units from the top of the stack
                while i >= 0 and (per_unit or has_ready(e)):  # has_ready: cheaper than a pop that comes back empty
                    tid = pop(e, f[i])
                    if tid >= 0:
                        unit_of[tid] = f.pop(i)
                        start[tid] = now
                        heappush(heap, (now + dur[tid], len(order)))
                        append(tid)
                    elif not per_unit:  # one queue for every unit: none gets a task
                        break
                    i -= 1  # each unit has its own queue: ask every free one
            if not heap:
                break
            if len(order) >= mark:
                progress(n - core.remaining, n)
                mark += every
            if contended:  # the tasks running now set each one's speed, and so when it ends
                contention.rescale(self.cost_model.contention, heap, order, kinds, speed, took, now)
            now, seq = heap[0]  # retire every completion at the next instant (the first even if NaN)
            while seq >= 0:
                tid = order[heappop(heap)[1]]
                seq = heap[0][1] if heap and heap[0][0] == now else -1
                done(tid)
                free_of[tid].append(unit_of[tid])
                if contended and took[tid] < 0:  # slowed at some point
                    took[tid] = now - start[tid]
        if progress is not None:
            progress(n - core.remaining, n)
        return start, unit_of, order, took

    @gc_paused()
    def run(self, graph: TaskGraph, *, validate: bool = True, durations: list[float] | None = None) -> RunResult:
        """Simulate ``graph``: empty outputs and a trace on a virtual clock in seconds.

        ``validate=False`` skips :meth:`TaskGraph.validate` (replayed graphs hold tasks
        whose ops may not be registered here); ``durations`` replaces the cost model's.
        """
        if validate:
            graph.validate()
        rec = Recorder(graph, self.observers, mode="simulate", clock="virtual", units=self.units,
                       profile=self.profile.name, policy=self.policy.name)
        start, unit, order, dur = self._simulate(graph, durations)
        order = np.asarray(order, dtype=np.int64)
        start = np.asarray(start, dtype=np.float64)[order]
        cols = columns_of(graph, order, np.asarray(unit, dtype=np.int64)[order], start, start + dur[order], 0)
        return RunResult({}, rec.finish(columns=cols, replay=True))


def task_durations(model: CostModel, graph: TaskGraph) -> np.ndarray:
    """``model.durations(graph)`` as an array, asking the model once per distinct (op, engine,
    link, cost) rather than once per task (the tasks' keys are kept per graph version, as its
    costs are). A model overriding ``durations`` or ``task_duration`` is asked as is."""
    cls = type(model)
    if cls.durations is not CostModel.durations or cls.task_duration is not CostModel.task_duration:
        return np.asarray(model.durations(graph), dtype=np.float64)
    first, inverse, own = graph.cached("duration_keys", lambda: _duration_keys(graph))
    a = graph.arrays()
    table, codes = graph.cost_columns()

    def ask(i: int) -> float:
        return model.task_duration(graph, Task(graph, i, a.op_names[a.op[i]], a.engine_names[a.engine[i]]))

    by_value: dict = {}  # distinct Cost objects of equal work: asked once
    work = [((a.op[i], a.engine[i], *astuple(table[codes[i]])) if i not in own else i, i) for i in first.tolist()]
    values = [by_value[k] if k in by_value else by_value.setdefault(k, ask(i)) for k, i in work]
    dur = np.array(values or [0.0])[inverse]
    for i in own:  # tasks with a link tag or a measured duration
        dur[i] = ask(i)
    return dur


def _duration_keys(graph: TaskGraph) -> tuple[np.ndarray, np.ndarray, set[int]]:
    """A task id of each distinct (op, engine, cost) of the tasks without a link tag or a measured
    duration, the index of each task's key among them, and the ids of the other tasks."""
    a = graph.arrays()
    _, codes = graph.cost_columns()
    own = {i for i, tags in graph.task_tags.items() if "link" in tags} \
        | {i for i, attrs in graph.task_attrs.items() if DURATION_ATTR in attrs}
    key = (a.op.astype(np.int64) * len(a.engine_names) + a.engine) * (int(codes.max(initial=0)) + 1) + codes
    key[list(own)] = -1  # one key for them all: asked one by one
    _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    return first, inverse.reshape(-1), own
