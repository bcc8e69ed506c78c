"""The fusion pass on task graphs: clusters, boundaries, cycles, limits, executors."""
from __future__ import annotations

import pytest
import torch

from megaloom.ops import dvm
from megaloom.runtime.executors import ReferenceExecutor, ThreadExecutor
from megaloom.runtime.errors import GraphError
from megaloom.runtime.graph import TaskGraph

S = (16, 8)


@pytest.fixture(autouse=True)
def tiled_backend():
    """The fusion pass is checked bit for bit: fused tasks run on the tiled torch backend,
    which makes the very torch calls of the unfused chain (tests/dvm/test_native.py
    covers the native backend)."""
    old = dvm.options().backend
    dvm.configure(backend="tiled")
    yield
    dvm.configure(backend=old)


def silu_graph(g: TaskGraph, x, y, tag: str = "") -> None:
    a, b, c, d = (g.buffer(f"{tag}{n}", x.shape if hasattr(x, "shape") else S) for n in "abcd")
    g.task("dvm.neg", [x], [a])
    g.task("dvm.exp", [a], [b])
    g.task("dvm.add", [b], [c], attrs={"scalar": 1.0})
    g.task("dvm.reciprocal", [c], [d])
    g.task("dvm.mul", [x, d], [y])


def run_both(g: TaskGraph, f: TaskGraph, feed: dict) -> None:
    want = ReferenceExecutor().run(g, feed).outputs
    for ex in (ReferenceExecutor(), ThreadExecutor({"vector": 2, "cube": 1, "comm": 1})):
        got = ex.run(f, feed).outputs
        assert set(got) == set(want)
        for k in want:
            assert torch.equal(got[k], want[k]), k


def ops(g: TaskGraph) -> list[str]:
    return [t.op for t in g.tasks]


def test_silu_chain_becomes_one_fused_task_and_buffers_vanish():
    g = TaskGraph("silu")
    x, y = g.input("x", S), g.output("y", S)
    silu_graph(g, x, y)
    f = dvm.fuse(g)
    assert ops(f) == ["dvm.fused"] and sorted(f.buffers) == ["x", "y"]
    assert f.tasks[0].attrs["members"] == [t.name for t in g.tasks]
    (cost,) = f.costs()
    assert cost.bytes == 2 * 16 * 8 * 4  # x read once, y written once
    assert cost.bytes < sum(c.bytes for c in g.costs())
    run_both(g, f, {"x": torch.randn(S)})


def test_matmul_and_comm_are_boundaries_and_intermediates_used_outside_become_outputs():
    g = TaskGraph("mlp")
    x, w = g.input("x", S), g.input("w", (8, 8))
    h, e, y, z = g.buffer("h", S), g.buffer("e", S), g.output("y", S), g.output("z", S)
    t = g.buffer("t", S)
    g.task("dvm.exp", [x], [t])
    g.task("dvm.mul", [t], [e], attrs={"scalar": 2.0})  # e is read by the matmul: stays
    g.task("matmul", [e, w], [h])
    g.task("dvm.tanh", [h], [y])
    g.task("dvm.neg", [y], [z])
    f = dvm.fuse(g)
    assert ops(f) == ["dvm.fused", "matmul", "dvm.fused"]
    assert "t" not in f.buffers and "e" in f.buffers
    assert [r.buffer.name for r in f.tasks[2].outputs] == ["y", "z"]  # y is a graph output too
    run_both(g, f, {"x": torch.randn(S), "w": torch.randn(8, 8)})

    g2 = TaskGraph("comm")
    x = g2.input("x", S)
    a, b, c = g2.buffer("a", S), g2.buffer("b", S), g2.output("c", S)
    g2.task("dvm.exp", [x], [a])
    g2.task("copy", [a], [b], engine="comm")
    g2.task("dvm.neg", [b], [c])
    assert ops(dvm.fuse(g2)) == ["dvm.exp", "copy", "dvm.neg"]


def test_no_cycle_through_a_non_fused_task():
    # a = exp(x); m = a @ w (cube); y = a + m. Fusing exp with add would need m inside.
    g = TaskGraph("diamond")
    x, w = g.input("x", (8, 8)), g.input("w", (8, 8))
    a, m, y = g.buffer("a", (8, 8)), g.buffer("m", (8, 8)), g.output("y", (8, 8))
    g.task("dvm.exp", [x], [a])
    g.task("matmul", [a, w], [m])
    g.task("dvm.add", [a, m], [y])
    f = dvm.fuse(g)
    assert ops(f) == ["dvm.exp", "matmul", "dvm.add"]
    f.validate()
    run_both(g, f, {"x": torch.randn(8, 8), "w": torch.randn(8, 8)})


def test_cycle_through_another_cluster_is_avoided():
    # x -> e1 -> [matmul] -> e3 and e1 -> e2 -> e3: e1, e2, e3 fuse only if no path leaves
    g = TaskGraph("two")
    x, w = g.input("x", (8, 8)), g.input("w", (8, 8))
    b = {n: g.buffer(n, (8, 8)) for n in ("a", "b", "m", "n")}
    y = g.output("y", (8, 8))
    g.task("dvm.exp", [x], [b["a"]])
    g.task("dvm.neg", [b["a"]], [b["b"]])
    g.task("matmul", [b["b"], w], [b["m"]])
    g.task("dvm.tanh", [b["m"]], [b["n"]])
    g.task("dvm.add", [b["a"], b["n"]], [y])
    f = dvm.fuse(g)
    f.validate()
    assert ops(f).count("matmul") == 1
    for t in f.tasks:  # exp/neg fuse; the add must stay out of their cluster
        if t.op == "dvm.fused":
            assert "dvm.add#4" not in t.attrs["members"] or "dvm.exp#0" not in t.attrs["members"]
    run_both(g, f, {"x": torch.randn(8, 8), "w": torch.randn(8, 8)})


def test_limits_split_long_chains():
    g = TaskGraph("long")
    prev = g.input("x", S)
    for i in range(30):
        nxt = g.output("y", S) if i == 29 else g.buffer(f"v{i}", S)
        g.task("dvm.tanh" if i % 3 == 0 else "dvm.mul", [prev], [nxt], attrs={} if i % 3 == 0 else {"scalar": 0.9})
        prev = nxt
    f = dvm.fuse(g)
    limits = dvm.Limits()
    assert all(t.op == "dvm.fused" for t in f.tasks)
    for t in f.tasks:
        p = dvm.program_of(t.attrs)
        assert len(p.code) <= limits.max_ops and p.icost() <= limits.max_cost
        assert len(p.inputs) + len(p.outputs) <= limits.max_io
    assert sum(len(dvm.program_of(t.attrs).code) for t in f.tasks) == 30
    run_both(g, f, {"x": torch.randn(S)})
    tight = dvm.fuse(g, dvm.Limits(max_ops=4, max_io=16, max_cost=100))
    assert max(len(dvm.program_of(t.attrs).code) for t in tight.tasks) <= 4


def test_broadcast_tiles_regions_and_control_edges():
    g = TaskGraph("bcast")
    x, bias = g.input("x", (16, 8)), g.input("bias", (1, 8))
    y = g.output("y", (16, 8))
    big = g.buffer("big", (32, 8))  # two tiles of one buffer, each written by its own chain
    top, bot = big[0:16, :], big[16:32, :]
    t1 = g.task("dvm.add", [x, bias], [top])
    g.task("dvm.sigmoid", [top], [bot])
    done = g.task("noop", [], [], engine="vector")
    g.task("dvm.mul", [bot, x], [y]).succeed(done)
    t1.succeed(done)  # control edge: noop runs before the first add
    f = dvm.fuse(g)
    assert sorted(ops(f)) == ["dvm.fused", "noop"]
    noop = next(t for t in f.tasks if t.op == "noop")
    fused = next(t for t in f.tasks if t.op == "dvm.fused")
    assert noop.id in f.pred[fused.id]
    run_both(g, f, {"x": torch.randn(16, 8), "bias": torch.randn(1, 8)})


def test_in_place_and_double_write_tasks_are_not_fused():
    g = TaskGraph("inplace")
    x, y = g.inout("x", S), g.output("y", S)
    g.task("dvm.exp", [x], [x])  # in place
    g.task("dvm.neg", [x], [y])
    assert ops(dvm.fuse(g)) == ["dvm.exp", "dvm.neg"]


def test_basic_add_and_mul_fuse_and_backend_attr():
    g = TaskGraph("basic")
    x, y = g.input("x", S), g.output("y", S)
    a = g.buffer("a", S)
    g.task("add", [x, x], [a])
    g.task("mul", [a, x], [y])
    f = dvm.fuse(g, backend="tiled")
    assert ops(f) == ["dvm.fused"] and f.tasks[0].attrs["backend"] == "tiled"
    run_both(g, f, {"x": torch.randn(S)})


def test_fused_graph_round_trips(tmp_path):
    g = TaskGraph("rt")
    x, y = g.input("x", S), g.output("y", S)
    silu_graph(g, x, y)
    f = dvm.fuse(g)
    f.save(str(tmp_path / "g.mlg"))
    back = TaskGraph.load(str(tmp_path / "g.mlg"))
    xx = torch.randn(S)
    assert torch.equal(ThreadExecutor().run(back, {"x": xx})["y"], ReferenceExecutor().run(g, {"x": xx})["y"])


def test_fx_front_end():
    def f(x, b, w):
        y = torch.sigmoid(x * 1.5 + b)
        return y, torch.relu(y @ w) - 1.0

    j = dvm.jit(f)
    x, b, w = torch.randn(6, 6), torch.randn(6), torch.randn(6, 6)
    y, z = j(x, b, w)
    wy, wz = f(x, b, w)
    assert torch.equal(y, wy) and torch.allclose(z, wz)
    assert sorted(ops(j.graph(x, b, w))) == ["dvm.fused", "dvm.fused", "matmul"]

    with pytest.raises(GraphError, match="no DVM primitive"):
        dvm.jit(lambda t: t.sum())(x)


def test_simulator_sees_the_saved_traffic():
    sched = pytest.importorskip("megaloom.scheduler")
    g = TaskGraph("silu-big")
    x, y = g.input("x", (4096, 1024)), g.output("y", (4096, 1024))
    silu_graph(g, x, y)
    prof = sched.load_profile("ascend-910b")
    before = sched.Simulator(prof).run(g).trace
    after = sched.Simulator(prof).run(dvm.fuse(g)).trace
    span = lambda tr: max(e.end for e in tr.events) - min(e.start for e in tr.events)  # noqa: E731
    assert span(after) < 0.5 * span(before)


def test_partial_read_of_a_member_write_is_not_fused():
    g = TaskGraph("partial")
    x, y = g.input("x", (8, 8)), g.output("y", (4, 8))
    a = g.buffer("a", (8, 8))
    g.task("dvm.exp", [x], [a])
    g.task("dvm.neg", [a[0:4, :]], [y])  # reads half of what exp wrote: stays a boundary
    f = dvm.fuse(g)
    assert ops(f) == ["dvm.exp", "dvm.neg"]
    run_both(g, f, {"x": torch.randn(8, 8)})


def test_reductions_are_boundaries():
    from megaloom.runtime.registry import Cost, OpDef, TensorSpec, register

    register(OpDef("test.dvm_rowsum", ("vector",), lambda x: x.sum(1, keepdim=True),
                   lambda ins, a: [TensorSpec((ins[0].shape[0], 1), ins[0].dtype)],
                   lambda i, o, a: Cost(flops=i[0].numel, bytes=i[0].nbytes)), replace=True)
    g = TaskGraph("norm")
    x, y = g.input("x", S), g.output("y", S)
    e, s, r = g.buffer("e", S), g.buffer("s", (16, 1)), g.buffer("r", (16, 1))
    g.task("dvm.exp", [x], [e])
    g.task("test.dvm_rowsum", [e], [s])
    g.task("dvm.reciprocal", [s], [r])
    g.task("dvm.mul", [e, r], [y])  # broadcasts the column over the rows
    f = dvm.fuse(g)
    assert ops(f) == ["dvm.exp", "test.dvm_rowsum", "dvm.fused"]
    run_both(g, f, {"x": torch.randn(S)})


def test_concurrent_fused_tasks_share_the_tile_workers():
    g = TaskGraph("two-chains")
    shape = (128, 64)
    for i in range(3):
        x, y = g.input(f"x{i}", shape), g.output(f"y{i}", shape)
        silu_graph(g, x, y, tag=f"c{i}")
    f = dvm.fuse(g)
    assert ops(f) == ["dvm.fused"] * 3
    saved = dvm.options()
    dvm.configure(tile_bytes=2048, threads=2)  # 16 tiles per task, three tasks at once
    try:
        feed = {f"x{i}": torch.randn(shape, generator=torch.Generator().manual_seed(i)) for i in range(3)}
        want = ReferenceExecutor().run(g, feed).outputs
        got = ThreadExecutor({"vector": 3}).run(f, feed).outputs
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=4e-7, atol=1e-7)
    finally:
        dvm.configure(tile_bytes=saved.tile_bytes, threads=saved.threads)
