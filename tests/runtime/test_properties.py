"""Property tests on random DAGs of real tiny ops (matmul, add, mul, silu, copy on small tiles).

A drawn graph reads only regions that are graph inputs or already fully written, writes
overlapping tiles (offsets in half-tile steps), in place and over earlier results, so
every hazard kind (RAW, WAR, WAW) shows up; some tasks also get extra control edges. Rows
of the output no task wrote are filled last, since an output must be written in full.
"""
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megaloom.runtime import ReferenceExecutor, TaskGraph, ThreadExecutor, Trace, metrics
from megaloom.runtime.serialize import graph_to_dict

T = 4          # tile rows and columns
SLOTS = 6      # tile-sized row slots in each scratch buffer
ROWS = T * SLOTS


@st.composite
def graphs(draw) -> tuple[TaskGraph, dict[str, torch.Tensor]]:
    g = TaskGraph("random")
    x = g.input("x", (ROWS, T))
    w = g.input("w", (T, T))
    acc = g.inout("acc", (ROWS, T))     # fully readable from the start
    out = g.output("out", (ROWS, T))    # readable where written
    written = [False] * ROWS            # rows of ``out`` written so far
    n = draw(st.integers(1, 24))
    for i in range(n):
        def tile(buf, readable_only: bool):
            starts = range(0, ROWS - T + 1, T // 2)
            if readable_only and buf is out:
                starts = [s for s in starts if all(written[s:s + T])]
            if not starts:
                return None
            s = draw(st.sampled_from(list(starts)))
            return buf[s:s + T]

        def source():
            buf = draw(st.sampled_from([x, acc, out]))
            return tile(buf, True) or tile(x, True)

        op = draw(st.sampled_from(["matmul", "add", "mul", "silu", "copy"]))
        ins = [source(), w] if op == "matmul" else [source(), source()] if op in ("add", "mul") else [source()]
        if op != "matmul" and draw(st.booleans()):
            dst = ins[0] if ins[0].buffer is not x else tile(draw(st.sampled_from([acc, out])), False)
        else:
            dst = tile(draw(st.sampled_from([acc, out])), False)
        engine = "comm" if op == "copy" and draw(st.booleans()) else None
        t = g.task(op, ins, [dst], name=f"t{i}", engine=engine, tags={"i": i})
        if dst.buffer is out:
            for r in range(dst.box[0][0], dst.box[0][1]):
                written[r] = True
        if i and draw(st.integers(0, 4)) == 0:   # a control edge to an earlier task
            g.tasks[draw(st.integers(0, i - 1))].precede(t)
    for s in range(0, ROWS, T):  # an output is written in full (validate() checks it)
        if not all(written[s:s + T]):
            g.task("copy", [x[s:s + T]], [out[s:s + T]], name=f"fill{s}")
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    inputs = {"x": torch.rand(ROWS, T, generator=gen), "w": torch.rand(T, T, generator=gen) / T,
              "acc": torch.rand(ROWS, T, generator=gen)}
    return g, inputs


def written_rows(g: TaskGraph) -> list[int]:
    rows = set()
    for t in g.tasks:
        for r in t.outputs:
            if r.buffer.name == "out":
                rows.update(range(*r.box[0]))
    return sorted(rows)


SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(graphs(), st.sampled_from([{"cube": 1, "vector": 1, "comm": 1}, {"cube": 2, "vector": 3, "comm": 1}]))
def test_thread_executor_equals_reference(case, units):
    g, inputs = case
    g.validate()
    want = ReferenceExecutor().run(g, inputs)
    rows = written_rows(g)
    same_fn = ThreadExecutor(units, kernels="reference").run(g, inputs)   # the same torch functions: bit-exact
    kernels = ThreadExecutor(units, kernels="kernel").run(g, inputs)      # out= kernels: allclose
    assert torch.equal(same_fn["acc"], want["acc"])
    assert torch.equal(same_fn["out"][rows], want["out"][rows])
    torch.testing.assert_close(kernels["acc"], want["acc"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(kernels["out"][rows], want["out"][rows], rtol=1e-5, atol=1e-6)
    end = {e.task_id: e.end for e in kernels.trace.events}
    for e in kernels.trace.events:
        assert all(end[d] <= e.start for d in e.deps)
        assert e.unit < units[e.engine]
    m = metrics(kernels.trace)
    assert 0 <= m.comm_hidden <= 1 and all(0 < u <= 1 + 1e-9 for u in m.utilisation.values())
    assert 0 < m.critical_path <= m.makespan + 1e-9 and m.tasks == len(g)


@SETTINGS
@given(graphs())
def test_graph_and_trace_round_trips_are_lossless(tmp_path_factory, case):
    g, inputs = case
    d = tmp_path_factory.mktemp("rt")
    g.save(d / "g.mlg")
    h = TaskGraph.load(d / "g.mlg")
    assert graph_to_dict(h) == graph_to_dict(g) and h.succ == g.succ
    assert graph_to_dict(TaskGraph.from_dict(graph_to_dict(g))) == graph_to_dict(g)
    trace = ThreadExecutor({"cube": 1, "vector": 2, "comm": 1}).run(h, inputs).trace
    trace.save(d / "t.mlt")
    back = Trace.load(d / "t.mlt")
    assert back.events == trace.events and back.meta == trace.meta


@SETTINGS
@given(graphs())
def test_every_hazard_is_ordered(case):
    """Two tasks touching overlapping regions, at least one writing, are ordered as added."""
    from megaloom.runtime.region import overlaps

    g, _ = case
    acc = [[(r.buffer.name, r.box, False) for r in t.inputs] + [(r.buffer.name, r.box, True) for r in t.outputs]
           for t in g.tasks]
    for j in range(len(g)):
        for i in range(j):
            if any(bi == bj and (wi or wj) and overlaps(xi, xj) for bi, xi, wi in acc[i] for bj, xj, wj in acc[j]):
                assert g.reaches(i, j), (g.tasks[i].name, g.tasks[j].name)


boxes = st.lists(st.tuples(st.integers(0, 12), st.integers(0, 6), st.integers(0, 4), st.integers(0, 3)),
                 max_size=25).map(lambda xs: [((a, a + n), (b, b + m)) for a, n, b, m in xs])


@settings(max_examples=60, deadline=None)
@given(boxes, boxes)
def test_box_index_matches_brute_force(added, queries):
    from megaloom.runtime.region import BoxIndex, overlaps

    index = BoxIndex()
    for box in added:
        index.add(box)
    for q in queries:
        assert sorted(index.overlapping(q)) == sorted(b for b in added if overlaps(b, q))
