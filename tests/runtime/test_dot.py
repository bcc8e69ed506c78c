"""DOT export: the text parses as Graphviz DOT and holds every task, edge and engine colour."""
import pydot
import pytest

import megaloom.ops  # noqa: F401  (registers the built-in ops)
from megaloom.cli import main
from megaloom.runtime import Cost, TaskGraph
from megaloom.runtime.dot import ENGINE_COLOURS

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:pydot")  # pydot's own pyparsing calls


def _unquote(s: str) -> str:
    return s[1:-1].replace('\\"', '"').replace("\\\\", "\\") if s.startswith('"') else s


def parse(text: str):
    """(graph name, {node id: attrs}, [(a, b)], {legend engine: colour}) of DOT text."""
    (d,) = pydot.graph_from_dot_data(text)
    nodes = {n.get_name(): {k: _unquote(v) for k, v in n.get_attributes().items()}
             for n in d.get_nodes() if n.get_name() not in ("node", "edge", "graph")}
    edges = [(e.get_source(), e.get_destination()) for e in d.get_edges()]
    (legend,) = d.get_subgraphs()
    colours = {_unquote(n.get_name()).removeprefix("engine:"): _unquote(n.get_attributes()["fillcolor"])
               for n in legend.get_nodes() if n.get_name() not in ("node", "edge", "graph")}
    return _unquote(d.get_name()), nodes, edges, colours


def _graph() -> TaskGraph:
    g = TaskGraph('odd "name"\\x')
    x, y = g.input("x", (8, 8)), g.output("y", (8, 8))
    h = g.buffer("h", (8, 8))
    a = g.task("matmul", [x, x], [h], name="mm")
    b = g.task("silu", [h], [y], name='act "1"')
    c = g.task("noop", name="ship", engine="comm", cost=Cost())
    d = g.task("noop", name="host work", engine="host", cost=Cost())
    e = g.task("noop", name="dsp", engine="dsp", cost=Cost())
    c.succeed(b).precede(d, e)
    a.precede(e)
    return g


def test_to_dot_has_every_task_edge_and_engine_colour():
    g = _graph()
    name, nodes, edges, colours = parse(g.to_dot())
    assert name == g.name
    assert set(nodes) == {f"t{t.id}" for t in g.tasks}
    for t in g.tasks:
        attrs = nodes[f"t{t.id}"]
        assert attrs["label"] == f"{t.name}\\n{t.op}" and attrs["tooltip"] == t.engine
        assert attrs["fillcolor"] == colours[t.engine]
    assert sorted(edges) == sorted((f"t{a}", f"t{b}") for b, ps in enumerate(g.pred) for a in ps)
    assert ("t0", "t1") in edges and ("t0", "t4") in edges  # a derived edge and a control edge
    assert list(colours) == ["cube", "vector", "comm", "host", "dsp"]
    assert {k: colours[k] for k in ENGINE_COLOURS} == ENGINE_COLOURS
    assert len(set(colours.values())) == len(colours)  # every kind tells apart


def test_megaloom_graph_dot_from_builder_and_file(tmp_path, capsys):
    spec = "megagate:tokens=16,hidden=8,experts=4,top_k=2,tile_tokens=8"
    assert main(["graph", "dot", spec]) == 0
    name, nodes, edges, colours = parse(capsys.readouterr().out)
    assert name == "megagate_fwd" and len(nodes) == 4 and len(edges) == 2 and set(colours) == {"cube", "vector"}
    assert {n["label"].split("\\n")[1] for n in nodes.values()} == {"proj", "gate_topk"}
    g = _graph()
    g.save(tmp_path / "g.mlg")
    out = tmp_path / "g.dot"
    assert main(["graph", "dot", str(tmp_path / "g.mlg"), "-o", str(out)]) == 0
    assert "wrote DOT" in capsys.readouterr().out
    assert out.read_text() == g.to_dot()


@pytest.mark.parametrize("args, needle", [
    (["graph", "dot", "nosuch"], "neither a file nor a known graph builder"),
    (["graph", "dot", "megagate:tokens=16,hidden=8,experts=4,top_k=2", "-o", "/nonexistent/dir/g.dot"], "cannot write"),
])
def test_megaloom_graph_dot_errors(capsys, args, needle):
    assert main(args) == 2
    assert needle in capsys.readouterr().err
