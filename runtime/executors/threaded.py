"""Real execution on torch tensors: one worker thread per engine unit.

Workers share one lock around the microkernel core. A worker pops a ready task for its
engine kind, runs the op's kernel outside the lock, then marks it done. Wake-ups are
chained: a completion wakes one idle worker of each engine kind that got ready work, and
a worker that pops a task wakes one more of its kind if ready work is left, so no idle
worker is woken for nothing. torch kernels release the GIL, so cube, vector and comm work
of different tasks overlap.

A failing task sets the run's error; every worker stops before its next task and the
caller gets :class:`ExecutionError` naming the task (``__cause__``: the original error).
A run in which no task finishes for ``stall_timeout`` seconds raises
:class:`DeadlockError` listing the tasks not done and what each waits for.
"""
from __future__ import annotations

import asyncio
import copy
import threading
import time
from array import array
from contextlib import contextmanager
from typing import Iterable, Iterator, Mapping

import numpy as np
import torch

from megaloom.runtime.core import FIFO, Core, Policy
from megaloom.runtime.errors import DeadlockError, ExecutionError, MegaloomError, ScheduleError
from megaloom.runtime.executors.base import (
    Call, ExecContext, Executor, RunResult, bound_plan, fail, kernel_call, reference_call,
)
from megaloom.runtime.graph import TaskGraph
from megaloom.runtime.record import Observer, Recorder, columns_of, gc_paused

KERNEL_MODES = ("kernel", "reference", "null")


class ThreadExecutor(Executor):
    """Run a graph for real with ``units[kind]`` worker threads per engine kind.

    ``kernels``: ``"kernel"`` (each op's kernel), ``"reference"`` (its torch reference)
    or ``"null"`` (run nothing: measures dispatch alone). ``stall_timeout``: seconds
    without any task finishing before the run fails with :class:`DeadlockError`.
    ``intra_op_threads``: torch threads per kernel during the run (``None``: the caller's
    setting; every worker thread takes it, since OpenMP counts are per thread).
    ``pause_gc``: keep Python's cyclic garbage collector off during the run (it is turned
    back on after), which removes the collector's pauses from dispatch; reference
    counting still frees memory.
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
        pause_gc: bool = True,
    ):
        if kernels not in KERNEL_MODES:
            raise ScheduleError(f"kernels must be one of {KERNEL_MODES}, got {kernels!r}")
        if units is not None and any(int(n) <= 0 for n in units.values()):
            raise ScheduleError(f"every engine needs at least one unit, got {dict(units)}")
        if not stall_timeout > 0:
            raise ScheduleError(f"stall_timeout must be positive, got {stall_timeout!r}")
        if intra_op_threads is not None and intra_op_threads <= 0:
            raise ScheduleError(f"intra_op_threads must be positive, got {intra_op_threads!r}")
        self.units = {k: int(n) for k, n in units.items()} if units is not None else None
        self.policy = policy
        self.ctx = ctx or ExecContext()
        self.observers = list(observers)
        self.kernels = kernels
        self.stall_timeout = float(stall_timeout)
        self.intra_op_threads = intra_op_threads
        self.pause_gc = pause_gc

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

        def run(calls: list[Call] | None) -> tuple[Recorder, list[_Log]]:  # (the inputs are checked by now)
            rec = Recorder(graph, self.observers, mode="execute", clock="wall", units=units, rank=self.ctx.rank,
                           world_size=self.ctx.world_size, kernels=self.kernels)
            return rec, _Run(graph, units, core, calls, self, rec, cancel).execute()
        with gc_paused(self.pause_gc), _torch_threads(self.intra_op_threads):
            if self.kernels == "null":
                bufs: dict[str, torch.Tensor] = {}
                rec, records = run(None)
            else:
                make = kernel_call if self.kernels == "kernel" else reference_call
                with bound_plan(graph, make, self.ctx, inputs) as (plan, bufs):
                    rec, records = run(plan.calls)
            trace = rec.finish(columns=_by_start(graph, records, self.ctx.rank))
        return RunResult({b.name: bufs[b.name] for b in graph.outputs} if bufs else {}, trace, bufs)


def _by_start(graph: TaskGraph, records: list[_Log], rank: int):
    """Trace columns of the workers' logs, ordered by start (ties: task id)."""
    tid, start, end = (np.concatenate([np.frombuffer(r[k], dtype=r[k].typecode) for r in records] or [np.zeros(0)])
                       for k in (1, 2, 3))
    unit = np.concatenate([np.full(len(r[1]), r[0], dtype=np.int64) for r in records] or [np.zeros(0)])
    order = np.lexsort((tid, start))
    return columns_of(graph, tid[order], unit[order], start[order], end[order], rank)


_Log = tuple[int, array, array, array]
"""One worker's runs: its unit, then task ids, starts and ends (array columns)."""


@contextmanager
def _torch_threads(n: int | None) -> Iterator[None]:
    saved = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if n:
            torch.set_num_threads(saved)


class _Parker:
    """A worker's parking spot: a lock it blocks on while idle, released to wake it."""

    __slots__ = ("park", "waiting")

    def __init__(self) -> None:
        self.park = threading.Lock()
        self.park.acquire()
        self.waiting = False


class _Run:
    """State of one run: the core behind one lock, idle workers parked per engine kind.

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
        self.parked: dict[str, list[_Parker]] = {e: [] for e in units}
        self.n_parked = 0
        self.error: BaseException | None = None
        self.cancelled = False  # cancelled or interrupted by the caller: do not wait for kernels
        self.finished = threading.Event()
        self.last_progress = time.perf_counter()
        self.per_unit = getattr(core.policy, "per_unit", False)
        # OpenMP thread counts are per thread: workers take the caller's (set by intra_op_threads)
        self.threads = torch.get_num_threads()

    def execute(self) -> list[_Log]:
        """Run every task; return each worker's log."""
        if not self.core.is_active:
            return []
        records: list[_Log] = []
        threads = []
        for engine, n in self.units.items():
            for unit in range(n):
                rec = (unit, array("q"), array("d"), array("d"))
                records.append(rec)
                threads.append(threading.Thread(target=self._worker, args=(engine, unit, rec),
                                                name=f"megaloom-{engine}.{unit}", daemon=True))
        stall = self.ex.stall_timeout
        try:
            for th in threads:
                th.start()
            poll = min(0.1, stall / 4)
            while not self.finished.wait(poll):
                with self.lock:
                    if self.cancel is not None and self.cancel.is_set():
                        self.cancelled = True
                        self._stop(ExecutionError(f"run of graph {self.graph.name!r} was cancelled"))
                    elif self.error is None and time.perf_counter() - self.last_progress > stall:
                        self._stop(self._deadlock())
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
            deadline = time.perf_counter() + wait
            for th in threads:
                if th.ident is not None:
                    th.join(max(0.0, deadline - time.perf_counter()))
            self._report_abandoned([th for th in threads if th.is_alive()])
        if self.error is not None:
            raise self.error
        return records

    def _report_abandoned(self, stuck: list[threading.Thread]) -> None:
        """Name the workers left inside a kernel (daemon threads: they end when it returns)."""
        if not stuck or self.error is None:
            return
        with self.lock:
            running = ", ".join(repr(t) for t, why in self.core.blocked().items() if why == ["(running)"])
        note = f"abandoned {len(stuck)} worker(s) still inside a kernel ({', '.join(th.name for th in stuck)}; " \
               f"task(s) {running or '?'})"
        if type(self.error) is ExecutionError:  # a cancelled or failed run: the note joins the message
            self.error.args = (f"{self.error}; {note}",)
        elif hasattr(self.error, "add_note"):  # the caller's KeyboardInterrupt, say
            self.error.add_note(f"megaloom: {note}")

    def _deadlock(self) -> DeadlockError:
        return self.core.deadlock(f"graph {self.graph.name!r} made no progress for {self.ex.stall_timeout:g} s; "
                                  f"{self.core.remaining} tasks not done")

    def _stop(self, error: BaseException | None = None) -> None:
        """Record the run's first error, if any, and wake every worker so it exits."""
        if self.error is None:
            self.error = error
        for e in self.parked:
            self._wake(e, every=True)
        self.finished.set()

    def _wake(self, engine: str, every: bool = False) -> None:
        """Wake one parked worker of ``engine`` (all of them with ``every``)."""
        parked = self.parked[engine]
        while parked:
            p = parked.pop()
            p.waiting = False
            self.n_parked -= 1
            p.park.release()
            if not every:
                return

    def _worker(self, engine: str, unit: int, rec: _Log) -> None:
        core, lock, parked = self.core, self.lock, self.parked
        mine = parked[engine]
        pop, done_pop, has_ready = core.pop, core.done_pop, core.policy.has_ready
        engines = list(parked)
        wake = self._wake
        every = self.per_unit  # per-unit queues: any unit may be the one with work
        calls = self.calls
        perf = time.perf_counter
        log_tid, log_start, log_end = rec[1].append, rec[2].append, rec[3].append
        show = self.rec.task if self.rec.observers else None
        me = _Parker()
        torch.set_num_threads(self.threads)
        lock.acquire()
        try:
            tid = -1
            while self.error is None and core.remaining:
                if tid < 0:
                    tid = pop(engine, unit)
                    if tid < 0:
                        self._park(me, mine)
                        continue
                if mine and has_ready(engine):  # chain: more work of this kind is ready
                    wake(engine, every)
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
                log_tid(tid)
                log_start(t0)
                log_end(t1)
                tid = done_pop(tid, engine, unit)  # the next task of this unit, if one is ready
                self.last_progress = t1
                if not core.remaining:
                    self._stop()
                    return
                if self.n_parked:
                    for e in engines:
                        if parked[e] and has_ready(e):
                            wake(e, every)
        except BaseException as e:  # the core or the policy failed (lock held): stop the run now
            err = ScheduleError(f"policy {type(core.policy).__name__} or the core failed in worker "
                                f"{engine}.{unit}: {type(e).__name__}: {e}")
            err.__cause__ = e
            self._stop(e if isinstance(e, MegaloomError) else err)
        finally:
            lock.release()

    def _park(self, me: _Parker, mine: list[_Parker]) -> None:
        """Sleep until woken or ``IDLE_POLL`` passes (called and returns with the lock held)."""
        me.waiting = True
        mine.append(me)
        self.n_parked += 1
        self.lock.release()
        got = me.park.acquire(True, self.IDLE_POLL)
        self.lock.acquire()
        if me.waiting:  # timed out and nobody woke us: leave the idle list
            me.waiting = False
            mine.remove(me)
            self.n_parked -= 1
        elif not got:  # a wake-up raced with the timeout: consume it
            me.park.acquire(False)
