"""``megaloom collect``: receive ranks' streamed trace events; write a merged trace and Perfetto JSON."""
from __future__ import annotations

import argparse

from megaloom.commands import require_positive, write_file
from megaloom.comm.stream import MAX_MESSAGE, Collector
from megaloom.runtime.trace import Trace
from megaloom.runtime.perfetto import write_chrome
from megaloom.runtime.metrics import summary


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("collect", help="collect trace events streamed by ranks (ZeroMQ PULL) into one trace")
    p.add_argument("--bind", default="tcp://127.0.0.1:5557", help="endpoint to bind (default: tcp://127.0.0.1:5557)")
    p.add_argument("--ranks", type=int, default=None, help="stop once this many ranks have finished (default: wait for --idle or --duration)")
    p.add_argument("--idle", type=float, default=30.0, help="stop after this many seconds without a message (default 30)")
    p.add_argument("--duration", type=float, default=None, help="stop after this many seconds in all (default: no limit)")
    p.add_argument("--max-message", type=int, default=MAX_MESSAGE, help=f"drop messages larger than this (bytes; default {MAX_MESSAGE})")
    p.add_argument("--out", default="trace.mlt", help="merged msgpack trace (default: trace.mlt)")
    p.add_argument("--perfetto", default=None, help="also write Chrome/Perfetto JSON here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    require_positive(args, "ranks", "idle", "duration", "max_message")
    col = Collector(args.bind, max_message=args.max_message)
    print(f"collecting on {col.endpoint}", flush=True)
    try:
        trace = col.run(args.ranks, idle=args.idle, duration=args.duration)
    finally:
        col.close()
    write_file(Trace.save, trace, args.out)
    if args.perfetto:
        write_file(write_chrome, trace, args.perfetto)
    s = col.stats
    print(f"{s.events} events from ranks {sorted(s.ranks)} (finished {sorted(s.finished)}); "
          f"dropped {s.malformed} malformed, {s.oversized} oversized messages")
    if trace.events:
        print(summary(trace))
    return 0
