"""Task durations: a roofline per compute task, alpha-beta per comm task.

    compute: max(flops / unit_peak(engine, precision), bytes / unit_mem_bw(engine)) + task_overhead
    comm:    alpha(link) + max(comm_bytes / (beta(link) / comm units), bytes / unit_mem_bw) + task_overhead

A task runs on one unit unless it spans ``width`` units (an imported kernel runs on as many
SMs as its grid fills, a collective on the whole link): its rates are multiplied by them.
Copies (engine ``copy``) are costed as comm over their link (``host`` for PCIe copies).

An op that knows its arithmetic better than one rate for all its flops says so in its registry
entry, ``extra["compute"](attrs, rate)`` (seconds on one unit, given ``rate(op class,
precision)``, the fit of that class or else the engine's peak): a ``dvm.fused`` task sums its
primitives, each at its own rate, while its memory traffic is its inputs and outputs only
(intermediates stay on chip). A fit of the task's own op class takes precedence.

A task that carries a measured duration (``attrs["duration"]`` in seconds, as trace
replay builds them) takes exactly that. Coefficients per op class (the op name) can be
overridden, which is the hook calibration fits: ``CostModel(p, overrides={"matmul":
(throughput, overhead)})`` replaces the rate (flop/s; B/s for comm) and the fixed
per-task time of that op. A calibrated profile carries such fits in its ``ops`` section;
they apply by default, and ``overrides`` take precedence over them.
"""
from __future__ import annotations

import math

from dataclasses import astuple, dataclass
from typing import Mapping

from megaloom.runtime.errors import ConfigError
from megaloom.runtime.graph import Task, TaskGraph
from megaloom.runtime.registry import MOVERS, OPS, Cost
from megaloom.scheduler.profile import HardwareProfile, load_profile

DURATION_ATTR = "duration"


@dataclass(frozen=True, slots=True)
class OpCoeffs:
    """Per-op-class coefficients; ``None`` keeps the profile's figure.

    ``throughput``: flop/s of one unit (B/s of one channel for comm ops); ``overhead``:
    the fixed seconds of each task (replaces the profile's task overhead; for comm ops,
    alpha plus task overhead); ``mem_bw``: B/s of one unit.
    """

    throughput: float | None = None
    overhead: float | None = None
    mem_bw: float | None = None


_NO_FIT = OpCoeffs()


def _coeffs(op: str, v: OpCoeffs | tuple | Mapping) -> OpCoeffs:
    try:  # a mapping with another key, more than three figures, or not a sequence: TypeError
        c = v if isinstance(v, OpCoeffs) else OpCoeffs(**v) if isinstance(v, Mapping) else OpCoeffs(*v)
    except TypeError:
        raise ConfigError(f"cost override for op {op!r} must be OpCoeffs, (throughput, overhead[, mem_bw]) or a mapping "
                          f"of those keys, got {v!r}") from None
    for name, x in zip(("throughput", "overhead", "mem_bw"), astuple(c)):
        if x is not None and (isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0
                              or (name != "overhead" and x == 0)):
            raise ConfigError(f"cost override for op {op!r}: {name} must be a positive finite number, got {x!r}")
    return c


class CostModel:
    """Durations of tasks on one hardware profile, with optional per-op overrides."""

    def __init__(self, profile: HardwareProfile | str, overrides: Mapping[str, OpCoeffs | tuple | Mapping] | None = None):
        self.profile = load_profile(profile)
        fitted = {op: {k: v for k, v in fit.items() if k in ("throughput", "overhead", "mem_bw")}
                  for op, fit in self.profile.ops.items()}
        self.overrides = {op: _coeffs(op, v) for op, v in {**fitted, **(overrides or {})}.items()}
        self.contention = self.profile.contention
        """How units slow each other in the simulator (:mod:`megaloom.scheduler.contention`); None: not at all."""

    def duration(self, cost: Cost, engine: str, link: str = "intra", *, op: str | None = None, width: float = 1,
                 link_override: tuple[float, float] | None = None, compute: float | None = None) -> float:
        """Seconds one task of ``cost`` takes on ``width`` units of ``engine`` (``op`` selects
        overrides; ``link_override`` replaces the link's ``(alpha, beta)``; ``compute``: the
        arithmetic's seconds when known otherwise, as for a fused node)."""
        p = self.profile
        o = self.overrides.get(op, _NO_FIT)
        if engine in MOVERS:
            alpha, beta = link_override if link_override is not None else p.link(link)
            wire = cost.comm_bytes / (o.throughput or beta / p.units.get(engine, 1) * width) if cost.comm_bytes else 0.0
            memory = cost.bytes / (p.unit_mem_bw(engine) * width) if cost.bytes else 0.0
            return (wire if wire > memory else memory) + (alpha + p.task_overhead if o.overhead is None else o.overhead)
        if compute is None or o.throughput is not None:  # a fit of the op's own class takes precedence (and is > 0)
            compute = cost.flops / (o.throughput or p.unit_peak(engine, cost.precision) * width) if cost.flops else 0.0
        else:
            compute /= width
        memory = cost.bytes / (p.unit_mem_bw(engine) * width if o.mem_bw is None else o.mem_bw)
        return (compute if compute > memory else memory) + (p.task_overhead if o.overhead is None else o.overhead)

    def task_duration(self, graph: TaskGraph, task: Task) -> float:
        """A task's duration: its measured ``attrs['duration']`` if it has one, else the model's."""
        if (d := task.attrs.get(DURATION_ATTR) if task.attrs else None) is not None:
            if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 <= d < math.inf:
                raise ConfigError(f"task {task.name!r}: attrs['duration'] must be a finite non-negative number of "
                                  f"seconds, got {d!r}")
            return float(d)
        cost = graph.task_cost(task)
        d = self.duration(cost, task.engine, task.tags.get("link", "intra"), op=task.op, compute=self.compute(task))
        if not 0 <= d < math.inf:
            raise ConfigError(f"task {task.name!r}: its cost {cost} gives a duration of {d!r} s")
        return d

    def compute(self, task: Task) -> float | None:
        """Seconds of arithmetic of ``task`` on one unit when its op computes them (``extra["compute"]``,
        as a fused DVM node sums its primitives at their own rates), else None."""
        if (fn := OPS.get(task.op).extra.get("compute") if task.op in OPS else None) is None:
            return None

        def rate(op: str, precision: str) -> float:
            fitted = self.overrides.get(op, _NO_FIT).throughput
            return self.profile.unit_peak(task.engine, precision) if fitted is None else fitted
        return fn(task.attrs, rate)

    def durations(self, graph: TaskGraph) -> list[float]:
        """Every task's duration, by task id."""
        return [self.task_duration(graph, t) for t in graph.tasks]
