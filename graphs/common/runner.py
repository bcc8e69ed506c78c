"""The one graph runner of the torch modules (MegaMoE, MegaGate, MegaMHC): graphs built once
per spec and arguments (a bounded LRU cache), run on one executor convention.

``executor`` is a name of :data:`~megaloom.runtime.executors.EXECUTORS`, ``"thread"`` (a
:class:`ThreadExecutor` with ``units`` per engine kind, one per engine the graph uses by
default, ordered by ``policy``; compute tasks on one worker thread, comm tasks beside it) or
``"reference"``, made for each run on the inputs' device with this rank's context and communicator; or an
:class:`Executor` object, used as given: it must run on the inputs' device and, across
ranks, hold the communicator in its context.
"""
from __future__ import annotations

import itertools
import weakref
from collections import OrderedDict
from typing import Any, Mapping

import torch

from megaloom.runtime.errors import ConfigError, ExecutionError
from megaloom.runtime.executors import EXECUTORS, ExecContext, Executor, ReferenceExecutor, ThreadExecutor
from megaloom.runtime.executors.base import RunResult
from megaloom.runtime.graph import TaskGraph
from megaloom.runtime.registry import COMM
from megaloom.runtime.trace import Trace

_RUNNERS: weakref.WeakValueDictionary[int, GraphRunner] = weakref.WeakValueDictionary()
_KEYS = itertools.count()
# the dispatcher's default thread state: inside a torch.library custom op autograd is skipped,
# but some reference ops differentiate (vjp), so a run restores this state (autocast off)
_DEFAULT_DISPATCH = (torch._C._dispatch_tls_local_include_set(), torch._C._dispatch_tls_local_exclude_set())


class GraphRunner:
    """Builds graphs with a family's :class:`~megaloom.graphs.common.builder.GraphBuilder`, caches
    them, and runs them; ``last_trace[direction]`` keeps the trace of the latest run of each direction,
    and while :meth:`record` is on, ``recorded`` the ``(direction, trace)`` of every run. ``key`` names
    the runner to the families' ``torch.library`` custom ops, which take no Python objects
    (:func:`runner_for` finds it again)."""

    def __init__(self, executor: str | Executor = "thread", *, units: Mapping[str, int] | None = None,
                 policy: Any = None, comm: Any = None, cache_size: int = 16):
        if not isinstance(executor, Executor):
            EXECUTORS.get(executor)  # an unknown name raises ConfigError listing the known ones
        self.comm, self.rank, self.world_size = comm, getattr(comm, "rank", 0), getattr(comm, "world_size", 1)
        ctx = getattr(executor, "ctx", None)
        if isinstance(executor, Executor) and self.world_size > 1 and getattr(ctx, "comm", None) is not comm:
            raise ConfigError(f"executor {executor.name!r} across {self.world_size} ranks: its ExecContext must "
                              "hold the communicator")
        self.executor, self.units, self.policy = executor, dict(units) if units else None, policy
        self.cache_size = cache_size
        self._graphs: OrderedDict[tuple, TaskGraph] = OrderedDict()
        self.last_trace: dict[str, Trace] = {}
        self.recorded: list[tuple[str, Trace]] | None = None
        self.builds = 0  # graphs built (and validated) so far
        self.key = next(_KEYS)
        _RUNNERS[self.key] = self

    def graph(self, family: Any, spec: Any, direction: str = "fwd", *args: Any, **kw: Any) -> TaskGraph:
        """``family.build(spec, direction, *args, **kw)``, validated; built once per (hashable) arguments."""
        key = (family.name, direction, spec, args, tuple(sorted(kw.items())))
        g = self._graphs.pop(key, None)
        if g is None:
            g = family.build(spec, direction, *args, **kw).validate()
            self.builds += 1
        self._graphs[key] = g  # the latest used last
        while len(self._graphs) > self.cache_size:
            self._graphs.popitem(last=False)
        return g

    def run(self, graph: TaskGraph, inputs: Mapping[str, torch.Tensor], direction: str = "fwd", *,
            contiguous: bool = True) -> RunResult:
        """Run ``graph`` on ``inputs``, detached and made contiguous (``contiguous=False`` passes them
        as they are, e.g. transposed weight views, with no copy)."""
        inputs = {k: (v.detach().contiguous() if contiguous else v.detach()) for k, v in inputs.items()}
        device = next(iter(inputs.values())).device
        with torch._C._ForceDispatchKeyGuard(*_DEFAULT_DISPATCH), torch.autocast(device.type, enabled=False):
            res = self.executor_for(graph, device).run(graph, inputs)
        self.last_trace[direction] = res.trace
        if self.recorded is not None:
            self.recorded.append((direction, res.trace))
        return res

    def record(self, on: bool = True) -> list[tuple[str, Trace]]:
        """Start keeping the trace of every run (``on=False``: stop); returns the ``(direction, trace)``
        kept since the last start (a traced training step with gradient accumulation keeps them all)."""
        kept, self.recorded = self.recorded or [], [] if on else None
        return kept

    def executor_for(self, graph: TaskGraph, device: torch.device) -> Executor:
        """The executor of a run on ``device``."""
        if isinstance(self.executor, Executor):
            ex, ctx = self.executor, getattr(self.executor, "ctx", None)
            if ctx is not None and torch.device(ctx.device).type != device.type:
                raise ExecutionError(f"graph {graph.name!r}: inputs are on {device}, but executor {ex.name!r} runs "
                                     f"on {ctx.device}; give it ExecContext(device=...) of the inputs' device")
            return ex
        ctx = ExecContext(rank=self.rank, world_size=self.world_size, comm=self.comm, device=device)
        cls = EXECUTORS.get(self.executor)
        if cls is ReferenceExecutor:
            return cls(ctx)
        from megaloom.scheduler import make_policy

        if not issubclass(cls, ThreadExecutor):
            return cls(self.units, policy=make_policy(self.policy), ctx=ctx)
        # compute tasks on one thread (a second Python thread would only trade the GIL back and forth),
        # blocking comm tasks on threads of their own
        units = self.units or dict.fromkeys(graph.cached("engines", graph.engines), 1)
        return cls(self.units, policy=make_policy(self.policy), ctx=ctx, workers=1 + units.get(COMM, 0))


def runner_for(key: int) -> GraphRunner:
    """The live runner of ``key``."""
    runner = _RUNNERS.get(key)
    if runner is None:
        raise ExecutionError(f"graph runner {key} is gone (its module was deleted)")
    return runner
