"""``megaloom profiles``: the hardware profiles, as a table or one in detail with sources."""
from __future__ import annotations

import argparse

from megaloom.runtime.registry import COMM, CUBE, VECTOR


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profiles", help="list hardware profiles, or show one with its sources")
    p.add_argument("name", nargs="?", default=None, help="a profile name or YAML path to show in detail")
    p.set_defaults(func=run)


def _rate(profile, engine: str, precision: str) -> str:
    return f"{profile.peak(engine, precision) / 1e12:.4g}" if engine in profile.peaks else "-"


def run(args: argparse.Namespace) -> int:
    from megaloom.scheduler import list_profiles, load_profile

    if args.name:
        p = load_profile(args.name)
        print(f"{p.name}: {p.description}\n  file: {p.path}")
        print(f"  units          {', '.join(f'{k}={v}' for k, v in p.units.items())}")
        for e, rates in p.peaks.items():
            print(f"  peak {e:<9} {', '.join(f'{k} {v / 1e12:g} TFLOP/s' for k, v in rates.items())}")
        print(f"  mem_bw         {p.mem_bw / 1e9:g} GB/s")
        for k, (a, b) in p.links.items():
            print(f"  link {k:<9} alpha {a * 1e6:g} us, beta {b / 1e9:g} GB/s")
        print(f"  task_overhead  {p.task_overhead * 1e6:g} us")
        print("  sources:", *(f"    {k}: {v}" for k, v in p.sources.items()), sep="\n")
        return 0
    head = f"{'profile':<13}{'cube':>6}{'vector':>8}{'comm':>6}{'cube bf16':>11}{'cube mxfp8':>12}{'HBM GB/s':>10}{'intra GB/s':>12}{'inter GB/s':>12}"
    print(head + "\n" + "-" * len(head))
    for name in list_profiles():
        p = load_profile(name)
        u = p.units
        print(f"{name:<13}{u.get(CUBE, 0):>6}{u.get(VECTOR, 0):>8}{u.get(COMM, 0):>6}"
              f"{_rate(p, CUBE, 'bf16'):>11}{_rate(p, CUBE, 'mxfp8'):>12}{p.mem_bw / 1e9:>10.0f}"
              f"{p.link('intra')[1] / 1e9:>12.0f}{p.link('inter')[1] / 1e9:>12.1f}")
    print("(peaks in TFLOP/s, chip-wide; mxfp8 falls back to fp8/bf16 where the chip lacks it;"
          " `megaloom profiles NAME` shows sources)")
    return 0
