"""``megaloom demo``: build a small graph, simulate it, execute it, check it, write a trace."""
from __future__ import annotations

import argparse
import os

import torch

from megaloom.commands import require_positive, write_file
from megaloom.demo import build_demo_graph, demo_inputs
from megaloom.runtime import ReferenceExecutor, ThreadExecutor, Trace, summary, write_chrome
from megaloom.runtime.errors import ConfigError, ExecutionError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="simulate and execute a small graph; check it; write a Perfetto trace")
    p.add_argument("--profile", default="ascend-910b", help="hardware profile to simulate on (default: ascend-910b)")
    p.add_argument("--out", default="megaloom-demo", help="output folder (default: ./megaloom-demo)")
    p.add_argument("--tokens", type=int, default=4096, help="rows of the MLP input (default 4096)")
    p.add_argument("--tile", type=int, default=64, help="rows per tile (default 64)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from megaloom.scheduler import Simulator, load_profile

    require_positive(args, "tokens", "tile")
    try:
        os.makedirs(args.out, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create output folder {args.out}: {e.strerror or e}") from e
    graph = build_demo_graph(tokens=args.tokens, tile=args.tile).validate()
    print(graph.summary(), end="\n\n")

    profile = load_profile(args.profile)
    sim = Simulator(profile).run(graph)
    print(summary(sim.trace), end="\n\n")

    inputs = demo_inputs(graph)
    real = ThreadExecutor({"cube": 2, "vector": 2}).run(graph, inputs)
    ref = ReferenceExecutor().run(graph, inputs)
    print(summary(real.trace), end="\n\n")
    err = (real["out"] - ref["out"]).norm() / ref["out"].norm()
    if not torch.allclose(real["out"], ref["out"], rtol=1e-5, atol=1e-6):
        raise ExecutionError(f"threaded result differs from the reference executor (relative L2 error {err:.3e})")
    print(f"check: threaded executor matches the reference executor (relative L2 error {err:.2e})")

    paths = {
        "simulated": os.path.join(args.out, f"simulated-{profile.name}.json"),
        "executed": os.path.join(args.out, "executed-cpu.json"),
    }
    write_file(write_chrome, sim.trace, paths["simulated"])
    write_file(write_chrome, real.trace, paths["executed"])
    write_file(Trace.save, sim.trace, os.path.join(args.out, "simulated.mlt"))
    write_file(Trace.save, real.trace, os.path.join(args.out, "executed.mlt"))
    for what, path in paths.items():
        print(f"wrote {what} Perfetto trace: {path}  (open in https://ui.perfetto.dev)")
    return 0
