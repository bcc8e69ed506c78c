"""``megaloom demo``: build a small graph, simulate it, execute it, check it, write a trace.

The demo graph: a two-layer MLP over token tiles, each tile flowing through
cube (matmul) and vector (SiLU, add) work, so tiles overlap across engines.

    x[tile i] --matmul(w1)--> h[i] --silu--> a[i] --matmul(w2)--> y[i] --add(x)--> out[i]
       cube                    vector          cube                  vector
"""
from __future__ import annotations

import argparse
import os

import torch

from megaloom.commands import require_positive, write_file
from megaloom.runtime import ReferenceExecutor, TaskGraph, ThreadExecutor, Trace, summary, write_chrome
from megaloom.runtime.errors import ConfigError, ExecutionError


def build_demo_graph(tokens: int = 512, hidden: int = 256, inter: int = 512, tile: int = 64,
                     dtype: str = "float32") -> TaskGraph:
    """The residual MLP ``out = x + silu(x @ w1) @ w2`` split into ``tile``-row tiles."""
    g = TaskGraph("demo-mlp")
    x = g.input("x", (tokens, hidden), dtype)
    w1 = g.input("w1", (hidden, inter), dtype)
    w2 = g.input("w2", (inter, hidden), dtype)
    h = g.buffer("h", (tokens, inter), dtype)
    a = g.buffer("a", (tokens, inter), dtype)
    y = g.buffer("y", (tokens, hidden), dtype)
    out = g.output("out", (tokens, hidden), dtype)
    for i, rows in enumerate(range(0, tokens, tile)):
        r = slice(rows, rows + tile)
        tags = {"group": i}
        g.task("matmul", [x[r], w1], [h[r]], name=f"mm1.{i}", tags={**tags, "stage": "mm1"})
        g.task("silu", [h[r]], [a[r]], name=f"silu.{i}", tags={**tags, "stage": "act"})
        g.task("matmul", [a[r], w2], [y[r]], name=f"mm2.{i}", tags={**tags, "stage": "mm2"})
        g.task("add", [y[r], x[r]], [out[r]], name=f"residual.{i}", tags={**tags, "stage": "residual"})
    return g


def demo_inputs(graph: TaskGraph, seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded random inputs for every input buffer, scaled to keep activations O(1)."""
    gen = torch.Generator().manual_seed(seed)
    return {b.name: torch.randn(b.shape, generator=gen) / max(1, b.shape[0]) ** 0.5 for b in graph.inputs}


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
