"""``megaloom replay``: re-simulate a recorded run, on its own device (the identity replay,
whose error is always shown) and under what-ifs: another device, comm faster or at another
link bandwidth, a class of kernels faster, other unit counts or policy (megaloom traces)."""
from __future__ import annotations

import argparse
import importlib

from megaloom.commands.simulate import add_common, check_units, policy_and_units, write_outputs
from megaloom.runtime.errors import ConfigError
from megaloom.runtime.files import check_outputs


def _factors(items: list[str] | None) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in (x.strip() for text in items or () for x in text.split(",")):
        if not item:
            continue
        key, sep, val = item.partition("=")
        try:
            out[key.strip()] = float(val) if sep and key.strip() else float("nan")
        except ValueError:
            out[key.strip()] = float("nan")
        if not out[key.strip()] > 0 or out[key.strip()] == float("inf"):
            raise ConfigError(f"bad --speedup {item!r}: expected CLASS=FACTOR with a positive factor, e.g. flash=2")
    return out


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("replay", help="re-simulate a recorded run (identity error shown) and what-ifs")
    p.add_argument("trace_files", nargs="+", metavar="TRACE",
                   help="a megaloom trace (.mlt), a torch.profiler trace (.json or .json.gz), several profiler "
                        "traces (one per rank, replayed together), or a directory of them")
    p.add_argument("--profile", default=None,
                   help="device to predict; each task is scaled by the cost model's ratio to the recorded device")
    p.add_argument("--recorded-profile", default=None,
                   help="device the trace was recorded on (default: from the trace's deviceProperties or profile)")
    p.add_argument("--comm-speedup", type=float, default=1.0, metavar="F", help="what-if: comm ops F times faster")
    p.add_argument("--link-bandwidth", type=float, default=None, metavar="GB/s",
                   help="what-if: comm ops with recorded message sizes at this link bandwidth")
    p.add_argument("--speedup", action="append", metavar="CLASS=F",
                   help="what-if: a kernel class (e.g. nccl, flash, cublas, cudnn) or engine kind F times faster; "
                        "repeat or separate with commas")
    p.add_argument("--max-json-mib", type=int, default=512, metavar="MIB",
                   help="the most a gzipped profiler trace may expand to (default 512 MiB)")
    add_common(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from megaloom.runtime.metrics import metrics, summary
    from megaloom.scheduler.fidelity import fidelity, table
    from megaloom.scheduler.importers import load_traces
    from megaloom.scheduler.replay import WhatIf, imported, replay

    check_outputs([args.trace, args.perfetto], args.trace_files, args.force)
    importlib.import_module("megaloom.scheduler.importers.kineto.read").MAX_JSON_BYTES = args.max_json_mib << 20
    recorded, reports = load_traces(args.trace_files)
    for rep in reports:
        print(rep.text())
        print()
    if len(reports) == 1 and reports[0].world_size > 1:
        print(f"notice: rank {reports[0].rank} of {reports[0].world_size} alone: its comm kernels' recorded "
              "durations include waiting for the other ranks; give every rank's file to split wait and transfer\n")
    policy, units = policy_and_units(args)
    check_units(units, [e.engine for e in recorded.events])
    whatif = WhatIf(args.comm_speedup, args.link_bandwidth * 1e9 if args.link_bandwidth is not None else None,
                    _factors(args.speedup))
    whatif.check()
    if imported(recorded) and (units or policy is not None):
        print("notice: --units and --policy cannot change an imported trace: it keeps one unit per recorded "
              "thread and stream, and its dependencies decide every start\n")
    identity = replay(recorded, None, None, None, args.recorded_profile).trace
    check = fidelity(recorded, identity)
    changed = args.profile is not None or not whatif.empty() or (units is not None and not imported(recorded)) \
        or (policy is not None and not imported(recorded))
    result = identity
    label = "what-if"
    if changed:
        result = replay(recorded, args.profile, units, policy, args.recorded_profile, whatif).trace
        label = f"{args.profile} + what-if" if args.profile and not whatif.empty() else args.profile or "what-if"
        skipped = [e for e in recorded.events if e.engine != "host" and not (e.flops or e.bytes or e.comm_bytes)]
        if args.profile is not None and skipped:
            print(f"notice: {len(skipped)} device ops have no work figures and keep their recorded duration on "
                  f"{args.profile}\n")
        if args.link_bandwidth is not None and not any(e.comm_bytes for e in recorded.events if e.engine == "comm"):
            print("notice: no comm op records its message size: --link-bandwidth changes nothing\n")
    print(summary(result))
    print()
    print(table(check, metrics(result) if changed else None, label))
    write_outputs(result, args)
    return 0
