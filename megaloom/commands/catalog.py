"""``megaloom ops``, ``megaloom graphs``, ``megaloom policies``: what is registered, plug-ins
included, one line each with a short description."""
from __future__ import annotations

import argparse

LISTS = {
    "ops": "list the registered ops: engine kinds and what each computes",
    "graphs": "list the graph builders that `megaloom simulate --graph NAME[:key=value,...]` knows",
    "policies": "list the ordering policies that `--policy NAME[:key=value,...]` knows",
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    for name, text in LISTS.items():
        sub.add_parser(name, help=text, description=text).set_defaults(func=run)


def rows(what: str) -> list[tuple[str, ...]]:
    """``(name, [engines,] description)`` of every entry of the list ``what``, by name."""
    from megaloom.runtime.plugins import describe

    if what == "ops":
        from megaloom.runtime.registry import OPS

        return [(name, "/".join(op.engines), describe(op)) for name, op in sorted(OPS.items().items())]
    if what == "graphs":
        from megaloom.graphs.common.builder import GRAPH_BUILDERS as registry
    else:
        from megaloom.scheduler.policies import POLICIES as registry
    return list(registry.describe().items())


def run(args: argparse.Namespace) -> int:
    table = rows(args.command)
    widths = [max((len(r[i]) for r in table), default=0) for i in range(len(table[0]) - 1)] if table else []
    for r in table:
        print("  ".join(f"{c:<{w}}" for c, w in zip(r, widths)) + "  " + r[-1])
    return 0
