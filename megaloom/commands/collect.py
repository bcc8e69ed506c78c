"""``megaloom collect``: receive ranks' streamed trace events; write a merged trace and Perfetto JSON.

The trace is written (atomically) when collection ends, every ``--save-every`` seconds while
it runs, and when the collector is stopped by SIGINT or SIGTERM (then the exit code is the
shell's 128 + signal number), so a stopped collection keeps what it received. What a sender
gets wrong is dropped and counted, never failing the save. With ``--key FILE`` (created if
absent; give ``megaloom launch --trace-key`` the same file) only the launched ranks count.
"""
from __future__ import annotations

import argparse
import contextlib
import signal

from megaloom.commands import require_positive, stop_signals, write_file
from megaloom.comm.stream import MAX_BYTES, MAX_EVENTS, MAX_MESSAGE, Collector, read_key
from megaloom.runtime.files import check_outputs
from megaloom.runtime.trace import Trace
from megaloom.runtime.perfetto import write_chrome
from megaloom.runtime.metrics import summary


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("collect", help="collect trace events streamed by ranks (ZeroMQ PULL) into one trace")
    p.add_argument("--bind", default="tcp://127.0.0.1:5557", help="endpoint to bind (default: tcp://127.0.0.1:5557)")
    p.add_argument("--ranks", type=int, default=None,
                   help="stop once ranks 0..N-1 have finished, refuse others (default: wait for --idle or --duration)")
    p.add_argument("--idle", type=float, default=30.0, help="stop after this many seconds without a message (default 30)")
    p.add_argument("--duration", type=float, default=None, help="stop after this many seconds in all (default: no limit)")
    p.add_argument("--max-message", type=int, default=MAX_MESSAGE, help=f"refuse messages larger than this (bytes; default {MAX_MESSAGE})")
    p.add_argument("--max-events", type=int, default=MAX_EVENTS, help=f"keep at most this many events (default {MAX_EVENTS})")
    p.add_argument("--max-bytes", type=int, default=MAX_BYTES,
                   help=f"keep events of at most this many message bytes (default {MAX_BYTES})")
    p.add_argument("--key", metavar="FILE",
                   help="accept only ranks started by `megaloom launch --trace-key FILE` (created if absent)")
    p.add_argument("--save-every", type=float, default=30.0, help="write the trace so far every this many seconds (default 30)")
    p.add_argument("--out", default="trace.mlt", help="merged msgpack trace (default: trace.mlt)")
    p.add_argument("--perfetto", default=None, help="also write Chrome/Perfetto JSON here")
    p.add_argument("--force", action="store_true", help="overwrite existing files megaloom did not write")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    require_positive(args, "ranks", "idle", "duration", "max_message", "max_events", "max_bytes", "save_every")
    check_outputs([args.out, args.perfetto], (), args.force)
    col = Collector(args.bind, max_message=args.max_message, max_events=args.max_events, max_bytes=args.max_bytes,
                    key=read_key(args.key, create=True) if args.key else None, ranks=args.ranks)
    print(f"collecting on {col.endpoint}", flush=True)
    with stop_signals(lambda _: col.stop()) as stopped_by, contextlib.closing(col):
        trace = col.run(args.ranks, idle=args.idle, duration=args.duration, every=args.save_every,
                        save=lambda t: write_file(Trace.save, t, args.out))
    write_file(Trace.save, trace, args.out)
    if args.perfetto:
        write_file(write_chrome, trace, args.perfetto)
    print(col.stats)
    if stopped_by:
        print(f"stopped by {signal.Signals(stopped_by[0]).name}; wrote what was received to {args.out}")
        return 128 + stopped_by[0]
    if trace.events:
        print(summary(trace))
    return 0
