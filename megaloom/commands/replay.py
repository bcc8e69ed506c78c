"""``megaloom replay``: re-simulate a saved trace with its measured durations under other
unit counts or another policy, and compare with the recorded run."""
from __future__ import annotations

import argparse

from megaloom.runtime.metrics import summary
from megaloom.commands.simulate import add_common, check_units, policy_and_units, write_outputs


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("replay", help="re-simulate a saved trace under other unit counts or policies")
    p.add_argument("trace_file", metavar="TRACE", help="a saved megaloom trace (.mlt) or a torch.profiler trace (.json)")
    p.add_argument("--profile", default=None,
                   help="device to predict; durations are scaled by the cost model's ratio to the recorded device")
    p.add_argument("--recorded-profile", default=None,
                   help="device the trace was recorded on (default: the trace's profile, else cpu)")
    add_common(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from megaloom.scheduler.replay import compare, replay

    from megaloom.scheduler.importers import load_trace

    recorded = load_trace(args.trace_file)
    policy, units = policy_and_units(args)
    check_units(units, [e.engine for e in recorded.events])
    result = replay(recorded, args.profile, units, policy, args.recorded_profile)
    print(summary(result.trace))
    print()
    print(compare(recorded, result.trace))
    write_outputs(result.trace, args)
    return 0
