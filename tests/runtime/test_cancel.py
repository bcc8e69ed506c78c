"""Cancelling a run returns within a second even when a kernel hangs; the stuck worker is
abandoned (it ends when its kernel returns) and named in the error."""
from __future__ import annotations

import _thread
import asyncio
import gc
import threading
import time

import pytest
import torch

from megaloom.ops.basic import same_shape
from megaloom.runtime import ExecutionError, TaskGraph, ThreadExecutor
from megaloom.runtime.registry import Cost, OpDef, register

_UNHANG = threading.Event()
_ENTERED = threading.Event()


def _hang(ins, outs):
    _ENTERED.set()
    _UNHANG.wait(60)  # a kernel stuck far longer than anyone waits
    outs[0].copy_(ins[0])


register(OpDef("test_hang", ("vector",), lambda x: x.clone(), same_shape, lambda i, o, a: Cost(), _hang), replace=True)


def _graph() -> TaskGraph:
    g = TaskGraph("hung")
    x, y = g.input("x", (2,)), g.output("y", (2,))
    g.task("test_hang", [x], [y], name="stuck")
    return g


@pytest.fixture
def hung():
    _UNHANG.clear()
    _ENTERED.clear()
    yield _graph()
    _UNHANG.set()  # let the abandoned worker finish


async def test_wait_for_on_run_async_returns_promptly_with_a_hung_kernel(hung):
    loop = asyncio.get_running_loop()
    unretrieved: list = []
    loop.set_exception_handler(lambda loop, ctx: unretrieved.append(ctx))
    t0 = time.perf_counter()
    with pytest.raises((asyncio.TimeoutError, TimeoutError)):
        await asyncio.wait_for(ThreadExecutor(stall_timeout=60).run_async(hung, {"x": torch.ones(2)}), 1.0)
    assert time.perf_counter() - t0 < 1.0 + 1.0  # was 61 s (the whole stall timeout)
    gc.collect()
    await asyncio.sleep(0)
    assert unretrieved == []  # no "Task exception was never retrieved"


def test_ctrl_c_on_run_returns_within_a_second_and_names_the_abandoned_task(hung):
    def interrupt() -> None:
        _ENTERED.wait(10)
        time.sleep(0.1)
        _thread.interrupt_main()

    threading.Thread(target=interrupt, daemon=True).start()
    t0 = time.perf_counter()
    with pytest.raises(KeyboardInterrupt) as info:
        ThreadExecutor(stall_timeout=60).run(hung, {"x": torch.ones(2)})
    took = time.perf_counter() - t0 - 0.1
    assert took < 1.0
    assert any("abandoned 1 worker(s) still inside a kernel" in n and "'stuck'" in n
               for n in getattr(info.value, "__notes__", []))


async def test_cancelled_error_names_the_abandoned_task(hung):
    from megaloom.runtime.executors.threaded import _Run  # the run behind run_async, cancelled directly

    cancel = threading.Event()
    ex = ThreadExecutor(stall_timeout=60)
    job = asyncio.ensure_future(asyncio.to_thread(ex._run, hung, {"x": torch.ones(2)}, cancel))
    await asyncio.to_thread(_ENTERED.wait, 10)
    t0 = time.perf_counter()
    cancel.set()
    with pytest.raises(ExecutionError, match=r"was cancelled; abandoned 1 worker\(s\) .*megaloom-worker-[0-9]+ on vector.0.*'stuck'"):
        await job
    assert time.perf_counter() - t0 < _Run.ABANDON_AFTER + 0.5
