"""The oracle: tasks run one by one, in topological order, through each op's torch reference."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Mapping

import torch

from megaloom.runtime.core import Core
from megaloom.runtime.errors import ExecutionError
from megaloom.runtime.executors.base import ExecContext, Executor, RunResult, bound_plan, fail, reference_call
from megaloom.runtime.graph import TaskGraph
from megaloom.runtime.record import Observer, Recorder


@dataclass(eq=False)
class ReferenceExecutor(Executor):
    """Sequential execution with the ops' reference functions; one unit per engine kind."""

    name = "reference"
    ctx: ExecContext | None = None
    observers: Iterable[Observer] = ()

    def __post_init__(self) -> None:
        self.ctx, self.observers = self.ctx or ExecContext(), list(self.observers)

    def run(self, graph: TaskGraph, inputs: Mapping[str, torch.Tensor] | None = None) -> RunResult:
        graph.validate()
        units = {e: 1 for e in graph.cached("engines", graph.engines)}
        core = Core(graph, units)
        with bound_plan(graph, reference_call, self.ctx, inputs) as (plan, bufs):
            rec = Recorder(graph, self.observers, mode="reference", clock="wall", units=units, rank=self.ctx.rank,
                           world_size=self.ctx.world_size)
            calls = plan.calls
            while core.is_active:
                tid = next(t for t in (core.pop(e) for e in units) if t >= 0)  # FIFO: a valid DAG always has one
                fn, ins, outs = calls[tid]
                t0 = time.perf_counter()
                try:
                    fn(ins, outs)
                except Exception as e:  # reported by the task's name (an ExecutionError names it already)
                    raise e if isinstance(e, ExecutionError) else fail(graph.tasks[tid], e)
                rec.task(tid, 0, t0, time.perf_counter())
                core.done(tid)
        return RunResult({b.name: bufs[b.name] for b in graph.outputs}, rec.finish(), bufs)
