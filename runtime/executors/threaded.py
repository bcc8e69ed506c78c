"""Real execution on torch tensors: engine units as a budget, worker threads from one pool.

Worker threads come from a process-wide pool, started once and reused by every run (as
Taskflow's executor: create once, run many); a run borrows one thread per engine unit, or
as many as it is told (``workers``).
Threads are not tied to units: a worker holds a free unit of whichever engine kind has
ready work, runs that unit's tasks while its queue lasts, and only then looks at the other
kinds, so at most ``units[kind]`` tasks of a kind run at once and a worker sleeps only when
no unit with ready work is free. Workers share one lock around the microkernel core and
run kernels outside it (torch kernels release the GIL, so cube, vector and comm work of
different tasks overlap). A worker that takes a task while work is left for another wakes
one idle worker, so no idle worker is woken for nothing.

Kernels of concurrent workers share the machine: unless told (``intra_op_threads``), each
worker runs torch with the caller's intra-op thread count divided among the run's workers,
so a run never oversubscribes the cores torch was given, and graphs of small tasks run their
kernels single-threaded (an OpenMP fork and join per small kernel costs more than it saves).

A failing task sets the run's error; every worker stops before its next task and the
caller gets :class:`ExecutionError` naming the task (``__cause__``: the original error).
A run in which no task finishes for ``stall_timeout`` seconds raises
:class:`DeadlockError` listing the tasks not done and what each waits for.
"""
from __future__ import annotations

import asyncio
import atexit
import copy
import os
import threading
import time
from array import array
from itertools import chain, count
from dataclasses import KW_ONLY, dataclass
from contextlib import nullcontext
from typing import Callable, Iterable, Mapping

import numpy as np
import torch

from megaloom.runtime.core import DONE, FIFO, RUNNING, Core, Policy
from megaloom.runtime.errors import DeadlockError, ExecutionError, MegaloomError, ScheduleError
from megaloom.runtime.executors.base import (
    Call, ExecContext, Executor, RunResult, bound_plan, fail, kernel_call, reference_call,
)
from megaloom.runtime.graph import TaskGraph
from megaloom.runtime.record import Observer, Recorder, columns_of, gc_paused

KERNEL_MODES = ("kernel", "reference", "null")


@dataclass(eq=False)
class ThreadExecutor(Executor):
    """Run a graph for real with ``units[kind]`` engine units per engine kind (one pool thread each).

    ``kernels``: ``"kernel"`` (each op's kernel), ``"reference"`` (its torch reference)
    or ``"null"`` (run nothing: measures dispatch alone). ``stall_timeout``: seconds
    without any task finishing before the run fails with :class:`DeadlockError`.
    ``workers``: pool threads a run uses (``None``: one per engine unit; fewer run the same
    tasks with less switching between Python threads, units still bounding how many tasks of
    each kind run at once). ``intra_op_threads``: torch threads per kernel during the run
    (``None``: the caller's count divided among the run's workers, at least one each; the
    caller's count is restored after). ``pause_gc``: keep Python's cyclic garbage collector off during the
    run (it is turned back on after), which removes the collector's pauses from dispatch;
    reference counting still frees memory.
    """

    name = "threaded"
    units: Mapping[str, int] | None = None
    _: KW_ONLY
    policy: Policy | None = None
    ctx: ExecContext | None = None
    observers: Iterable[Observer] = ()
    kernels: str = "kernel"
    stall_timeout: float = 60.0
    workers: int | None = None
    intra_op_threads: int | None = None
    pause_gc: bool = True

    def __post_init__(self) -> None:
        if self.kernels not in KERNEL_MODES:
            raise ScheduleError(f"kernels must be one of {KERNEL_MODES}, got {self.kernels!r}")
        if self.units is not None and any(int(n) <= 0 for n in self.units.values()):
            raise ScheduleError(f"every engine needs at least one unit, got {dict(self.units)}")
        if not self.stall_timeout > 0:
            raise ScheduleError(f"stall_timeout must be positive, got {self.stall_timeout!r}")
        for name, n in (("workers", self.workers), ("intra_op_threads", self.intra_op_threads)):
            if n is not None and n <= 0:
                raise ScheduleError(f"{name} must be positive, got {n!r}")
        self.units = {k: int(n) for k, n in self.units.items()} if self.units is not None else None
        self.ctx, self.observers = self.ctx or ExecContext(), list(self.observers)
        self.stall_timeout = float(self.stall_timeout)

    def run(self, graph: TaskGraph, inputs: Mapping[str, torch.Tensor] | None = None) -> RunResult:
        return self._run(graph, inputs, None)

    async def run_async(self, graph: TaskGraph, inputs: Mapping[str, torch.Tensor] | None = None) -> RunResult:
        """Run in a worker thread so the event loop stays free. Cancelling the awaiting
        task stops the run before it re-raises, within :attr:`_Run.ABANDON_AFTER` seconds
        even when a kernel hangs (its worker is abandoned and reported)."""
        cancel = threading.Event()
        job = asyncio.ensure_future(asyncio.to_thread(self._run, graph, inputs, cancel))
        try:
            return await asyncio.shield(job)
        except asyncio.CancelledError:
            cancel.set()
            await asyncio.wait([job])  # within ABANDON_AFTER: a hung kernel is left behind
            if not job.cancelled():
                job.exception()  # the run's "cancelled" error is this cancellation: retrieved here
            raise

    def _run(self, graph: TaskGraph, inputs: Mapping[str, torch.Tensor] | None,
             cancel: threading.Event | None) -> RunResult:
        graph.validate()
        units = self.units if self.units is not None else {e: 1 for e in graph.cached("engines", graph.engines)}
        # each run gets its own policy state, so one executor may run several graphs at once
        policy = copy.copy(self.policy) if self.policy is not None else FIFO()
        core = Core(graph, units, policy)
        make = {"kernel": kernel_call, "reference": reference_call}.get(self.kernels)  # None: run nothing
        bound = bound_plan(graph, make, self.ctx, inputs) if make else nullcontext((None, {}))
        threads = torch.get_num_threads()  # the caller's count again after the run (workers change it)
        if self.intra_op_threads:
            torch.set_num_threads(self.intra_op_threads)
        try:
            with gc_paused(self.pause_gc), bound as (plan, bufs):
                rec = Recorder(graph, self.observers, mode="execute", clock="wall", units=units, rank=self.ctx.rank,
                               world_size=self.ctx.world_size, kernels=self.kernels)
                records = _Run(graph, units, core, plan and plan.calls, self, rec, cancel).execute()
                trace = rec.finish(columns=_by_start(graph, records, self.ctx.rank))
        finally:
            torch.set_num_threads(threads)
        return RunResult({b.name: bufs[b.name] for b in graph.outputs} if bufs else {}, trace, bufs)


def _by_start(graph: TaskGraph, logs: list[_Log], rank: int):
    """Trace columns of a run's logs, ordered by start (ties: task id)."""
    rows = np.frombuffer(array("d", chain.from_iterable(log for _, log in logs)), np.float64).reshape(-1, 3)
    unit = np.repeat([u for u, _ in logs], [len(log) // 3 for _, log in logs]).astype(np.int64)
    order = np.lexsort((rows[:, 0], rows[:, 1]))
    return columns_of(graph, rows[order, 0].astype(np.int64), unit[order], rows[order, 1], rows[order, 2], rank)


_Log = tuple[int, array]
"""One engine unit's log: its number, then the id, start and end of each task it ran, in turn."""


SMALL_KERNEL_FLOPS = 2.0 ** 24
"""Work (flops) per task below which kernels run on one torch thread by default: an OpenMP
fork and join per small kernel costs more than it saves (the more so on a loaded machine)."""


def _small_kernels(graph: TaskGraph) -> bool:
    """Whether the graph's tasks that compute do under :data:`SMALL_KERNEL_FLOPS` each on average."""
    table, codes = graph.cost_columns()
    flops = np.array([c.flops for c in table], dtype=np.float64)[codes]
    return (flops[flops > 0].mean() if flops.any() else 0.0) < SMALL_KERNEL_FLOPS


class _Worker:
    """A pool thread. It sleeps on its own lock (``park``), released to wake it: between runs
    until given a job, and inside a run while no unit with ready work is free."""

    __slots__ = ("park", "waiting", "job", "thread", "unit")

    def __init__(self, number: int) -> None:
        self.park = threading.Lock()
        self.park.acquire()
        self.waiting = False
        self.job: Callable[[_Worker], None] | None = None
        self.unit = ("", -1)  # the engine unit it holds, for reports
        self.thread = threading.Thread(target=self._loop, name=f"megaloom-worker-{number}", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            self.park.acquire()
            job, self.job = self.job, None
            if job is None:  # the pool is closing
                return
            job(self)  # puts this worker back in the pool before the run learns it left


class _Pool:
    """The process's idle workers: runs take them (starting threads only when none is idle)
    and give them back. Closed at interpreter exit; a forked child starts with none."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.idle: list[_Worker] = []
        self.numbers = count(1)  # of the threads started
        self.closed = False

    def start(self, job: Callable[[_Worker], None], n: int) -> list[_Worker]:
        """``n`` workers, each running ``job(worker)``."""
        with self.lock:
            if self.closed:
                raise ExecutionError("the thread executor's worker pool is closed (the interpreter is exiting)")
            workers = [self.idle.pop() if self.idle else _Worker(next(self.numbers)) for _ in range(n)]
        for w in workers:
            w.job = job
            w.park.release()
        return workers

    def put(self, w: _Worker) -> None:
        with self.lock:
            if not self.closed:
                self.idle.append(w)
                return
        w.park.release()  # closing: the worker exits

    def close(self, timeout: float = 1.0) -> None:
        """Stop the idle workers and wait (bounded) for them; workers abandoned in a hung kernel are daemons."""
        with self.lock:
            self.closed, idle, self.idle = True, self.idle, []
        for w in idle:
            w.park.release()
        deadline = time.monotonic() + timeout
        for w in idle:
            w.thread.join(max(0.0, deadline - time.monotonic()))



_POOL = _Pool()
atexit.register(_POOL.close)
os.register_at_fork(after_in_child=_POOL.__init__)  # a forked child has none of the parent's threads


class _Run:
    """State of one run: the core behind one lock, the free units per engine kind, idle workers.

    Every field is read and written with ``lock`` held. A waker removes a parked worker
    from ``parked`` and clears its ``waiting`` flag before releasing its park lock, so a
    worker is woken at most once per idle spell and never counted as idle once woken.
    """

    IDLE_POLL = 0.05  # seconds a parked worker sleeps before it looks again by itself
    ABANDON_AFTER = 0.5  # seconds a cancelled or interrupted run waits for kernels before leaving them

    def __init__(self, graph: TaskGraph, units: Mapping[str, int], core: Core, calls: list[Call] | None,
                 ex: ThreadExecutor, rec: Recorder, cancel: threading.Event | None = None):
        self.graph, self.units, self.core, self.calls, self.ex, self.rec = graph, dict(units), core, calls, ex, rec
        self.cancel = cancel
        self.lock = threading.Lock()
        self.free = {e: list(range(n - 1, -1, -1)) for e, n in self.units.items()}  # unit 0 first
        self.parked: list[_Worker] = []
        self.inside: set[_Worker] = set()  # workers not yet out of the run
        self.all_out = threading.Event()
        self.logs = {e: [array("d") for _ in range(n)] for e, n in self.units.items()}
        self.error: BaseException | None = None
        self.cancelled = False  # cancelled or interrupted by the caller: do not wait for kernels
        self.per_unit = getattr(core.policy, "per_unit", False)
        self.n_workers = min(ex.workers or sum(self.units.values()), sum(self.units.values()))
        self.threads = ex.intra_op_threads or (1 if ex.kernels == "null" or _small_kernels(graph)
                                               else max(1, torch.get_num_threads() // max(1, self.n_workers)))

    def execute(self) -> list[_Log]:
        """Run every task; return the log of each engine unit."""
        core = self.core
        if not core.is_active:
            return []
        stall = self.ex.stall_timeout
        with self.lock:
            self.inside.update(_POOL.start(self._work, self.n_workers))
        try:
            poll = min(0.1, stall / 4)
            seen, last_progress = core.remaining, time.perf_counter()
            while self.error is None and not self.all_out.wait(poll):
                with self.lock:
                    if core.remaining != seen:
                        seen, last_progress = core.remaining, time.perf_counter()
                    if self.cancel is not None and self.cancel.is_set():
                        self.cancelled = True
                        self._stop(ExecutionError(f"run of graph {self.graph.name!r} was cancelled"))
                    elif self.error is None and time.perf_counter() - last_progress > stall:
                        self._stop(core.deadlock(f"graph {self.graph.name!r} made no progress for {stall:g} s; "
                                                 f"{core.remaining} tasks not done"))
        except BaseException as e:  # e.g. KeyboardInterrupt in the caller: stop the workers too
            with self.lock:
                self.cancelled = True
                self._stop(e)
            raise
        finally:
            # a failed run waits (bounded) for tasks still inside a kernel, so none outlives it;
            # a stalled run does not wait again for the task that stalled it, a cancelled one hardly
            wait = self.ABANDON_AFTER if self.cancelled else 1.0 if isinstance(self.error, DeadlockError) \
                else max(1.0, stall)
            self.all_out.wait(wait)
            self._report_abandoned()
        if self.error is not None:
            raise self.error
        return [(unit, log) for logs in self.logs.values() for unit, log in enumerate(logs)]

    def _report_abandoned(self) -> None:
        """Name the workers left inside a kernel (they rejoin the pool when it returns)."""
        with self.lock:
            if not self.inside or self.error is None:
                return
            stuck = sorted(f"{w.thread.name} on {w.unit[0]}.{w.unit[1]}" for w in self.inside)
            running = ", ".join(repr(t) for t, why in self.core.blocked().items() if why == ["(running)"])
        note = f"abandoned {len(stuck)} worker(s) still inside a kernel ({', '.join(stuck)}; " \
               f"task(s) {running or '?'})"
        if type(self.error) is ExecutionError:  # a cancelled or failed run: the note joins the message
            self.error.args = (f"{self.error}; {note}",)
        elif hasattr(self.error, "add_note"):  # the caller's KeyboardInterrupt, say
            self.error.add_note(f"megaloom: {note}")

    def _stop(self, error: BaseException | None = None) -> None:
        """Record the run's first error, if any, and wake every worker so it leaves."""
        if self.error is None:
            self.error = error
        while self.parked:
            self._wake()

    def _wake(self) -> None:
        """Wake one parked worker."""
        w = self.parked.pop()
        w.waiting = False
        w.park.release()

    def _ready(self) -> bool:
        """Whether some engine kind has ready work and a free unit."""
        has_ready = self.core.policy.has_ready
        return any(free and has_ready(e) for e, free in self.free.items())

    def _take(self, me: _Worker) -> tuple[str, int, int]:
        """``(engine, unit, task)``: a ready task and the free unit it runs on; task -1 when none.
        Shared queues are asked once per engine kind, per-unit queues once per free unit."""
        pop, per_unit = self.core.pop, self.per_unit
        for engine, free in self.free.items():
            for i in range(len(free) - 1, -1 if per_unit else max(-1, len(free) - 2), -1):
                tid = pop(engine, free[i])
                if tid >= 0:
                    unit = free.pop(i)
                    me.unit = (engine, unit)
                    return engine, unit, tid
        return "", -1, -1

    def _work(self, me: _Worker) -> None:
        """One worker's part of the run (in a pool thread); it leaves when the run is over.
        A task's completion is :meth:`Core.done` inline, and so is :meth:`Core.pop` of the plain
        FIFO (the dispatch hot path)."""
        if torch.get_num_threads() != self.threads:  # per thread, and others may have set it since
            torch.set_num_threads(self.threads)
        lock, core, parked, free, logs = self.lock, self.core, self.parked, self.free, self.logs
        unmet, succ, push, pop, fifo = core.unmet, core.succ, core.push_of, core.pop, core.fifo
        take, ready, wake = self._take, self._ready, self._wake
        calls = self.calls
        perf = time.perf_counter
        show = self.rec.task if self.rec.observers else None
        lock.acquire()
        try:
            tid = -1
            while self.error is None and core.remaining:
                if tid < 0:
                    engine, unit, tid = take(me)
                    if tid < 0:
                        self._park(me)
                        continue
                    log = logs[engine][unit].extend
                    queue = fifo[engine] if fifo is not None else None
                if parked and ready():  # chain: work is left for another worker
                    wake()
                lock.release()
                try:
                    t0 = perf()
                    if calls is not None:
                        fn, ins, outs = calls[tid]
                        fn(ins, outs)
                    t1 = perf()
                    if show is not None:
                        show(tid, unit, t0, t1, keep=False)
                except BaseException as e:  # reported to the caller by name, never swallowed
                    lock.acquire()
                    self._stop(e if isinstance(e, ExecutionError) else fail(self.graph.tasks[tid], e))
                    return
                lock.acquire()
                log((tid, t0, t1))
                unmet[tid] = DONE
                core.remaining -= 1
                for s in succ[tid]:
                    n = unmet[s] - 1
                    unmet[s] = n
                    if n == 0:
                        push[s](s)
                if queue is None:  # the next task of this unit, if one is ready
                    tid = pop(engine, unit)
                elif queue:
                    tid = queue.popleft()
                    unmet[tid] = RUNNING
                else:
                    tid = -1
                if tid < 0:
                    free[engine].append(unit)
                    if not core.remaining:
                        self._stop()
        except BaseException as e:  # the core or the policy failed (lock held): stop the run now
            err = ScheduleError(f"policy {type(core.policy).__name__} or the core failed in worker "
                                f"{me.thread.name}: {type(e).__name__}: {e}")
            err.__cause__ = e
            self._stop(e if isinstance(e, MegaloomError) else err)
        finally:
            lock.release()
            self._leave(me)

    def _leave(self, me: _Worker) -> None:
        """Back to the pool, then out of the run (so the next run finds this worker idle)."""
        _POOL.put(me)
        with self.lock:
            self.inside.discard(me)
            if not self.inside:
                self.all_out.set()

    def _park(self, me: _Worker) -> None:
        """Sleep until woken or ``IDLE_POLL`` passes (called and returns with the lock held)."""
        me.waiting = True
        self.parked.append(me)
        self.lock.release()
        got = me.park.acquire(True, self.IDLE_POLL)
        self.lock.acquire()
        if me.waiting:  # timed out and nobody woke us: leave the idle list
            me.waiting = False
            self.parked.remove(me)
        elif not got:  # a wake-up raced with the timeout: consume it
            me.park.acquire(False)
