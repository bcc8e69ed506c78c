"""The compiled event loop (``megaloom.scheduler._fastsim``) for key-ordered policies.

A policy qualifies when its ready order is a static key per task: FIFO (the order tasks
became ready), or a :class:`~megaloom.scheduler.policies._Keyed` policy (``priority``,
``critical_path``, ``rotated``, or a subclass that only overrides ``keys``) whose keys are
ints or floats. The compiled loop reproduces the Python loop of
:class:`~megaloom.scheduler.simulator.Simulator` exactly (same start, end and unit per
task, same dispatch order); the Python loop over the shared Core stays the specification.

:func:`upward_rank` is the compiled twin of the critical-path rank (same float operations).

The extension is optional: without a C compiler at install time :data:`AVAILABLE` is False
and the simulator runs its Python loop.
"""
from __future__ import annotations

from operator import attrgetter

import numpy as np
from typing import Callable, Sequence

from megaloom.runtime.core import Policy
from megaloom.runtime.graph import TaskGraph

try:
    from megaloom.scheduler import _fastsim
except ImportError:  # built without a compiler: the Python loop is used
    _fastsim = None

AVAILABLE = _fastsim is not None
"""True when the compiled event loop was built."""

_METHODS = ("prepare", "push", "pop", "has_ready")


def ready_order(policy: Policy) -> str | None:
    """``"fifo"`` or ``"keyed"`` when the compiled loop can replay ``policy``, else None."""
    from megaloom.scheduler.policies import _Keyed  # (policies imports this module)

    if getattr(policy, "per_unit", False):
        return None
    cls = type(policy)
    for kind, base in (("fifo", Policy), ("keyed", _Keyed)):
        if all(getattr(cls, m) is getattr(base, m) for m in _METHODS):
            return kind
    return None


def run(graph: TaskGraph, units: dict[str, int], policy: Policy, dur: list[float],
        progress: Callable[[int, int], None] | None, every: int,
        arrays: bool = False) -> tuple[Sequence, Sequence, Sequence] | None:
    """``(start, unit, order)`` of the compiled loop (lists; NumPy arrays with ``arrays``), or
    None when it does not apply (no extension, a policy it cannot replay, an engine without
    units, NaN durations or keys, keys that are not exact doubles, or a stall, which the
    Python loop then reports)."""
    kind = ready_order(policy)
    if _fastsim is None or kind is None:
        return None
    keys = policy.keys(graph) if kind == "keyed" else None
    engines = list(map(attrgetter("engine"), graph.tasks))
    index = {e: i for i, e in enumerate(units)}
    out = _fastsim.run(graph.pred, graph.succ, engines, index, dur, keys, list(units.values()), progress, every,
                       arrays)
    if out is None or out[3] != len(dur):
        return None
    if arrays:
        return tuple(np.frombuffer(b, dtype=t) for b, t in zip(out[:3], (np.float64, np.int32, np.int32)))
    return out[0], out[1], out[2]


def upward_rank(succ: list[list[int]], order: list[int], durations: Sequence[float]) -> list[float]:
    """The compiled :func:`megaloom.scheduler.policies.upward_rank` (needs :data:`AVAILABLE`)."""
    return _fastsim.upward_rank(succ, order, durations)
