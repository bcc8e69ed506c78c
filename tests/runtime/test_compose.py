"""TaskGraph.compose: a sub-graph placed into a graph as one unit."""
import pytest
import torch

from megaloom.runtime import GraphError, ReferenceExecutor, TaskGraph, ThreadExecutor


def block(rows: int = 8, dim: int = 4) -> TaskGraph:
    """y = silu(x @ w) + x, with a scratch buffer and one control edge."""
    b = TaskGraph("block")
    x, w = b.input("x", (rows, dim)), b.input("w", (dim, dim))
    h, y = b.buffer("h", (rows, dim)), b.output("y", (rows, dim))
    mm = b.task("matmul", [x, w], [h], name="mm")
    b.task("silu", [h], [h], name="act")
    b.task("add", [h, x], [y], name="res")
    b.task("noop", name="mark").succeed(mm)
    return b


def test_two_layers_chained_through_bound_buffers():
    g = TaskGraph("net")
    x, w = g.input("x", (8, 4)), g.input("w", (4, 4))
    mid, out = g.buffer("mid", (8, 4)), g.output("out", (8, 4))
    blk = block()
    l0 = g.compose(blk, prefix="l0.", bind={"x": x, "w": w, "y": mid})
    g.compose(blk, prefix="l1.", bind={"x": mid, "w": w, "y": out})
    assert [t.name for t in l0.tasks] == ["l0.mm", "l0.act", "l0.res", "l0.mark"]
    assert set(g.buffers) == {"x", "w", "mid", "out", "l0.h", "l1.h"}
    assert l0["h"].buffer.name == "l0.h" and l0["y"].buffer is mid
    assert g["l1.mm"] in g["l0.res"].successors          # RAW on mid, derived in the host
    assert g["l0.mark"] in g["l0.mm"].successors          # the block's control edge is kept
    inp = {"x": torch.randn(8, 4), "w": torch.randn(4, 4) / 2}
    f = lambda v: torch.nn.functional.silu(v @ inp["w"]) + v  # noqa: E731
    want = f(f(inp["x"]))
    torch.testing.assert_close(ReferenceExecutor().run(g, inp)["out"], want)
    torch.testing.assert_close(ThreadExecutor({"cube": 1, "vector": 2}).run(g, inp)["out"], want)
    assert [t.name for t in l0.sources] == ["l0.mm"] and [t.name for t in l0.sinks] == ["l0.res", "l0.mark"]


def test_bind_to_tiles_and_unbound_inputs_become_graph_inputs():
    g = TaskGraph("tiles")
    x, out = g.input("x", (16, 4)), g.output("out", (16, 4))
    blk = block()
    units = [g.compose(blk, prefix=f"t{i}.", bind={"x": x[i * 8:(i + 1) * 8], "y": out[i * 8:(i + 1) * 8]})
             for i in range(2)]
    assert g.buffers["t0.w"].is_input and units[1]["x"].box == ((8, 16), (0, 4))
    assert not set(units[0].tasks[0].successors) & set(units[1].tasks)   # disjoint tiles: independent
    ins = {"x": torch.randn(16, 4), "t0.w": torch.randn(4, 4), "t1.w": torch.randn(4, 4)}
    res = ThreadExecutor({"cube": 2, "vector": 2}).run(g, ins)
    torch.testing.assert_close(res["out"], ReferenceExecutor().run(g, ins)["out"])


def test_units_precede_and_succeed():
    g = TaskGraph("order")
    a = g.compose(block(), prefix="a.")
    b = g.compose(block(), prefix="b.")
    t = g.task("noop", name="last")
    a.precede(b)
    b.precede(t)
    assert {p.name for p in g["b.mm"].predecessors} == {"a.res", "a.mark"}
    assert {p.name for p in t.predecessors} == {"b.res", "b.mark"}
    first = g.task("noop", name="first")
    a.succeed(first)
    assert first in g["a.mm"].predecessors
    first.succeed(t)   # last -> first -> a -> b -> last
    with pytest.raises(GraphError, match="cycle"):
        g.validate()


@pytest.mark.parametrize("bind, needle", [
    ({"nope": "x"}, "buffer 'nope', which sub-graph 'block' does not have"),
    ({"x": "small"}, r"maps 'x' \(\(8, 4\) float32\) to small, which is \(2, 4\) float32"),
    ({"x": "half"}, r"which is \(8, 4\) bfloat16"),
    ({"x": "foreign"}, "not a buffer of graph 'host'"),
])
def test_bad_binds(bind, needle):
    g = TaskGraph("host")
    other = TaskGraph("other")
    named = {"x": g.input("x", (8, 4)), "small": g.input("small", (2, 4)),
             "half": g.input("half", (8, 4), "bfloat16"), "foreign": other.input("f", (8, 4))}
    with pytest.raises(GraphError, match=needle):
        g.compose(block(), prefix="p.", bind={k: named[v] for k, v in bind.items()})


def test_name_clashes_and_self_composition():
    g = TaskGraph("host")
    g.compose(block(), prefix="p.")
    with pytest.raises(GraphError, match="buffer 'p.x' already exists"):
        g.compose(block(), prefix="p.")
    with pytest.raises(GraphError, match="into itself"):
        g.compose(g)
    with pytest.raises(GraphError, match="no buffer 'zz'"):
        g.compose(block(), prefix="q.")["zz"]
