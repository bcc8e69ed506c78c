"""``megaloom trace summary|convert|plot``: look into a saved megaloom trace (msgpack).

    megaloom trace summary run.mlt             # metrics table
    megaloom trace convert run.mlt -o run.json # Chrome / Perfetto JSON (https://ui.perfetto.dev)
    megaloom trace plot run.mlt -o run.png     # Gantt chart of engine units (needs megaloom[plot])
"""
from __future__ import annotations

import argparse
import os

from megaloom.commands import write_file
from megaloom.runtime.errors import TraceFormatError
from megaloom.runtime.files import check_outputs
from megaloom.runtime.metrics import summary
from megaloom.runtime.perfetto import write_chrome
from megaloom.runtime.plot import plot_gantt
from megaloom.runtime.trace import Trace


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("trace", help="summarise a saved trace, convert it to Perfetto JSON, or plot it")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    s = actions.add_parser("summary", help="print the metrics table of a trace")
    s.add_argument("trace", help="megaloom trace file (msgpack, e.g. run.mlt)")
    s.set_defaults(func=lambda args: print(summary(_load(args.trace))))
    c = actions.add_parser("convert", help="write Chrome Trace Event JSON that Perfetto opens")
    c.add_argument("trace", help="megaloom trace file (msgpack)")
    c.add_argument("-o", "--out", help="output JSON (default: the trace path with .json; -: standard output)")
    c.set_defaults(func=lambda args: _write(args, ".json", write_chrome, "; open it in https://ui.perfetto.dev"))
    g = actions.add_parser("plot", help="write a PNG Gantt chart of engine units over time")
    g.add_argument("trace", help="megaloom trace file (msgpack)")
    g.add_argument("-o", "--out", help="output PNG (default: the trace path with .png)")
    g.add_argument("--title", help="chart title (default: graph name, mode and task count)")
    g.set_defaults(func=lambda args: _write(args, ".png", plot_gantt, title=args.title))
    for verb in (c, g):
        verb.add_argument("--force", action="store_true", help="overwrite an existing file megaloom did not write")


def _load(path: str) -> Trace:
    """A megaloom trace; a profiler (JSON) trace is refused with the command that reads it."""
    try:
        return Trace.load(path)
    except TraceFormatError as e:
        try:
            with open(path, "rb") as f:
                head = f.read(64)
        except OSError:
            raise e from None  # the load's own error says why the file cannot be read
        if head[:2] == b"\x1f\x8b" or head.lstrip()[:1] in (b"{", b"["):
            raise TraceFormatError(f"{path}: a profiler (JSON) trace, not a megaloom trace: `megaloom replay {path}` "
                                   "imports it (import report, identity replay, what-ifs)") from None
        raise


def _write(args: argparse.Namespace, suffix: str, write, note: str = "", **kw) -> int:
    """``write(trace, out, **kw)`` to ``--out`` (default: the trace path with ``suffix``)."""
    out = args.out or os.path.splitext(args.trace)[0] + suffix
    check_outputs([out], [args.trace], args.force)
    trace = _load(args.trace)
    write_file(write, trace, out, **kw)
    print(f"wrote {out} ({len(trace.events)} tasks{note})")
    return 0

