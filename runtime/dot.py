"""A task graph as Graphviz DOT text: one box per task (its name and op), filled with its
engine kind's colour, one arrow per edge, and a legend of the engine kinds.

    dot -Tsvg graph.dot -o graph.svg      # or paste the text into any Graphviz viewer
"""
from __future__ import annotations

from itertools import cycle
from typing import TYPE_CHECKING

from megaloom.runtime.registry import COMM, CUBE, HOST, VECTOR

if TYPE_CHECKING:
    from megaloom.runtime.graph import TaskGraph

ENGINE_COLOURS = {CUBE: "#f4a261", VECTOR: "#8ecae6", COMM: "#90be6d", HOST: "#d9d9d9"}
"""Fill colour of each standard engine kind; other kinds take :data:`OTHER_COLOURS` in turn."""
OTHER_COLOURS = ("#e9c46a", "#cdb4db", "#ffafcc", "#a8dadc", "#b5838d", "#caffbf")


def quote(text: str) -> str:
    """``text`` as a DOT double-quoted string."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def engine_colours(engines: list[str]) -> dict[str, str]:
    """A fill colour per engine kind (first use order); unknown kinds cycle through the spare ones."""
    spare = cycle(OTHER_COLOURS)
    return {e: ENGINE_COLOURS.get(e) or next(spare) for e in engines}


def to_dot(graph: TaskGraph) -> str:
    """The graph as DOT: node ``t<id>`` per task labelled ``name\\nop``, filled by engine kind."""
    colours = engine_colours(graph.engines())
    lines = ["// written by megaloom", f"digraph {quote(graph.name)} {{",
             "  rankdir=TB;",
             '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10];',
             "  subgraph cluster_legend {",
             '    label="engine kinds"; fontname="Helvetica"; fontsize=10;']
    lines += [f"    {quote('engine:' + e)} [label={quote(e)}, fillcolor={quote(c)}];" for e, c in colours.items()]
    lines.append("  }")
    for t in graph.tasks:
        label = f"{t.name}\n{t.op}"
        lines.append(f"  t{t.id} [label={quote(label)}, fillcolor={quote(colours[t.engine])}, "
                     f"tooltip={quote(t.engine)}];")
    lines += [f"  t{a} -> t{b};" for b, preds in enumerate(graph.pred) for a in preds]
    return "\n".join(lines) + "\n}\n"
