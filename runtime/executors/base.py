"""What all executors share: run context, buffer allocation, results (observers: :mod:`megaloom.runtime.record`)."""
from __future__ import annotations

import asyncio
import math
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from collections import Counter
from functools import partial
from itertools import chain
from typing import Any, Callable, Mapping

import torch

from megaloom.runtime.dtypes import torch_dtype
from megaloom.runtime.errors import ExecutionError
from megaloom.runtime.graph import Buffer, Task, TaskGraph
from megaloom.runtime.record import Observer  # noqa: F401  (executors take observers; re-exported here)
from megaloom.runtime.region import overlaps, to_slices
from megaloom.runtime.registry import OpDef, get_op, run_reference
from megaloom.runtime.task import NO_IO
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


def _check_inputs(graph: TaskGraph, inputs: Mapping[str, torch.Tensor]) -> None:
    """Every input buffer given, as a tensor of its shape and dtype; no unknown names."""
    if unknown := sorted(set(inputs) - {b.name for b in graph.inputs}):
        raise ExecutionError(f"graph {graph.name!r} has no input buffer named {', '.join(map(repr, unknown))}")
    for b in graph.inputs:
        if b.name not in inputs:
            raise ExecutionError(f"graph {graph.name!r}: input {b.name!r} {b.shape} {b.dtype} was not given")
        x = inputs[b.name]
        if not isinstance(x, torch.Tensor):
            raise ExecutionError(f"input {b.name!r} must be a torch.Tensor, got {type(x).__name__}")
        dt = torch_dtype(b.dtype)
        if tuple(x.shape) != b.shape or x.dtype != dt:
            raise ExecutionError(
                f"input {b.name!r} is {tuple(x.shape)} {x.dtype}, graph {graph.name!r} expects {b.shape} {dt}")


def _caller_tensor(b: Buffer, inputs: Mapping[str, torch.Tensor], device: torch.device) -> torch.Tensor:
    """The tensor of a buffer the caller sees: its input (copied when the run updates it) or a new output."""
    if b.is_input:
        x = inputs[b.name]
        if x.device != device:
            x = x.to(device)
        return x.clone() if b.is_output else x
    return torch.empty(b.shape, dtype=torch_dtype(b.dtype), device=device)


def _index(box: tuple, shape: tuple[int, ...]):
    """The index of region ``box`` of a tensor of ``shape``: None for all of it, else its slices up to
    the last dim it cuts (one slice alone when that is the first: the cheapest view to make)."""
    cut = [d for d, (lo, hi) in enumerate(box) if (lo, hi) != (0, shape[d])]
    if not cut:
        return None
    slices = to_slices(box[:cut[-1] + 1])
    return slices[0] if len(slices) == 1 else slices


class Args(list):
    """A task's argument list. A kernel writes into its tensors; rebinding an item (``outs[0] = y``)
    would leave the buffer unwritten (and the plan changed), so it raises TypeError."""

    __slots__ = ()

    def __setitem__(self, i: Any, v: Any) -> None:
        raise TypeError("a kernel must write into its argument tensors (outs[i].copy_(y)), not rebind them")

SMALL_INPUT = 1 << 16
"""Elements of an input buffer that a plan copies, each run, into a tensor of its own whose region
views it made once, when tasks read it more than once (a copy costs less than putting the caller's
views into every task's arguments); larger inputs are viewed in place."""

Call = tuple[Callable[[list, list], None], list[torch.Tensor], list[torch.Tensor]]
"""A task ready to run: ``fn(ins, outs)`` with its argument lists."""
Maker = Callable[[TaskGraph, int, OpDef, Any], Callable[[list, list], None]]
"""Makes a task's ``fn(ins, outs)`` from its graph, its id, its op and the run context: :func:`kernel_call`,
:func:`reference_call`."""


class Plan:
    """A graph's tasks with ready arguments: ``calls[task id] = (fn, ins, outs)``.

    Built once per (graph version, kernel mode, context, device) and kept on the graph
    (:meth:`TaskGraph.cached`). Scratch buffers are the plan's own, reused by every run;
    views of them are made once; so are those of small inputs read more than once, which
    each run copies into the plan's own tensor (:data:`SMALL_INPUT`). Views of the caller's
    other buffers (inputs, outputs) are made per run, once per distinct region, and put into
    the argument lists (:meth:`bind`). A plan serves one run at a time (``lock``); a run
    finding it busy builds its own.
    """

    __slots__ = ("calls", "scratch", "copied", "slots", "ops", "lock")

    def __init__(self, graph: TaskGraph, make: Maker, ctx: Any, device: torch.device):
        self.ops = {graph._op_names[c]: get_op(graph._op_names[c]) for c in set(graph._op)}
        op_of = [self.ops.get(name) for name in graph._op_names]
        io = graph._io  # (tasks without regions have no entry)
        small = [b.name for b in graph.inputs if not b.is_output and math.prod(b.shape) <= SMALL_INPUT]
        reads = Counter(r.buffer.name for r in chain.from_iterable(chain.from_iterable(io.values()))) if small else {}
        self.copied = [name for name in small if reads[name] > 1]
        self.scratch = scratch = {b.name: torch.empty(b.shape, dtype=torch_dtype(b.dtype), device=device) for b in
                                  graph.buffers.values() if not (b.is_input or b.is_output) or b.name in self.copied}
        # caller buffer -> [(region index, the (argument list, position) pairs that take its view)]
        slots: dict[str, dict[tuple, list[tuple[list, int]]]] = {}
        made: dict[tuple[str, tuple], torch.Tensor] = {}
        self.calls: list[Call] = []
        for tid, code in enumerate(graph._op):
            args: tuple[list, list] = (Args(), Args())
            for lst, regs in zip(args, io.get(tid, NO_IO)):
                for i, r in enumerate(regs):
                    name = r.buffer.name
                    if name in scratch:
                        v = made.get((name, r.box))
                        if v is None:
                            idx = _index(r.box, r.buffer.shape)
                            v = made[name, r.box] = scratch[name] if idx is None else scratch[name][idx]
                        lst.append(v)
                    else:
                        lst.append(None)
                        slots.setdefault(name, {}).setdefault(r.box, []).append((lst, i))
            self.calls.append((make(graph, tid, op_of[code], ctx), *args))
        self.slots = [(graph.buffers[name], [(_index(box, graph.buffers[name].shape), places)
                                             for box, places in boxes.items()]) for name, boxes in slots.items()]
        self.lock = threading.Lock()

    def bind(self, graph: TaskGraph, inputs: Mapping[str, torch.Tensor] | None,
             device: torch.device) -> dict[str, torch.Tensor]:
        """Check ``inputs``, put views of the caller's tensors into the argument lists; every buffer's tensor."""
        inputs = dict(inputs or {})
        _check_inputs(graph, inputs)
        bufs = dict(self.scratch)
        for name in self.copied:
            bufs[name] = inputs[name]
            self.scratch[name].copy_(inputs[name])
        for b, views in self.slots:
            bufs[b.name] = x = _caller_tensor(b, inputs, device)
            for idx, places in views:
                v = x if idx is None else x[idx]
                for lst, i in places:
                    list.__setitem__(lst, i, v)
        for b in graph.buffers.values():  # buffers no task touches
            if b.name not in bufs:
                bufs[b.name] = _caller_tensor(b, inputs, device)
        return bufs

    def unbind(self) -> None:
        """Drop the views of the caller's tensors, so the plan keeps none of them alive."""
        for _, views in self.slots:
            for _, places in views:
                for lst, i in places:
                    list.__setitem__(lst, i, None)


MAX_PLANS = 4
"""Plans kept per graph version (kernel modes and contexts)."""


def drop_plans(graph: TaskGraph) -> None:
    """Forget the graph's dispatch plans, freeing the scratch buffers they keep between runs
    (the next run builds a plan again)."""
    graph.cached("dispatch_plans", dict).clear()


@contextmanager
def bound_plan(graph: TaskGraph, make: Maker, ctx: ExecContext, inputs: Mapping[str, torch.Tensor] | None):
    """``(plan, buffers)`` for one run: the graph's cached plan for ``make`` and ``ctx``,
    bound to ``inputs``. A re-registered op, or a plan busy with another run, gets a new one;
    a run that raises discards its plan (an abandoned kernel may still use it)."""
    plans = graph.cached("dispatch_plans", dict)
    # equal contexts share a plan; it holds ctx and so its communicator, whose id stays unique
    key = (make, ctx.rank, ctx.world_size, id(ctx.comm), str(ctx.device))
    plan = plans.get(key)
    if plan is None or any(get_op(name) is not op for name, op in plan.ops.items()):
        while len(plans) >= MAX_PLANS:  # the oldest goes
            del plans[next(iter(plans))]
        plan = plans[key] = Plan(graph, make, ctx, ctx.device)
    if not plan.lock.acquire(blocking=False):
        plan = Plan(graph, make, ctx, ctx.device)
        plan.lock.acquire()
    try:
        bufs = plan.bind(graph, inputs, ctx.device)
    except BaseException:  # bad inputs: the plan stays good
        plan.unbind()
        plan.lock.release()
        raise
    try:
        yield plan, bufs
    except BaseException:  # a kernel of a failed run may still hold the plan's lists: drop the plan
        if plans.get(key) is plan:
            del plans[key]
        raise
    plan.unbind()
    plan.lock.release()


def reference_call(graph: TaskGraph, tid: int, op: OpDef, ctx: Any) -> Callable[[list, list], None]:
    """``fn(ins, outs)`` running the op's torch reference and copying its results into ``outs``
    (results that do not match the regions the task writes raise ExecutionError)."""
    attrs = graph._attrs.get(tid, {})

    def run(ins: list, outs: list) -> None:
        results = run_reference(op, ins, attrs, ctx)
        task = graph.task_name(tid)
        if len(results) != len(outs):
            raise ExecutionError(f"op {op.name!r} returned {len(results)} outputs, task {task!r} declares "
                                 f"{len(outs)}", task=task)
        for i, (o, r) in enumerate(zip(outs, results)):
            if not isinstance(r, torch.Tensor) or tuple(r.shape) != tuple(o.shape):
                got = tuple(r.shape) if isinstance(r, torch.Tensor) else type(r).__name__
                raise ExecutionError(f"op {op.name!r} returned {got} for output {i} of task {task!r}, "
                                     f"which is {tuple(o.shape)}", task=task)
            o.copy_(r)
    return run


def kernel_call(graph: TaskGraph, tid: int, op: OpDef, ctx: Any) -> Callable[[list, list], None]:
    """``fn(ins, outs)`` running the op's kernel (copying inputs it writes over), or its reference."""
    if op.kernel is None:
        return reference_call(graph, tid, op, ctx)
    kw = {**graph._attrs.get(tid, {}), **({"ctx": ctx} if op.context else {})}
    bind = op.extra.get("bind")
    fn = bind(kw) if bind is not None else partial(op.kernel, **kw) if kw else op.kernel
    # inputs overlapping a region the task writes would be clobbered by a kernel writing its outputs in
    # place; an op marked ``in_place`` reads each element before it writes it: an input equal to an output is fine
    ins, outs, in_place = *graph._io.get(tid, NO_IO), op.extra.get("in_place", False)
    copies = {i for i, r in enumerate(ins) for o in outs
              if o.buffer is r.buffer and overlaps(o.box, r.box) and not (in_place and o.box == r.box)}
    if not copies:
        return fn

    def run(ins: list, outs: list) -> None:
        fn([x.clone() if i in copies else x for i, x in enumerate(ins)], outs)
    return run


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
