"""``megaloom simulate``: simulate a graph on a hardware profile; print the summary,
write the trace (msgpack) and a Perfetto JSON.

The graph comes from a file (``GRAPH_FILE`` or ``--graph PATH``) or from a named builder
(``--graph NAME[:key=value,...]``) of :data:`megaloom.graphs.common.builder.GRAPH_BUILDERS`; one
with a ``world(**options)`` attribute builds every rank's graph for ``--world``.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable

from megaloom.commands import pairs, write_file
from megaloom.runtime.errors import ConfigError
from megaloom.runtime.files import check_outputs
from megaloom.runtime.metrics import summary
from megaloom.runtime.perfetto import write_chrome
from megaloom.runtime.plugins import parse_spec
from megaloom.runtime.trace import Trace


def resolve_graph(spec: str, world: bool = False) -> Any:
    """A graph from a file path, or from a named builder with options; ``world``: every rank's graph from the
    builder's ``world(**options)`` hook (MegaMoE's). Options a builder does not take are a ConfigError."""
    from megaloom.graphs.common.builder import GRAPH_BUILDERS as builders
    from megaloom.runtime.graph import TaskGraph

    if os.path.exists(spec) and not world:
        return TaskGraph.load(spec)
    name, opts = parse_spec(spec)
    if name not in builders:
        known = ", ".join(builders.names()) or "none registered"
        raise ConfigError(f"graph {spec!r} is neither a file nor a known graph builder (builders: {known})")
    builder = getattr(builders.get(name), "world", None) if world else builders.get(name)
    if builder is None:
        raise ConfigError(f"--world needs a graph builder with a world hook (a world method), got {spec!r}")
    try:
        return builder(**opts)
    except TypeError as e:
        raise ConfigError(f"graph builder {name!r}: bad options {opts}: {e}") from None


def progress_bar(width: int = 30) -> Callable[[int, int], None]:
    """A ``progress(done, total)`` callback drawing a one-line bar on stderr."""
    def draw(done: int, total: int) -> None:
        frac = done / total if total else 1.0
        fill = int(frac * width)
        sys.stderr.write(f"\rsimulating [{'#' * fill}{'.' * (width - fill)}] {frac * 100:5.1f}% {done}/{total} tasks")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()
    return draw


def add_common(p: argparse.ArgumentParser) -> None:
    """Options shared by ``simulate`` and ``replay``."""
    p.add_argument("--policy", default=None, help="ordering policy NAME[:key=value,...], e.g. expert_interleave:group_size=2")
    p.add_argument("--units", default=None, help="unit counts overriding the profile, e.g. cube=24,vector=48,comm=4")
    p.add_argument("--trace", default=None, metavar="OUT.mlt", help="write the simulated trace (msgpack)")
    p.add_argument("--perfetto", default=None, metavar="OUT.json", help="write a Chrome/Perfetto trace JSON")
    p.add_argument("--force", action="store_true", help="overwrite existing files megaloom did not write")


def policy_and_units(args: argparse.Namespace):
    from megaloom.scheduler import make_policy, parse_units

    name, opts = parse_spec(args.policy) if args.policy else (None, {})
    return (make_policy(name, **opts) if name else None), (parse_units(args.units) if args.units else None)


def check_units(units: dict[str, int] | None, engines) -> None:
    """``--units`` may name the standard engine kinds and those the tasks use; anything else is a typo."""
    from megaloom.runtime.registry import ENGINE_KINDS

    known = dict.fromkeys([*ENGINE_KINDS, *engines])
    bad = [e for e in units or () if e not in known]
    if bad:
        raise ConfigError(f"--units names unknown engine(s) {', '.join(bad)}; known: {', '.join(known)}")


def write_outputs(trace, args: argparse.Namespace) -> None:
    if args.trace:
        write_file(Trace.save, trace, args.trace)
        print(f"wrote trace: {args.trace}")
    if args.perfetto:
        write_file(write_chrome, trace, args.perfetto)
        print(f"wrote Perfetto trace: {args.perfetto}  (open in https://ui.perfetto.dev)")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simulate", help="simulate a task graph on a hardware profile")
    p.add_argument("graph_file", nargs="?", default=None, metavar="GRAPH_FILE", help="a saved graph (msgpack)")
    p.add_argument("--graph", default=None, metavar="SPEC", help="a graph file, or a builder NAME[:key=value,...]")
    p.add_argument("--profile", default="ascend-910b", help="hardware profile name or YAML path (default: ascend-910b)")
    add_common(p)
    p.add_argument("--world", action="store_true",
                   help="simulate every rank of a builder with a world hook (e.g. megamoe:...,ep=N), collectives synchronised")
    p.add_argument("--slowdown", action="append", metavar="RANK=FACTOR,...",
                   help="with --world: multiply every duration of these ranks, e.g. 3=1.5")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="always (--progress) or never (--no-progress) show a progress bar (default: on a terminal, "
                        "for 100,000 tasks or more)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from megaloom.scheduler import Simulator

    if (args.graph_file is None) == (args.graph is None):
        raise ConfigError("give exactly one graph: GRAPH_FILE or --graph SPEC")
    check_outputs([args.trace, args.perfetto], [args.graph_file or args.graph], args.force)
    if args.world or args.slowdown:
        return run_world(args)
    graph = resolve_graph(args.graph_file or args.graph)
    policy, units = policy_and_units(args)
    check_units(units, graph.engines())
    show = args.progress if args.progress is not None else (sys.stderr.isatty() and len(graph) >= 100_000)
    result = Simulator(args.profile, units, policy, progress=progress_bar() if show else None).run(graph)
    print(summary(result.trace))
    write_outputs(result.trace, args)
    return 0


def run_world(args: argparse.Namespace) -> int:
    from megaloom.scheduler.world import simulate_world, world_summary

    if not args.world or args.graph is None:
        raise ConfigError("--world takes --graph NAME[:key=value,...] of a builder with a world hook; --slowdown needs --world")
    slowdown = pairs(args.slowdown, "--slowdown", int)
    policy, units = policy_and_units(args)
    graphs = resolve_graph(args.graph, world=True)
    check_units(units, [e for g in graphs for e in g.engines()])
    result = simulate_world(graphs, args.profile, units, policy, slowdown=slowdown)
    print(world_summary(result.trace))
    write_outputs(result.trace, args)
    return 0
