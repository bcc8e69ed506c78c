"""``megaloom calibrate``: measure this machine and write the ``cpu`` hardware profile."""
from __future__ import annotations

import argparse

from megaloom.runtime.errors import ConfigError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("calibrate", help="measure this machine's matmul and memory bandwidth; write the cpu profile")
    p.add_argument("--out", default=None, metavar="PATH",
                   help="where to write the profile YAML (default: the user profile directory's cpu.yaml)")
    p.add_argument("--matmul-size", type=int, default=512, help="square matmul size (default 512)")
    p.add_argument("--copy-mib", type=int, default=64, help="tensor size of the bandwidth copy in MiB (default 64)")
    p.add_argument("--seconds", type=float, default=0.3, help="time spent per measurement (default 0.3)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from megaloom.scheduler.calibrate import calibrate, write_profile

    if args.matmul_size <= 0 or args.copy_mib <= 0 or args.seconds < 0:
        raise ConfigError("--matmul-size and --copy-mib must be positive, --seconds non-negative")
    profile = calibrate(args.matmul_size, args.copy_mib << 20, args.seconds)
    path = write_profile(profile, args.out)
    for k, v in profile.peaks["cube"].items():
        print(f"matmul {k:<5} {v / 1e9:10.2f} GFLOP/s")
    print(f"memory bandwidth {profile.mem_bw / 1e9:.2f} GB/s, task overhead {profile.task_overhead * 1e6:.2f} us")
    print(f"wrote profile {profile.name!r}: {path}")
    return 0
