"""What all executors share: run context, buffer allocation, results (observers: :mod:`megaloom.runtime.record`)."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from megaloom.runtime.dtypes import torch_dtype
from megaloom.runtime.errors import ExecutionError
from megaloom.runtime.graph import Task, TaskGraph
from megaloom.runtime.record import Observer  # noqa: F401  (executors take observers; re-exported here)
from megaloom.runtime.region import overlaps, to_slices
from megaloom.runtime.trace import Trace


@dataclass(slots=True)
class ExecContext:
    """Passed as ``ctx=`` to ops registered with ``context=True`` (comm ops, mostly)."""

    rank: int = 0
    world_size: int = 1
    comm: Any = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))


@dataclass(slots=True)
class RunResult:
    """Outputs of a run (graph output buffers by name; empty when simulated) and its trace."""

    outputs: dict[str, torch.Tensor]
    trace: Trace
    buffers: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.outputs[name]


def allocate(graph: TaskGraph, inputs: Mapping[str, torch.Tensor] | None, device: torch.device) -> dict[str, torch.Tensor]:
    """One tensor per buffer: inputs checked and (for in-out buffers) copied, the rest empty."""
    inputs = dict(inputs or {})
    unknown = sorted(set(inputs) - {b.name for b in graph.inputs})
    if unknown:
        raise ExecutionError(f"graph {graph.name!r} has no input buffer named {', '.join(map(repr, unknown))}")
    out: dict[str, torch.Tensor] = {}
    for b in graph.buffers.values():
        dt = torch_dtype(b.dtype)
        if b.is_input:
            if b.name not in inputs:
                raise ExecutionError(f"graph {graph.name!r}: input {b.name!r} {b.shape} {b.dtype} was not given")
            x = inputs[b.name]
            if not isinstance(x, torch.Tensor):
                raise ExecutionError(f"input {b.name!r} must be a torch.Tensor, got {type(x).__name__}")
            if tuple(x.shape) != b.shape or x.dtype != dt:
                raise ExecutionError(
                    f"input {b.name!r} is {tuple(x.shape)} {x.dtype}, graph {graph.name!r} expects {b.shape} {dt}"
                )
            x = x.to(device)
            out[b.name] = x.clone() if b.is_output else x
        else:
            out[b.name] = torch.empty(b.shape, dtype=dt, device=device)
    return out


def views(task: Task, bufs: dict[str, torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The tensors a task reads and writes: views of the buffers' storage."""
    ins = [bufs[r.buffer.name][to_slices(r.box)] for r in task.inputs]
    outs = [bufs[r.buffer.name][to_slices(r.box)] for r in task.outputs]
    return ins, outs


def aliased_inputs(task: Task, in_place_ok: bool) -> tuple[int, ...]:
    """Indices of the task's inputs that overlap a region it writes, so that a kernel
    writing its outputs in place would read clobbered data. With ``in_place_ok`` (the op
    reads each element before it writes it, as element-wise ops do) an input exactly
    equal to an output is fine; partial overlaps never are."""
    out = []
    for i, r in enumerate(task.inputs):
        for o in task.outputs:
            if o.buffer is r.buffer and overlaps(o.box, r.box) and not (in_place_ok and o.box == r.box):
                out.append(i)
                break
    return tuple(out)


def check_results(task: Task, results: tuple, outs: list[torch.Tensor]) -> None:
    """Raise when a reference's results do not match the regions the task writes."""
    if len(results) != len(outs):
        raise ExecutionError(f"op {task.op!r} returned {len(results)} outputs, task {task.name!r} declares {len(outs)}",
                             task=task.name)
    for i, (o, r) in enumerate(zip(outs, results)):
        if not isinstance(r, torch.Tensor) or tuple(r.shape) != tuple(o.shape):
            got = tuple(r.shape) if isinstance(r, torch.Tensor) else type(r).__name__
            raise ExecutionError(f"op {task.op!r} returned {got} for output {i} of task {task.name!r}, "
                                 f"which is {tuple(o.shape)}", task=task.name)


def fail(task: Task, exc: BaseException) -> ExecutionError:
    err = ExecutionError(f"task {task.name!r} (op {task.op!r}, engine {task.engine}) failed: {type(exc).__name__}: {exc}", task=task.name)
    err.__cause__ = exc
    return err


class Executor:
    """Base of the real executors: ``run`` blocks, ``run_async`` awaits the same work."""

    name = "executor"

    def run(self, graph: TaskGraph, inputs: Mapping[str, torch.Tensor] | None = None) -> RunResult:
        raise NotImplementedError

    async def run_async(self, graph: TaskGraph, inputs: Mapping[str, torch.Tensor] | None = None) -> RunResult:
        """Run in a worker thread so the event loop stays free."""
        return await asyncio.to_thread(self.run, graph, inputs)
