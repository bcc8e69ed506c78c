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

from typing import Callable, Sequence

import numpy as np

from megaloom.runtime.core import Policy
from megaloom.runtime.graph import TaskGraph

try:
    from megaloom.scheduler import _fastsim
except ImportError:  # built without a compiler: the Python loop is used
    _fastsim = None

AVAILABLE = _fastsim is not None
"""True when the compiled event loop was built."""

def ready_order(policy: Policy) -> str | None:
    """``"fifo"`` or ``"keyed"`` when the compiled loop can replay ``policy``, else None."""
    from megaloom.scheduler.policies import _Keyed  # (policies imports this module)

    cls = type(policy)
    plain = (kind for kind, base in (("fifo", Policy), ("keyed", _Keyed))
             if all(getattr(cls, m) is getattr(base, m) for m in ("prepare", "push", "pop", "has_ready")))
    return None if getattr(policy, "per_unit", False) else next(plain, None)


def run(graph: TaskGraph, units: dict[str, int], policy: Policy, dur: np.ndarray,
        progress: Callable[[int, int], None] | None, every: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """``(start, unit, order)`` of the compiled loop as NumPy arrays, read from the graph's
    columns, or None when it does not apply (no extension, a policy it cannot replay, an engine
    without units, NaN durations or keys, keys that are not exact doubles, or a stall, which the
    Python loop then reports)."""
    kind = ready_order(policy)
    if _fastsim is None or kind is None or np.isnan(dur).any():
        return None
    keys = _exact(policy.keys(graph)) if kind == "keyed" else None
    a = graph.arrays()
    engine = np.array([list(units).index(e) if e in units else -1 for e in a.engine_names] or [0], np.int32)[a.engine]
    if (kind == "keyed" and keys is None) or (engine < 0).any():
        return None
    out = _fastsim.run(a.pred_ptr, a.succ_ptr, a.succ_idx, engine, dur, keys, list(units.values()), progress, every)
    if out[3] != len(dur):
        return None
    return tuple(np.frombuffer(b, dtype=t) for b, t in zip(out[:3], (np.float64, np.int32, np.int32)))


def _exact(keys: Sequence) -> np.ndarray | None:
    """``keys`` as float64 when each is an int or float a double holds exactly (not NaN), else None."""
    k = np.asarray(keys)
    exact = k.ndim == 1 and (k.dtype.kind in "iub" and (k.size == 0 or np.abs(k).max() <= 2**53)
                             or k.dtype.kind == "f" and not np.isnan(k).any())
    return k.astype(np.float64) if exact else None


upward_rank = getattr(_fastsim, "upward_rank", None)
"""The compiled :func:`megaloom.scheduler.policies.upward_rank` (``(succ, order, durations)``;
None without the extension)."""
