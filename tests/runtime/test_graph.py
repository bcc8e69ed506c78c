"""Graph IR: dependencies derived from regions, control edges, region rules."""
import pytest

from megaloom.runtime import GraphError, TaskGraph


def edges(g: TaskGraph) -> set[tuple[str, str]]:
    return {(g.tasks[a].name, t.name) for t in g.tasks for a in g.pred[t.id]}


def test_raw_war_waw_on_overlapping_tiles():
    g = TaskGraph()
    x = g.input("x", (8, 4))
    h = g.buffer("h", (8, 4))
    y = g.output("y", (8, 4))
    g.task("copy", [x[0:4]], [h[0:4]], name="w_top")       # writes rows 0-3
    g.task("copy", [x[4:8]], [h[4:8]], name="w_bottom")    # writes rows 4-7, disjoint: no edge
    g.task("copy", [h[2:6]], [y[2:6]], name="r_mid")       # RAW on both writers (overlaps both)
    g.task("copy", [x[0:2]], [h[0:2]], name="w_again")     # WAR on r_mid? no: rows 0-1 not read by it; WAW on w_top
    g.task("copy", [x[4:6]], [h[4:6]], name="w_mid")       # WAR on r_mid (rows 4-5), WAW on w_bottom
    assert edges(g) == {
        ("w_top", "r_mid"), ("w_bottom", "r_mid"), ("w_top", "w_again"), ("r_mid", "w_mid"), ("w_bottom", "w_mid"),
    }


def test_in_out_task_orders_readers_and_writers():
    g = TaskGraph()
    x = g.inout("x", (4, 4))
    y = g.output("y", (4, 4))
    g.task("copy", [x], [y], name="read1")
    g.task("silu", [x], [x], name="inplace")     # reads and writes x: WAR after read1
    g.task("copy", [x], [y], name="read2")       # RAW on inplace, WAW on read1 (y)
    g.task("silu", [x], [x], name="inplace2")    # WAR on read2, WAW on inplace
    assert edges(g) == {("read1", "inplace"), ("inplace", "read2"), ("read1", "read2"),
                        ("read2", "inplace2"), ("inplace", "inplace2")}
    g.validate()


def test_covering_write_stands_for_earlier_accesses():
    # a reader after a full overwrite depends on the overwrite only (earlier writes are ordered before it)
    g = TaskGraph()
    x = g.input("x", (4, 4))
    h = g.buffer("h", (4, 4))
    y = g.output("y", (4, 4))
    g.task("copy", [x[0:2]], [h[0:2]], name="a")
    g.task("copy", [x], [h], name="full")
    g.task("copy", [h[0:2]], [y[0:2]], name="r")
    assert ("a", "r") not in edges(g) and ("full", "r") in edges(g) and ("a", "full") in edges(g)


def test_control_edges_chain_and_name_lookup():
    g = TaskGraph()
    a, b, c, d = (g.task("noop", name=n) for n in "abcd")
    assert a.precede(b, c) is a
    d.succeed(b, c)
    assert edges(g) == {("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")}
    assert [t.name for t in d.predecessors] == ["b", "c"] and g["a"] is a
    with pytest.raises(GraphError, match="no task 'zz'"):
        g["zz"]
    with pytest.raises(GraphError, match="'a' cannot wait for itself"):
        a.precede(a)


@pytest.mark.parametrize("make, match", [
    (lambda b: b[::2], "unit-step"),
    (lambda b: b[0:2, 0:2, 0:1], "too many indices"),
])
def test_bad_regions(make, match):
    g = TaskGraph()
    x = g.input("x", (8, 4))
    with pytest.raises(GraphError, match=match):
        g.task("copy", [make(x)], [x], name="t")


def test_region_of_wrong_rank_or_reversed_is_rejected():
    from megaloom.runtime import Region

    g = TaskGraph()
    x = g.input("x", (8, 4))
    assert x[0:99].box == ((0, 8), (0, 4))  # slices clamp, as in numpy
    for box in (((0, 8),), ((4, 2), (0, 4)), ((0, 9), (0, 4))):
        with pytest.raises(GraphError, match="outside buffer"):
            g.task("copy", [Region(x, box)], [x])


def test_duplicate_names_and_foreign_buffers():
    g, other = TaskGraph("g"), TaskGraph("other")
    x = g.input("x", (2,))
    with pytest.raises(GraphError, match="buffer 'x' already exists"):
        g.input("x", (2,))
    g.task("noop", name="t")
    with pytest.raises(GraphError, match="'t' is used twice"):
        g.task("noop", name="t")
    with pytest.raises(GraphError, match="another graph"):
        other.task("copy", [x], [x])


def test_split_tiles_and_summary():
    g = TaskGraph("s")
    x = g.input("x", (10, 4))
    tiles = x.split(0, 4)
    assert [t.box for t in tiles] == [((0, 4), (0, 4)), ((4, 8), (0, 4)), ((8, 10), (0, 4))]
    assert repr(tiles[2]) == "x[8:10, 0:4]" and repr(x.full) == "x"
    assert "0 tasks" in g.summary()


@pytest.mark.parametrize("build, needle", [
    (lambda g: g.task(["matmul"]), "op, name and engine must be strings"),
    (lambda g: g.task("noop", priority=float("nan")), "priority must be an integer"),
    (lambda g: g.task("noop", priority=2.7), "priority must be an integer"),
    (lambda g: g.input("x", (float("nan"), 2)), "dim 0 must be an integer"),
    (lambda g: g.input("x", (2.7, 2)), "dim 0 must be an integer"),
    (lambda g: g.input("x", "44"), "shape must be a sequence of integers"),
    (lambda g: g.input("x", 4), "shape must be a sequence of integers"),
    (lambda g: g.input("x", (4, 2)).split(5, 2), "cannot split x along dim 5: it has 2 dims"),
    (lambda g: g.input("x", (4, 2)).split(0, 1.5), "tile size of x must be an integer"),
    (lambda g: g.input("x", (4, 2))[0.5:2], "integer slice bounds"),
])
def test_bad_builder_inputs_are_graph_errors(build, needle):
    with pytest.raises(GraphError, match=needle):
        build(TaskGraph("bad"))


def test_numpy_integers_are_accepted_as_dims():
    import numpy as np

    g = TaskGraph()
    assert g.input("x", (np.int64(4), np.int32(2))).shape == (4, 2)


def test_a_refused_task_leaves_the_graph_as_it_was():
    g = TaskGraph("g")
    a = g.task("noop", name="a")
    with pytest.raises(GraphError, match="cost must be a Cost"):
        g.task("noop", cost=3, after=[a])
    assert len(g) == 1 and g.pred == [[]] and g.validate().validated


def test_views_of_one_task_compare_equal():
    g = TaskGraph("g")
    a = g.task("noop")
    b = g.task("noop", after=[a])
    assert g.tasks[0] == a and hash(g.tasks[0]) == hash(a) and g.tasks[1] != a and g.tasks == [a, b]
    assert g.task("noop") is g.tasks[2]  # once asked for, the views are kept and handed out


def test_the_command_line_and_light_modules_import_no_torch():
    import subprocess
    import sys

    code = ("import sys, megaloom.cli, megaloom.runtime.errors, megaloom.runtime.trace, megaloom.comm.stream; "
            "megaloom.cli.build_parser(); print(sorted(m for m in ('torch', 'megaloom.runtime.executors') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    assert out.stdout.strip() == "[]"
