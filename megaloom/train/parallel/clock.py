"""Communication time of a training step: the time during which at least one collective was in flight.

Every collective the trainer issues or hands to torch reports ``(start, end)`` to a
:class:`CommClock`: megaloom communicators through :class:`TimedCommunicator` (expert
all-to-all, context-parallel K/V exchange, gradient all-reduce), FSDP2's all-gathers and
reduce-scatters through its custom-collective hooks (:class:`TimedAllGather`,
:class:`TimedReduceScatter`; the end comes from the work's future). :meth:`CommClock.take`
returns the length of the union of the spans, so overlapping collectives count once.
DTensor's tensor-parallel collectives have no such hook and are not counted.
"""
from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from megaloom.comm.communicator import Communicator, Handle


class CommClock:
    """Spans of collectives; :meth:`take` sums their union and starts afresh."""

    def __init__(self) -> None:
        self._spans: list[tuple[float, float]] = []

    def add(self, start: float, end: float) -> None:
        self._spans.append((start, end))  # list.append is atomic: gloo threads may call this

    def work(self, work: Any, start: float) -> None:
        """Count a torch.distributed ``work`` (None: already complete) from ``start`` to its completion."""
        if work is None:
            self.add(start, time.perf_counter())
        else:
            work.get_future().add_done_callback(lambda _f: self.add(start, time.perf_counter()))

    def take(self) -> float:
        spans, self._spans = sorted(self._spans), []
        total, end = 0.0, float("-inf")
        for s, e in spans:
            if e > end:
                total += e - max(s, end)
                end = e
        return total


class _TimedHandle(Handle):
    def __init__(self, inner: Handle, clock: CommClock, start: float):
        self.inner, self.clock, self.start, self.counted = inner, clock, start, False

    def wait(self, timeout: float | None = None) -> None:
        self.inner.wait(timeout)
        if not self.counted:
            self.counted = True
            self.clock.add(self.start, time.perf_counter())

    def is_completed(self) -> bool:
        return self.inner.is_completed()


def _timed(name: str):
    """Communicator method ``name`` of the inner communicator, its span (to its wait, when async) reported."""
    def call(self, *args, async_op: bool = False, **kwargs) -> Handle:
        t0 = time.perf_counter()
        h = _TimedHandle(getattr(self.inner, name)(*args, async_op=True, **kwargs), self.clock, t0)
        if not async_op:
            h.wait()
        return h
    return call


def _spanned(name: str):
    """Blocking method ``name`` of the inner communicator, its span reported."""
    def call(self, *args, **kwargs) -> Any:
        t0 = time.perf_counter()
        out = getattr(self.inner, name)(*args, **kwargs)
        self.clock.add(t0, time.perf_counter())
        return out
    return call


class TimedCommunicator(Communicator):
    """A Communicator reporting the span of each collective (to its wait, when async) to ``clock``."""

    all_to_all, all_gather, reduce_scatter = _timed("all_to_all"), _timed("all_gather"), _timed("reduce_scatter")
    all_reduce, send, recv = _timed("all_reduce"), _timed("send"), _timed("recv")
    barrier, exchange = _spanned("barrier"), _spanned("exchange")

    def __init__(self, inner: Communicator, clock: CommClock):
        self.inner, self.clock = inner, clock
        self.rank, self.world_size, self.timeout, self.check = inner.rank, inner.world_size, inner.timeout, inner.check
        self.group = getattr(inner, "group", None)

    def close(self) -> None:
        self.inner.close()


def fsdp_collectives(clock: CommClock) -> tuple[Any, Any] | None:
    """(all-gather, reduce-scatter) for FSDP2's ``set_custom_all_gather`` / ``set_custom_reduce_scatter``
    that report to ``clock``; None when this torch has no such hooks."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
    except ImportError:  # pragma: no cover - depends on the torch version
        return None

    def timed(base: type, collective: Any) -> Any:
        class Timed(base):  # FSDP2 passes everything but the tensors by keyword
            allocate = staticmethod(lambda size, *, dtype, device: torch.empty(*size, dtype=dtype, device=device))

            def __call__(self, output_tensor, input_tensor, **kwargs):
                t0 = time.perf_counter()
                work = collective(output_tensor, input_tensor, **kwargs)
                clock.work(work, t0)
                return work
        return Timed()

    return timed(AllGather, dist.all_gather_single), timed(ReduceScatter, dist.reduce_scatter_single)
