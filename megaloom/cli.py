"""``megaloom`` command line: one sub-command per module in ``megaloom.commands``.

Each module defines ``add_parser(subparsers)``, which registers its parser and sets
``func`` (taking the parsed arguments, returning an exit code).
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from megaloom.runtime.errors import MegaloomError

COMMANDS = ["demo", "launch", "collect", "train", "export", "simulate", "replay", "profiles", "calibrate", "trace",
            "catalog", "graph"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megaloom", description="Dataflow runtime for accelerator task graphs.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        importlib.import_module(f"megaloom.commands.{name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    stdout = sys.stdout  # an output to '-' sends messages to stderr for the command's run
    try:
        return int(args.func(args) or 0)
    except MegaloomError as e:
        print(f"megaloom {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # output piped into a reader that stopped (e.g. `| head`)
        os.dup2(os.open(os.devnull, os.O_WRONLY), stdout.fileno())  # nothing left to flush at exit
        return 0
    finally:
        sys.stdout = stdout


if __name__ == "__main__":
    sys.exit(main())
