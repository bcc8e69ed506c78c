"""Reference and thread executors: results, failures, stalls, async front, options."""
import asyncio
import threading
import time

import pytest
import torch

from megaloom.runtime import (
    FIFO, DeadlockError, ExecutionError, Observer, ReferenceExecutor, ScheduleError, TaskGraph, ThreadExecutor,
)
from megaloom.ops.basic import same_shape
from megaloom.runtime.registry import Cost, OpDef, register


def _raise_kernel(ins, outs, **attrs):
    raise ZeroDivisionError("boom in kernel")


register(OpDef("test_fail", ("vector",), lambda x: 1 / 0, same_shape, lambda i, o, a: Cost(), _raise_kernel),
         replace=True)

_RELEASE = threading.Event()


def _slow_kernel(ins, outs, seconds=0.2):
    _RELEASE.wait(seconds)
    outs[0].copy_(ins[0])


register(OpDef("test_slow", ("vector", "cube", "comm"), lambda x, seconds=0.2: x.clone(), same_shape,
               lambda i, o, a: Cost(), _slow_kernel), replace=True)


def busy_workers() -> list[threading.Thread]:
    """Worker threads not back in the executor's pool (none once every run has returned)."""
    from megaloom.runtime.executors.threaded import _POOL

    idle = {w.thread for w in _POOL.idle}
    return [t for t in threading.enumerate() if t.name.startswith("megaloom-") and t not in idle]


def mlp_graph(tiles: int = 4, rows: int = 8) -> TaskGraph:
    g = TaskGraph("mlp")
    n = tiles * rows
    x, w1, w2 = g.input("x", (n, 8)), g.input("w1", (8, 16)), g.input("w2", (16, 8))
    h, a, y = g.buffer("h", (n, 16)), g.buffer("a", (n, 16)), g.output("y", (n, 8))
    for i in range(tiles):
        r = slice(i * rows, (i + 1) * rows)
        g.task("matmul", [x[r], w1], [h[r]], name=f"mm1.{i}")
        g.task("silu", [h[r]], [a[r]], name=f"act.{i}")
        g.task("matmul", [a[r], w2], [y[r]], name=f"mm2.{i}")
        g.task("add", [y[r], x[r]], [y[r]], name=f"res.{i}")   # in place
    return g


def mlp_inputs(g: TaskGraph) -> dict:
    gen = torch.Generator().manual_seed(0)
    return {b.name: torch.randn(b.shape, generator=gen) for b in g.inputs}


def torch_mlp(inp: dict) -> torch.Tensor:
    x = inp["x"]
    return torch.nn.functional.silu(x @ inp["w1"]) @ inp["w2"] + x


def test_reference_matches_plain_torch():
    g = mlp_graph()
    inp = mlp_inputs(g)
    out = ReferenceExecutor().run(g, inp)
    torch.testing.assert_close(out["y"], torch_mlp(inp))
    assert len(out.trace.events) == len(g) and out.trace.meta["mode"] == "reference"


@pytest.mark.parametrize("kernels", ["kernel", "reference"])
def test_threaded_matches_reference(kernels):
    g = mlp_graph()
    inp = mlp_inputs(g)
    want = ReferenceExecutor().run(g, inp)["y"]
    res = ThreadExecutor({"cube": 2, "vector": 2}, kernels=kernels).run(g, inp)
    assert torch.equal(res["y"], want)
    ev = res.trace.events
    assert sorted(e.task for e in ev) == sorted(t.name for t in g.tasks)
    end = {e.task_id: e.end for e in ev}
    for e in ev:   # every task started after all its predecessors ended
        assert all(end[d] <= e.start for d in e.deps), e.task
    assert {(e.engine, e.unit) for e in ev} <= {("cube", 0), ("cube", 1), ("vector", 0), ("vector", 1)}


def test_inputs_are_not_modified_and_inout_is_copied():
    g = TaskGraph()
    x = g.inout("x", (4,))
    g.task("silu", [x], [x])
    inp = {"x": torch.ones(4)}
    out = ThreadExecutor().run(g, inp)
    assert torch.equal(inp["x"], torch.ones(4)) and torch.allclose(out["x"], torch.nn.functional.silu(torch.ones(4)))


@pytest.mark.parametrize("inputs, needle", [
    ({}, "input 'x' (4,) float32 was not given"),
    ({"x": torch.ones(4), "z": torch.ones(1)}, "no input buffer named 'z'"),
    ({"x": torch.ones(5)}, "input 'x' is (5,) torch.float32, graph 'graph' expects (4,)"),
    ({"x": torch.ones(4, dtype=torch.float64)}, "torch.float64"),
    ({"x": [1, 2, 3, 4]}, "must be a torch.Tensor"),
])
def test_bad_inputs(inputs, needle):
    g = TaskGraph()
    x, y = g.input("x", (4,)), g.output("y", (4,))
    g.task("silu", [x], [y])
    for ex in (ReferenceExecutor(), ThreadExecutor()):
        with pytest.raises(ExecutionError, match=needle.replace("(", r"\(").replace(")", r"\)")):
            ex.run(g, inputs)


def _failing_graph(n_side: int = 6) -> TaskGraph:
    g = TaskGraph("fails")
    x = g.input("x", (4,))
    for i in range(n_side):   # independent slow work that keeps other workers busy
        g.task("test_slow", [x], [g.buffer(f"s{i}", (4,))], name=f"side{i}", attrs={"seconds": 0.05})
    h = g.buffer("h", (4,))
    g.task("test_fail", [x], [h], name="bad_task")
    g.task("silu", [h], [g.output("y", (4,))], name="after_bad")
    return g


@pytest.mark.parametrize("executor", [ReferenceExecutor(), ThreadExecutor({"vector": 3})])
def test_failing_task_stops_run_with_name_and_cause(executor):
    t0 = time.perf_counter()
    with pytest.raises(ExecutionError, match="'bad_task'") as info:
        executor.run(_failing_graph(), {"x": torch.ones(4)})
    assert time.perf_counter() - t0 < 2.0
    e = info.value
    assert e.task == "bad_task" and isinstance(e.__cause__, ZeroDivisionError)
    assert busy_workers() == []


def test_failing_reference_mode_and_bad_reference_output():
    g = TaskGraph()
    x, y = g.input("x", (4,)), g.output("y", (4,))
    g.task("test_fail", [x], [y], name="ref_fail")
    with pytest.raises(ExecutionError, match="'ref_fail'") as info:
        ThreadExecutor(kernels="reference").run(g, {"x": torch.ones(4)})
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    register(OpDef("test_wrong_shape", ("vector",), lambda x: x[:2], same_shape, lambda i, o, a: Cost()), replace=True)
    g = TaskGraph()
    x, y = g.input("x", (4,)), g.output("y", (4,))
    g.task("test_wrong_shape", [x], [y], name="short")
    for ex in (ReferenceExecutor(), ThreadExecutor()):
        with pytest.raises(ExecutionError, match=r"returned \(2,\) for output 0 of task 'short', which is \(4,\)"):
            ex.run(g, {"x": torch.ones(4)})


class Withhold(FIFO):
    """A policy that never hands out one task: the run can make no progress."""

    def __init__(self, name: str):
        self.name_held = name

    def prepare(self, graph, units):
        super().prepare(graph, units)
        self.held = graph[self.name_held].id

    def pop(self, engine, unit):
        q = self._queues[engine]
        if q and q[0] == self.held:
            return -1
        return super().pop(engine, unit)


def test_stall_raises_deadlock_listing_blocked_tasks():
    g = TaskGraph("stuck")
    a, b, c = g.task("noop", name="a"), g.task("noop", name="held"), g.task("noop", name="c")
    a.precede(b)
    b.precede(c)
    t0 = time.perf_counter()
    with pytest.raises(DeadlockError) as info:
        ThreadExecutor(policy=Withhold("held"), kernels="null", stall_timeout=0.3).run(g)
    assert 0.25 < time.perf_counter() - t0 < 3.0
    e = info.value
    assert e.blocked == {"held": ["(ready, no unit took it)"], "c": ["held"]}
    assert "made no progress for 0.3 s" in str(e) and "c waits for held" in str(e)
    assert busy_workers() == []


def test_long_task_counts_as_stall():
    g = TaskGraph("slow")
    x, y = g.input("x", (2,)), g.output("y", (2,))
    g.task("test_slow", [x], [y], name="sleeper", attrs={"seconds": 5.0})
    _RELEASE.clear()
    try:
        with pytest.raises(DeadlockError, match="sleeper waits for \\(running\\)"):
            ThreadExecutor(stall_timeout=0.2).run(g, {"x": torch.ones(2)})
    finally:
        _RELEASE.set()


def test_run_async_and_concurrent_runs_share_one_executor():
    g = mlp_graph()
    inp = mlp_inputs(g)
    want = ReferenceExecutor().run(g, inp)["y"]
    ex = ThreadExecutor({"cube": 1, "vector": 2}, policy=FIFO())

    async def main():
        return await asyncio.gather(*(ex.run_async(g, inp) for _ in range(3)))

    for res in asyncio.run(main()):
        assert torch.equal(res["y"], want)


async def test_run_async_raises_execution_error():
    with pytest.raises(ExecutionError, match="'bad_task'"):
        await ThreadExecutor({"vector": 2}).run_async(_failing_graph(1), {"x": torch.ones(4)})


def test_intra_op_threads_is_set_during_the_run_and_restored():
    seen = []
    register(OpDef("test_threads", ("vector",), lambda x: x.clone(), same_shape, lambda i, o, a: Cost(),
                   lambda ins, outs: (seen.append(torch.get_num_threads()), outs[0].copy_(ins[0]))), replace=True)
    g = TaskGraph()
    x, y = g.input("x", (2,)), g.output("y", (2,))
    g.task("test_threads", [x], [y])
    before = torch.get_num_threads()
    ThreadExecutor(intra_op_threads=1).run(g, {"x": torch.ones(2)})
    assert seen == [1] and torch.get_num_threads() == before


def test_gc_is_paused_during_the_run_only():
    import gc

    seen = []
    register(OpDef("test_gc", ("vector",), lambda x: x.clone(), same_shape, lambda i, o, a: Cost(),
                   lambda ins, outs: (seen.append(gc.isenabled()), outs[0].copy_(ins[0]))), replace=True)
    g = TaskGraph()
    x, y = g.input("x", (2,)), g.output("y", (2,))
    g.task("test_gc", [x], [y])
    assert gc.isenabled()
    ThreadExecutor().run(g, {"x": torch.ones(2)})
    ThreadExecutor(pause_gc=False).run(g, {"x": torch.ones(2)})
    assert seen == [False, True] and gc.isenabled()


def test_observers_see_every_task_and_the_trace():
    class Count(Observer):
        def __init__(self):
            self.started, self.tasks, self.trace = None, [], None

        def on_run_start(self, graph, meta):
            self.started = meta["mode"]

        def on_task(self, event):
            self.tasks.append(event.task)

        def on_run_end(self, trace):
            self.trace = trace

    g = mlp_graph(2)
    for ex in (ReferenceExecutor(observers=[o1 := Count()]), ThreadExecutor(observers=[o2 := Count()])):
        ex.run(g, mlp_inputs(g))
    for o, mode in ((o1, "reference"), (o2, "execute")):
        assert o.started == mode and sorted(o.tasks) == sorted(t.name for t in g.tasks)
        assert len(o.trace.events) == len(g)


@pytest.mark.parametrize("kwargs, needle", [
    ({"kernels": "fast"}, "kernels must be one of"),
    ({"units": {"cube": 0}}, "at least one unit"),
    ({"stall_timeout": 0}, "stall_timeout must be positive"),
    ({"intra_op_threads": 0}, "intra_op_threads must be positive"),
])
def test_bad_options(kwargs, needle):
    with pytest.raises(ScheduleError, match=needle):
        ThreadExecutor(**kwargs)


def test_missing_engine_units_and_empty_graph():
    g = mlp_graph(1)
    with pytest.raises(ScheduleError, match=r"\['cube'\] with no units"):
        ThreadExecutor({"vector": 1}).run(g, mlp_inputs(g))
    empty = ThreadExecutor().run(TaskGraph("empty"))
    assert empty.outputs == {} and empty.trace.events == []


def test_null_kernels_dispatch_without_buffers():
    g = mlp_graph(3)
    res = ThreadExecutor({"cube": 1, "vector": 1}, kernels="null").run(g)
    assert res.outputs == {} and len(res.trace.events) == len(g)


def test_kernels_reading_what_they_overwrite_see_the_old_values():
    g = TaskGraph("alias")
    a = g.inout("a", (6, 2))
    w = g.input("w", (2, 2))
    g.task("matmul", [a[0:2], w], [a[0:2]], name="mm_in_place")     # out= over its own input
    g.task("add", [a[2:4], a[3:5]], [a[3:5]], name="partial")       # inputs overlap the output partly
    g.task("silu", [a[4:6]], [a[4:6]], name="ew_in_place")          # element-wise in place: no copy needed
    inp = {"a": torch.randn(6, 2), "w": torch.randn(2, 2)}
    want = ReferenceExecutor().run(g, inp)["a"]
    torch.testing.assert_close(ThreadExecutor().run(g, inp)["a"], want)


async def test_cancelling_run_async_stops_the_workers():
    g = TaskGraph("long")
    x = g.input("x", (2,))
    prev = x
    for i in range(200):   # a chain of 200 x 20 ms
        nxt = g.buffer(f"b{i}", (2,))
        g.task("test_slow", [prev], [nxt], name=f"s{i}", attrs={"seconds": 0.02})
        prev = nxt
    _RELEASE.clear()
    job = asyncio.ensure_future(ThreadExecutor().run_async(g, {"x": torch.ones(2)}))
    await asyncio.sleep(0.2)
    t0 = time.perf_counter()
    job.cancel()
    with pytest.raises(asyncio.CancelledError):
        await job
    assert time.perf_counter() - t0 < 1.0
    assert busy_workers() == []


def test_a_failing_policy_stops_the_run_promptly():
    class Broken(FIFO):
        def pop(self, engine, unit):
            raise KeyError("no such queue")

    g = TaskGraph("p")
    g.task("noop", name="only")
    t0 = time.perf_counter()
    with pytest.raises(ScheduleError, match="policy Broken or the core failed in worker megaloom-worker-[0-9]+: KeyError") as info:
        ThreadExecutor(policy=Broken(), kernels="null", stall_timeout=30).run(g)
    assert time.perf_counter() - t0 < 2.0 and isinstance(info.value.__cause__, KeyError)


@pytest.mark.parametrize("name, opts", [("fifo", {}), ("priority", {}), ("critical_path", {}), ("static", {}),
                                        ("expert_interleave", {"group_size": 2}), ("rotated", {})])
def test_every_scheduler_policy_drives_the_thread_executor(name, opts):
    from megaloom.scheduler import make_policy

    g = mlp_graph(tiles=6, rows=4)
    inp = mlp_inputs(g)
    want = ReferenceExecutor().run(g, inp)["y"]
    res = ThreadExecutor({"cube": 2, "vector": 3}, policy=make_policy(name, **opts), stall_timeout=10).run(g, inp)
    assert torch.equal(res["y"], want)
