"""TaskGraph.validate: each rule raises GraphError naming the tasks and buffers involved."""
import pytest

from megaloom.runtime import Core, GraphError, Region, ScheduleError, TaskGraph


def raises(g: TaskGraph, *needles: str) -> GraphError:
    with pytest.raises(GraphError) as info:
        g.validate()
    for n in needles:
        assert n in str(info.value), (n, str(info.value))
    return info.value


def test_valid_graph_passes_and_is_cached():
    g = TaskGraph()
    x, w = g.input("x", (4, 3)), g.input("w", (3, 2))
    y = g.output("y", (4, 2))
    g.task("matmul", [x, w], [y])
    assert g.validate() is g and g.validate() is g


def test_cycle_path_is_printed_and_carried():
    g = TaskGraph("cyc")
    a, b, c = (g.task("noop", name=n) for n in "abc")
    a.precede(b)
    b.precede(c)
    c.precede(a)
    e = raises(g, "rule 'cycle'", "->")
    assert set(e.cycle) == {"a", "b", "c"} and e.cycle[0] == e.cycle[-1] and len(e.cycle) == 4


def test_unknown_op_and_wrong_engine():
    g = TaskGraph()
    x = g.input("x", (2, 2))
    g.task("frobnicate", [x], [], name="f")
    assert raises(g, "unknown op 'frobnicate'", "'f'").tasks == ("f",)
    g = TaskGraph()
    x, y = g.input("x", (2, 2)), g.output("y", (2, 2))
    g.task("silu", [x], [y], name="s", engine="cube")
    assert raises(g, "'s'", "op 'silu' runs on vector, not 'cube'").tasks == ("s",)


@pytest.mark.parametrize("out_shape, out_dtype, needle", [
    ((4, 3), "float32", "is (4, 3) float32, op 'matmul' makes (4, 2) float32"),
    ((4, 2), "bfloat16", "is (4, 2) bfloat16, op 'matmul' makes (4, 2) float32"),
])
def test_shape_and_dtype_mismatch(out_shape, out_dtype, needle):
    g = TaskGraph()
    x, w = g.input("x", (4, 3)), g.input("w", (3, 2))
    y = g.output("y", out_shape, out_dtype)
    g.task("matmul", [x, w], [y], name="mm")
    assert raises(g, "'mm'", needle).tasks == ("mm",)


def test_wrong_arity_is_a_shape_problem_not_a_crash():
    g = TaskGraph()
    x, y = g.input("x", (2,)), g.output("y", (2,))
    g.task("add", [x], [y], name="half_add")
    g.task("mul", [], [y], name="no_args")
    e = raises(g, "'half_add'", "expects 2 inputs, got 1", "'no_args'")
    assert e.tasks == ("half_add", "no_args")


def test_read_of_unwritten_region_names_task_and_region():
    g = TaskGraph()
    x = g.input("x", (8, 2))
    h = g.buffer("h", (8, 2))
    y = g.output("y", (8, 2))
    g.task("copy", [x[0:4]], [h[0:4]], name="fill_top")
    g.task("copy", [h[2:6]], [y[2:6]], name="reader")     # rows 4-5 of h never written
    raises(g, "'reader' reads h[2:6, 0:2]", "h[4:6, 0:2]", "not a graph input")
    g2 = TaskGraph()
    y2 = g2.output("y", (2,))
    g2.task("silu", [y2], [y2], name="self_read")         # its own write does not count
    raises(g2, "'self_read' reads y")


def test_write_after_the_read_does_not_count():
    g = TaskGraph()
    x, h, y = g.input("x", (2,)), g.buffer("h", (2,)), g.output("y", (2,))
    g.task("copy", [h], [y], name="early")
    g.task("copy", [x], [h], name="late")
    raises(g, "'early' reads h")


def test_two_unordered_writes_from_explicit_edges():
    # derived edges always order writers; a graph of explicit edges only (as loaded from a file) may not
    from megaloom.runtime.serialize import graph_to_dict

    g = TaskGraph("w")
    x, y = g.input("x", (4,)), g.output("y", (4,))
    g.task("copy", [x], [y], name="w1")
    g.task("copy", [x[0:2]], [y[0:2]], name="w2")
    d = graph_to_dict(g)
    d["pred"] = [[], []]
    e = raises(TaskGraph.from_dict(d), "'w1' and 'w2' both write buffer 'y'")
    assert e.tasks == ("w1",)
    d["pred"] = [[], [0]]
    TaskGraph.from_dict(d).validate()


def test_engine_without_units_is_a_schedule_error():
    g = TaskGraph()
    x, w, y = g.input("x", (2, 2)), g.input("w", (2, 2)), g.output("y", (2, 2))
    g.task("matmul", [x, w], [y])
    with pytest.raises(ScheduleError, match="cube"):
        Core(g, {"vector": 1})


def test_core_misuse_names_the_task():
    g = TaskGraph()
    a, b = g.task("noop", name="first"), g.task("noop", name="second")
    a.precede(b)
    core = Core(g, {"vector": 1})
    with pytest.raises(ScheduleError, match="'second', which is not handed out"):
        core.done(b.id)
    assert core.pop("vector") == a.id and core.pop("vector") == -1
    assert core.blocked() == {"first": ["(running)"], "second": ["first"]}
    core.done(a.id)
    with pytest.raises(ScheduleError, match="'first', which is already done"):
        core.done(a.id)
    assert core.blocked() == {"second": ["(ready, no unit took it)"]}
    assert core.pop("vector") == b.id
    core.done(b.id)
    assert not core.is_active


def test_region_dataclass_is_hashable_and_compares_by_box():
    g = TaskGraph()
    x = g.input("x", (4,))
    assert x[0:2] == Region(x, ((0, 2),)) and len({x[0:2], x[0:2], x[2:4]}) == 2


def test_later_writer_cannot_be_ordered_before_the_reader():
    g = TaskGraph()
    x, h, y = g.input("x", (2,)), g.buffer("h", (2,)), g.output("y", (2,))
    reader = g.task("copy", [h], [y], name="reader")
    g.task("copy", [x], [h], name="writer").precede(reader)   # against the derived WAR edge
    assert raises(g, "reader -> writer -> reader").cycle == ("reader", "writer", "reader")


def test_loaded_graph_without_the_raw_edge_reads_unwritten_data():
    from megaloom.runtime.serialize import graph_to_dict

    g = TaskGraph("lost")
    x, h, y = g.input("x", (2,)), g.buffer("h", (2,)), g.output("y", (2,))
    g.task("copy", [x], [h], name="writer")
    g.task("copy", [h], [y], name="reader")
    d = graph_to_dict(g)
    TaskGraph.from_dict(d).validate()
    d["pred"] = [[], []]
    raises(TaskGraph.from_dict(d), "'reader' reads h, but no task ordered before it writes h")


def test_long_accumulation_chains_validate_fast():
    import time

    g = TaskGraph()
    x, acc = g.input("x", (4, 4)), g.output("acc", (4, 4))
    g.task("copy", [x], [acc])
    for _ in range(2000):
        g.task("add", [acc, x], [acc])
    t0 = time.perf_counter()
    g.validate()
    assert time.perf_counter() - t0 < 10.0   # was minutes when every pair of writers was compared


def test_output_not_written_in_full_is_refused_before_any_run():
    import torch

    from megaloom.runtime import ReferenceExecutor, ThreadExecutor

    g = TaskGraph("half")
    x, y = g.input("x", (8, 2)), g.output("y", (8, 2))
    g.task("copy", [x[0:4]], [y[0:4]], name="top")  # rows 4-7 of y: uninitialised memory
    e = raises(g, "rule 'unwritten output'", "output 'y': no task writes y[4:8, 0:2]", "uninitialised")
    assert e.tasks == ()
    for ex in (ThreadExecutor(), ReferenceExecutor()):
        with pytest.raises(GraphError, match="no task writes y"):
            ex.run(g, {"x": torch.ones(8, 2)})
    g.task("copy", [x[4:8]], [y[4:8]], name="bottom")  # written in full: no zeroing needed
    for ex in (ThreadExecutor(), ReferenceExecutor()):
        assert torch.equal(ex.run(g, {"x": torch.ones(8, 2)})["y"], torch.ones(8, 2))


def test_column_tiles_in_any_order_cover_an_output():
    g = TaskGraph("cols")
    x, y = g.input("x", (4, 64)), g.output("y", (4, 64))
    for a in [5, 3, 0, 7, 1, 6, 2, 4]:
        g.task("copy", [x[:, a * 8:(a + 1) * 8]], [y[:, a * 8:(a + 1) * 8]])
    g.validate()
    g2 = TaskGraph("inout")
    z = g2.inout("z", (4,))
    g2.task("silu", [z[0:2]], [z[0:2]])  # an in-out buffer starts with the caller's data
    g2.validate()
