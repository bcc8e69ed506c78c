"""``megaloom calibrate``: measure this machine and write the ``cpu`` hardware profile, or
(``--from TRACE...``) fit the cost model's per-op coefficients to measured traces (and the
base profile's contention, when it has one)."""
from __future__ import annotations

import argparse

from megaloom.runtime.errors import ConfigError
from megaloom.runtime.files import check_outputs
from megaloom.runtime.registry import CUBE


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("calibrate", help="measure this machine (cpu profile) or fit per-op costs to traces (--from)")
    p.add_argument("--out", default=None, metavar="PATH",
                   help="where to write the profile YAML (default: the user profile directory, <name>.yaml)")
    p.add_argument("--from", dest="traces", nargs="+", metavar="TRACE", default=None,
                   help="fit per-op throughput and overhead to these traces (megaloom .mlt or torch.profiler .json)")
    p.add_argument("--base", default="cpu", help="with --from: the profile the fits are added to (default: cpu)")
    p.add_argument("--name", default=None, help="with --from: name of the written profile (default: the base's)")
    p.add_argument("--matmul-size", type=int, default=512, help="square matmul size (default 512)")
    p.add_argument("--copy-mib", type=int, default=64, help="tensor size of the bandwidth copy in MiB (default 64)")
    p.add_argument("--seconds", type=float, default=0.3, help="time spent per measurement (default 0.3)")
    p.add_argument("--force", action="store_true", help="overwrite an existing --out file megaloom did not write")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from megaloom.scheduler.calibrate import calibrate, write_profile

    check_outputs([args.out], args.traces or (), args.force)
    if args.traces:
        return _from_traces(args, write_profile)
    if args.matmul_size <= 0 or args.copy_mib <= 0 or args.seconds < 0:
        raise ConfigError("--matmul-size and --copy-mib must be positive, --seconds non-negative")
    profile = calibrate(args.matmul_size, args.copy_mib << 20, args.seconds)
    path = write_profile(profile, args.out)
    print("matmul per unit (one thread): " + ", ".join(f"{k} {profile.unit_peak(CUBE, k) / 1e9:.2f}" for k in profile.peaks[CUBE]) + " GFLOP/s")
    print(f"memory bandwidth {profile.unit_mem_bw(CUBE) / 1e9:.2f} GB/s per unit, task overhead "
          f"{profile.task_overhead * 1e6:.2f} us, {profile.contention.cores:.2f} cores shared")
    print(f"wrote profile {profile.name!r}: {path}")
    return 0


def _from_traces(args: argparse.Namespace, write_profile) -> int:
    from megaloom.scheduler.fit import calibrated_profile, fit_overlap, fit_table, fit_traces
    from megaloom.scheduler.importers import load_trace
    from megaloom.scheduler.profile import load_profile

    traces, base = [load_trace(p) for p in args.traces], load_profile(args.base)
    contention, fits = fit_overlap(traces, base.contention) if base.contention else (None, fit_traces(traces))
    print(fit_table(fits) + (f"\ncompute {contention.overlap:.0%} slower under comm" if contention else ""))
    profile = calibrated_profile(base, fits, args.name, ", ".join(str(p) for p in args.traces), contention)
    print(f"wrote profile {profile.name!r}: {write_profile(profile, args.out)}")
    return 0
