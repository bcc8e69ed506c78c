"""``megaloom ops / graphs / policies``: every registered entry on one line with its description."""
from megaloom.cli import main
from megaloom.graphs.common import builder as graph_builders
from megaloom.runtime.plugins import Registry, describe
from megaloom.runtime.registry import Cost, OpDef, all_ops, register
from megaloom.scheduler.policies import POLICIES


def _lines(capsys, command: str) -> dict[str, str]:
    assert main([command]) == 0
    out = capsys.readouterr().out.splitlines()
    table = {line.split()[0]: line for line in out}
    assert len(table) == len(out), "one line per entry"
    return table


def test_ops_lists_every_op_with_engines_and_doc(capsys):
    register(OpDef("test_listed", ("cube", "vector"), lambda x: x, lambda i, a: list(i), lambda i, o, a: Cost(),
                   doc="a test op\n  listed on one line"), replace=True)
    table = _lines(capsys, "ops")
    assert set(table) == set(all_ops())
    assert table["test_listed"].split() == ["test_listed", "cube/vector", "a", "test", "op", "listed", "on", "one",
                                            "line"]
    assert table["matmul"].split()[1] == "cube" and "a @ b" in table["matmul"]
    assert table["all_to_all"].split()[1] == "comm"


def test_graphs_lists_builders_by_their_module_description(capsys, monkeypatch):
    table = _lines(capsys, "graphs")
    assert {"megamoe", "megagate", "megamhc"} <= set(table)
    assert "MegaMoE forward and backward task graphs" in table["megamoe"]
    assert "MegaGate: the MoE router as forward and backward task graphs" in table["megagate"]
    monkeypatch.setattr(graph_builders, "GRAPH_BUILDERS", Registry("graph builder"))

    class Builder:
        """A graph of my own.

        Details that stay off the listing."""

        def __call__(self):
            raise AssertionError("listing never builds")

    graph_builders.register_graph_builder("mine", Builder())
    assert _lines(capsys, "graphs") == {"mine": "mine  A graph of my own."}


def test_policies_lists_each_policy(capsys):
    table = _lines(capsys, "policies")
    assert set(table) == set(POLICIES.names()) == {"fifo", "priority", "critical_path", "static",
                                                  "expert_interleave", "rotated"}
    assert table["fifo"].split(None, 1)[1] == describe(POLICIES.get("fifo"))
    assert "became ready" in table["fifo"] and "longest remaining path" in table["critical_path"]


def test_describe_uses_doc_text_then_module_then_docstring():
    assert describe(OpDef("x", ("vector",), None, None, None, doc="")) == ""  # never OpDef's own docstring

    def builder():
        """Builds nothing."""

    assert describe(builder) == "megaloom ops / graphs / policies: every registered entry on one line with its description."
    assert describe(Registry) == "Named T objects of one kind (what: \"op\", \"policy\", ...)."
