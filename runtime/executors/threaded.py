"""Real execution on torch tensors: one worker thread per engine unit.

Workers share one lock around the microkernel core. A worker pops a ready task for its
engine kind, runs the op's kernel outside the lock, then marks it done and wakes idle
workers of engine kinds that got ready work. torch kernels release the GIL, so cube,
vector and comm work of different tasks overlap.
"""
from __future__ import annotations

import threading
import time
from typing import Iterable, Mapping

import torch

from megaloom.runtime.core import Core, Policy
from megaloom.runtime.errors import DeadlockError, ExecutionError, ScheduleError
from megaloom.runtime.executors.base import (
    ExecContext, Executor, Observer, RunResult, allocate, event_of, fail, views,
)
from megaloom.runtime.graph import TaskGraph
from megaloom.runtime.registry import get_op, run_reference
from megaloom.runtime.trace import Trace

KERNEL_MODES = ("kernel", "reference", "null")


class ThreadExecutor(Executor):
    """Run a graph for real with ``units[kind]`` worker threads per engine kind.

    ``kernels``: ``"kernel"`` (each op's kernel), ``"reference"`` (its torch reference)
    or ``"null"`` (run nothing: measures dispatch alone). ``stall_timeout``: seconds
    without any task finishing before the run fails with :class:`DeadlockError`.
    ``intra_op_threads``: torch threads per kernel during the run (``None`` leaves it).
    """

    name = "threaded"

    def __init__(
        self,
        units: Mapping[str, int] | None = None,
        *,
        policy: Policy | None = None,
        ctx: ExecContext | None = None,
        observers: Iterable[Observer] = (),
        kernels: str = "kernel",
        stall_timeout: float = 60.0,
        intra_op_threads: int | None = None,
    ):
        if kernels not in KERNEL_MODES:
            raise ScheduleError(f"kernels must be one of {KERNEL_MODES}, got {kernels!r}")
        if units is not None and any(int(n) <= 0 for n in units.values()):
            raise ScheduleError(f"every engine needs at least one unit, got {dict(units)}")
        self.units = dict(units) if units is not None else None
        self.policy = policy
        self.ctx = ctx or ExecContext()
        self.observers = list(observers)
        self.kernels = kernels
        self.stall_timeout = stall_timeout
        self.intra_op_threads = intra_op_threads

    def run(self, graph: TaskGraph, inputs: Mapping[str, torch.Tensor] | None = None) -> RunResult:
        graph.validate()
        units = self.units if self.units is not None else {e: 1 for e in graph.engines()}
        bufs = allocate(graph, inputs, self.ctx.device) if self.kernels != "null" else {}
        meta = {"graph": graph.name, "mode": "execute", "clock": "wall", "units": dict(units),
                "rank": self.ctx.rank, "world_size": self.ctx.world_size, "kernels": self.kernels}
        for o in self.observers:
            o.on_run_start(graph, meta)
        run = _Run(graph, units, Core(graph, units, self.policy or _default_policy()), bufs, self)
        saved_threads = torch.get_num_threads()
        if self.intra_op_threads:
            torch.set_num_threads(self.intra_op_threads)
        try:
            records = run.execute()
        finally:
            if self.intra_op_threads:
                torch.set_num_threads(saved_threads)
        events = [event_of(graph, graph.tasks[tid], unit, self.ctx.rank, t0, t1) for tid, unit, t0, t1 in records]
        events.sort(key=lambda e: (e.start, e.tid))
        trace = Trace(events, meta)
        for o in self.observers:
            o.on_run_end(trace)
        return RunResult({b.name: bufs[b.name] for b in graph.outputs} if bufs else {}, trace, bufs)


def _default_policy() -> Policy:
    from megaloom.runtime.core import FIFO

    return FIFO()


class _Run:
    """State of one run: the core behind one lock, one condition per engine kind."""

    def __init__(self, graph: TaskGraph, units: Mapping[str, int], core: Core, bufs, ex: ThreadExecutor):
        self.graph, self.units, self.core, self.bufs, self.ex = graph, dict(units), core, bufs, ex
        self.lock = threading.Lock()
        self.conds = {e: threading.Condition(self.lock) for e in units}
        self.idle = {e: 0 for e in units}
        self.error: BaseException | None = None
        self.finished = threading.Event()
        self.last_progress = time.perf_counter()
        self.ops = [get_op(t.op) for t in graph.tasks]
        self.per_unit = getattr(core.policy, "per_unit", False)

    def execute(self) -> list[tuple[int, int, float, float]]:
        if not self.core.is_active:
            return []
        records: list[list[tuple[int, int, float, float]]] = []
        threads = []
        for engine, n in self.units.items():
            for unit in range(n):
                rec: list[tuple[int, int, float, float]] = []
                records.append(rec)
                th = threading.Thread(target=self._worker, args=(engine, unit, rec),
                                      name=f"megaloom-{engine}.{unit}", daemon=True)
                threads.append(th)
        for th in threads:
            th.start()
        poll = min(0.1, self.ex.stall_timeout / 4)
        while not self.finished.wait(poll):
            with self.lock:
                if self.error is not None:
                    break
                if time.perf_counter() - self.last_progress > self.ex.stall_timeout:
                    blocked = self.core.blocked()
                    lines = [f"{t} waits for {', '.join(w) or 'nothing'}" for t, w in list(blocked.items())[:20]]
                    self.error = DeadlockError(
                        f"graph {self.graph.name!r} made no progress for {self.ex.stall_timeout:g} s; "
                        f"{len(blocked)} tasks blocked:\n  " + "\n  ".join(lines), blocked)
                    self._wake_all()
                    break
        for th in threads:
            th.join(timeout=1.0)
        if self.error is not None:
            raise self.error
        return [r for rec in records for r in rec]

    def _wake_all(self) -> None:
        for c in self.conds.values():
            c.notify_all()

    def _worker(self, engine: str, unit: int, rec: list) -> None:
        core, lock, cond, idle = self.core, self.lock, self.conds[engine], self.idle
        perf = time.perf_counter
        observers = self.ex.observers
        lock.acquire()
        try:
            while self.error is None and core.remaining:
                tid = core.pop(engine, unit)
                if tid < 0:
                    idle[engine] += 1
                    cond.wait(0.05)
                    idle[engine] -= 1
                    continue
                lock.release()
                try:
                    t0 = perf()
                    self._run_task(tid)
                    t1 = perf()
                    if observers:
                        ev = event_of(self.graph, self.graph.tasks[tid], unit, self.ex.ctx.rank, t0, t1)
                        for o in observers:
                            o.on_task(ev)
                except BaseException as e:  # reported to the caller by name, never swallowed
                    lock.acquire()
                    if self.error is None:
                        self.error = e if isinstance(e, ExecutionError) else fail(self.graph.tasks[tid], e)
                    self._wake_all()
                    self.finished.set()
                    return
                lock.acquire()
                rec.append((tid, unit, t0, t1))
                core.done(tid)
                self.last_progress = t1
                if not core.remaining:
                    self._wake_all()
                    self.finished.set()
                    return
                for e, c in self.conds.items():
                    n = idle[e]
                    if n and core.policy.has_ready(e):
                        c.notify_all() if self.per_unit else c.notify(n)
        finally:
            lock.release()

    def _run_task(self, tid: int) -> None:
        mode = self.ex.kernels
        if mode == "null":
            return
        task, op = self.graph.tasks[tid], self.ops[tid]
        ins, outs = views(task, self.bufs)
        ctx = {"ctx": self.ex.ctx} if op.context else {}
        if mode == "kernel" and op.kernel is not None:
            op.kernel(ins, outs, **task.attrs, **ctx)
            return
        results = run_reference(op, ins, task.attrs, self.ex.ctx)
        if len(results) != len(outs):
            raise ExecutionError(f"op {op.name!r} returned {len(results)} outputs, task {task.name!r} declares {len(outs)}", task=task.name)
        for o, r in zip(outs, results):
            o.copy_(r)
