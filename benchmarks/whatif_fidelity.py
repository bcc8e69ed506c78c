"""What-if fidelity: real A/B pairs recorded on this machine, B predicted from A's trace alone.

    python benchmarks/whatif_fidelity.py [--rounds 7] [--kind shape ...] [--write]

Each pair is two real runs that differ in one thing (an op removed, a wider FFN, more layers,
a hot expert, smaller all-reduces on two gloo ranks, a second data-parallel rank, megaloom's
own graphs under other units or policies). A's steps are recorded with torch.profiler and
replayed under the what-if that names the change; B/A is measured in interleaved rounds
(A then B, B then A, ...), median and range. Prints one JSON line per pair, then the table
and the error per kind; ``--write`` stores the per-kind error bars that ``megaloom replay``
prints beside each what-if (``scheduler/whatif_errors.json``, with the machine and its load).

Pairs come from ``benchmarks/whatif/torch_pairs.py`` (one process), ``gloo_pairs.py`` (two
gloo ranks) and, when present, ``own_graphs.py`` (megaloom's own graphs).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.whatif.pair import KINDS, evaluate, summarise, write_error_bars  # noqa: E402

SOURCES = ("torch_pairs", "gloo_pairs", "own_graphs")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--kind", action="append", choices=KINDS, help="only pairs of this kind (repeatable)")
    ap.add_argument("--write", action="store_true", help="store the error bars megaloom replay prints")
    args = ap.parse_args()
    pairs = []
    for name in SOURCES:
        try:
            mod = importlib.import_module(f"benchmarks.whatif.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"benchmarks.whatif.{name}":
                raise
            print(json.dumps({"source": name, "skipped": "absent"}), flush=True)
            continue
        pairs += [p for p in mod.pairs() if not args.kind or p.kind in args.kind]
    load = [round(x, 2) for x in os.getloadavg()]
    results = []
    try:
        for p in pairs:
            r = evaluate(p, args.rounds)
            results.append(r)
            print(json.dumps({"kind": p.kind, "pair": p.name, "measured": round(r.measured, 4),
                              "range": [round(x, 4) for x in r.spread], "predicted": round(r.predicted, 4),
                              "error": round(r.error, 4)}), flush=True)
    finally:
        for name in SOURCES:
            close = getattr(sys.modules.get(f"benchmarks.whatif.{name}"), "close", None)
            if close:
                close()
    load = [max(a, b) for a, b in zip(load, (round(x, 2) for x in os.getloadavg()))]
    machine = f"{platform.machine()} {os.cpu_count()} cores, load average up to {load[0]}"
    print(f"\n| kind | pair | measured B/A (range) | predicted | error |\n|---|---|---|---|---|")
    for r in results:
        print(f"| {r.pair.kind} | {r.pair.name} | {r.measured:.3f} ({r.spread[0]:.3f}-{r.spread[1]:.3f}) | "
              f"{r.predicted:.3f} | {r.error:+.1%} |")
    summary = summarise(results)
    print(f"\nmachine: {machine}; {args.rounds} interleaved rounds per pair")
    for kind, s in summary.items():
        print(f"{kind}: median |error| {s['median_abs_error']:.1%}, worst {s['worst_abs_error']:.1%}, {s['pairs']} pairs")
    if args.write:
        write_error_bars(summary, machine)


if __name__ == "__main__":
    main()
