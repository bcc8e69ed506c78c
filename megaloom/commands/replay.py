"""``megaloom replay``: re-simulate a recorded run, on its own device (the identity replay,
whose error is always shown, with the share of the run no what-if moves) and under what-ifs
aimed at ops, scopes, shapes, comm and parallelism, each printed with the error bar its kind
measured on real A/B pairs; other unit counts or policy (megaloom traces)."""
from __future__ import annotations

import argparse
import importlib

from megaloom.commands import pairs
from megaloom.commands.simulate import add_common, check_units, policy_and_units, write_outputs
from megaloom.runtime.errors import ConfigError
from megaloom.runtime.files import check_outputs
from megaloom.runtime.registry import COMM, HOST


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("replay", help="re-simulate a recorded run (identity error shown) and what-ifs")
    p.add_argument("trace_files", nargs="+", metavar="TRACE",
                   help="a megaloom trace (.mlt), a torch.profiler trace (.json or .json.gz), several profiler "
                        "traces (one per rank, replayed together), or a directory of them")
    p.add_argument("--profile", default=None,
                   help="device to predict; each task is scaled by the cost model's ratio to the recorded device")
    p.add_argument("--recorded-profile", default=None,
                   help="device the trace was recorded on (default: from the trace's deviceProperties or profile)")
    what = p.add_argument_group("what-ifs (PATTERN: a class, engine kind, op or kernel name, or a glob of one)")
    what.add_argument("--speedup", action="append", metavar="PATTERN=F", help="matching tasks F times faster "
                      "(flash=2, 'attn*=2', aten::mm=1.5); repeat or separate with commas")
    what.add_argument("--remove", action="append", default=[], metavar="PATTERN", help="matching tasks removed")
    what.add_argument("--fuse", action="append", default=[], metavar="PATTERN", help="matching tasks (on a CPU trace, "
                      "nested ops too) as one fused kernel: only their GEMMs stay ('*attention_math*')")
    what.add_argument("--scope", action="append", default=[], metavar="ANNOTATION",
                      help="limit --speedup, --remove, --fuse, --dim, --cuda-graphs and --ep to tasks under this "
                           "annotation or module (a glob; plain text matches inside names)")
    what.add_argument("--cuda-graphs", action="store_true", help="host work lasts nothing (launches from a graph)")
    what.add_argument("--dim", action="append", metavar="D=D2", help="every recorded tensor dimension D (and the "
                      "flattened products it is part of) becomes D2, tasks re-costed: width, batch, sequence")
    what.add_argument("--layers", metavar="GLOB=N", help="the blocks under annotations matching GLOB removed or "
                      "repeated to N")
    what.add_argument("--hot-experts", metavar="GLOB=F", help="MoE routing skew: the first expert under GLOB gets F "
                      "times the mean tokens, the others share the rest")
    what.add_argument("--comm-speedup", type=float, default=1.0, metavar="F", help="comm tasks F times faster")
    what.add_argument("--comm-bytes", type=float, default=1.0, metavar="F", help="messages F times larger (alpha-beta)")
    what.add_argument("--link-bandwidth", type=float, default=None, metavar="GB/s",
                      help="comm tasks with recorded message sizes at this link bandwidth")
    what.add_argument("--dp", type=int, metavar="N", help="data-parallel degree: gradient all-reduces re-costed "
                      "(or added to a one-rank CPU trace)")
    what.add_argument("--ep", type=int, metavar="N", help="expert-parallel degree: all-to-alls re-costed, the expert "
                      "work in --scope shared among N ranks")
    what.add_argument("--host-ranks", type=int, metavar="N", help="ranks sharing the host's cores (the profile's "
                      "contention.cores) in the run asked about; one-rank traces")
    p.add_argument("--max-json-mib", type=int, default=512, metavar="MIB",
                   help="the most a gzipped profiler trace may expand to (default 512 MiB)")
    add_common(p)
    p.set_defaults(func=run)


def _whatif(args: argparse.Namespace):
    from megaloom.scheduler.whatif import WhatIf

    one = lambda text, what, value: next(iter(pairs([text], what, value=value).items())) if text else None  # noqa: E731
    w = WhatIf(args.comm_speedup, args.link_bandwidth * 1e9 if args.link_bandwidth is not None else None,
               pairs(args.speedup, "--speedup"), tuple(args.scope), tuple(args.remove), args.cuda_graphs,
               pairs(args.dim, "--dim", int, int), one(args.layers, "--layers", int),
               one(args.hot_experts, "--hot-experts", float), args.comm_bytes, args.dp, args.ep, args.host_ranks,
               tuple(args.fuse))
    w.check()
    return w


def run(args: argparse.Namespace) -> int:
    from megaloom.runtime.metrics import metrics, summary
    from megaloom.scheduler.fidelity import error_bars, fidelity, frozen_line, table
    from megaloom.scheduler.importers import load_traces
    from megaloom.scheduler.replay import imported, replay

    whatif = _whatif(args)  # before a long import
    policy, units = policy_and_units(args)
    check_outputs([args.trace, args.perfetto], args.trace_files, args.force)
    importlib.import_module("megaloom.scheduler.importers.kineto.read").MAX_JSON_BYTES = args.max_json_mib << 20
    recorded, reports = load_traces(args.trace_files)
    for rep in reports:
        print(rep.text(), end="\n\n")
    if len(reports) == 1 and reports[0].world_size > 1:
        print(f"notice: rank {reports[0].rank} of {reports[0].world_size} alone: its comm kernels' recorded "
              "durations include waiting for the other ranks; give every rank's file to split wait and transfer\n")
    check_units(units, [e.engine for e in recorded.events])
    if imported(recorded) and (units or policy is not None):
        print("notice: --units and --policy cannot change an imported trace: it keeps one unit per recorded "
              "thread and stream, and its dependencies decide every start\n")
    identity = replay(recorded, None, None, None, args.recorded_profile).trace
    check = fidelity(recorded, identity)
    changed = args.profile is not None or not whatif.empty() or (
        (units is not None or policy is not None) and not imported(recorded))
    result, label = identity, "what-if"
    if changed:
        result = replay(recorded, args.profile, units, policy, args.recorded_profile, whatif).trace
        label = f"{args.profile} + what-if" if args.profile and not whatif.empty() else args.profile or "what-if"
        skipped = [e for e in recorded.events if e.engine != HOST and not (e.flops or e.bytes or e.comm_bytes)]
        if args.profile is not None and skipped:
            print(f"notice: {len(skipped)} device ops have no work figures and keep their recorded duration on "
                  f"{args.profile}\n")
        if args.link_bandwidth is not None and not any(e.comm_bytes for e in recorded.events if e.engine == COMM):
            print("notice: no comm op records its message size: --link-bandwidth changes nothing\n")
    print(summary(result), end="\n\n")
    print(table(check, metrics(result) if changed else None, label))
    for line in (frozen_line(recorded) if imported(recorded) else "",
                 error_bars(whatif.kinds() + (["device"] if args.profile else [])) if changed else ""):
        if line:
            print(line)
    write_outputs(result, args)
    return 0
