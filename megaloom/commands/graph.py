"""``megaloom graph dot GRAPH [-o OUT.dot]``: a graph (a saved file or a builder
``NAME[:key=value,...]``) as Graphviz DOT, tasks labelled and filled by engine kind."""
from __future__ import annotations

import argparse

from megaloom.commands import write_file
from megaloom.runtime.files import atomic_write, check_outputs


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("graph", help="export a task graph (file or builder NAME[:key=value,...]) as Graphviz DOT")
    verbs = p.add_subparsers(dest="verb", metavar="VERB", required=True)
    dot = verbs.add_parser("dot", help="write the graph as DOT: tasks labelled name/op, filled by engine kind")
    dot.add_argument("graph", metavar="GRAPH", help="a saved graph file, or a builder NAME[:key=value,...]")
    dot.add_argument("-o", "--output", default=None, metavar="OUT.dot", help="write here instead of stdout")
    dot.add_argument("--force", action="store_true", help="overwrite an existing file megaloom did not write")
    dot.set_defaults(func=run_dot)


def run_dot(args: argparse.Namespace) -> int:
    from megaloom.commands.simulate import resolve_graph

    check_outputs([args.output], [args.graph], args.force)
    text = resolve_graph(args.graph).to_dot()
    if args.output is None:
        print(text, end="")
        return 0
    write_file(lambda t, path: atomic_write(path, t.encode()), text, args.output)
    print(f"wrote DOT: {args.output}  (render: dot -Tsvg {args.output} -o graph.svg)")
    return 0
