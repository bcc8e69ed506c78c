"""MegaGate and MegaMHC benchmarks: one JSON line per figure.

  sim  simulated (atlas-a3 and h200 profiles): the router of the MegaMoE configuration
       (H=5120, 48 experts, top-6, sigmoid, 4096 tokens, bf16) and MegaMHC (H=5120, 4 streams,
       4096 tokens, bf16), forward and backward: makespan of the tiled graph vs the same
       graph with a barrier between stages (``staged``: no cube/vector overlap), engine
       utilisation and cube/vector overlap.
  cpu  measured: module forward+backward through the ThreadExecutor vs the golden eager
       torch reference with autograd on the same shapes (ratio of best times; one torch
       thread per kernel on both sides).

    python benchmarks/megagate_mhc.py [--part sim|cpu|all] [--quick]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from megaloom.graphs import (
    GateSpec, MHCSpec, build_megagate, build_megamhc, megagate_reference, megamhc_reference, run_megagate,
    run_megamhc,
)
from megaloom.graphs.common import GraphRunner
from megaloom.runtime import TaskGraph, ThreadExecutor, metrics
from megaloom.scheduler import Simulator


def emit(**fig) -> None:
    print(json.dumps(fig), flush=True)


def staged(graph: TaskGraph) -> TaskGraph:
    """``graph`` with a barrier (a noop task) between consecutive stages, in first-use order."""
    stages: dict[str, list] = {}
    for t in list(graph):
        stages.setdefault(t.tags.get("stage", "?"), []).append(t)
    groups = list(stages.values())
    for i, (before, after) in enumerate(zip(groups, groups[1:])):
        barrier = graph.task("noop", name=f"barrier.{i}", engine="vector")
        barrier.succeed(*before).precede(*after)
    return graph


def simulated(quick: bool) -> None:
    builders = {
        "megagate": lambda d: build_megagate(GateSpec(4096, 5120, 48, 6, "sigmoid", 2.5, True, "bfloat16"), d),
        "megamhc": lambda d: build_megamhc(MHCSpec(4096, 5120, 4, "bfloat16"), d),
    }
    for profile in ("atlas-a3",) if quick else ("atlas-a3", "h200"):
        for name, build in builders.items():
            for direction in ("fwd", "bwd"):
                tiled = metrics(Simulator(profile).run(build(direction)).trace)
                base = metrics(Simulator(profile).run(staged(build(direction))).trace)
                emit(figure="sim", profile=profile, graph=name, direction=direction,
                     makespan_us=round(tiled.makespan * 1e6, 2), staged_makespan_us=round(base.makespan * 1e6, 2),
                     gain_vs_staged=round(base.makespan / tiled.makespan - 1, 3),
                     utilisation={k: round(v, 3) for k, v in sorted(tiled.utilisation.items())},
                     cube_vector_overlap_us=round(tiled.cube_vector_overlap * 1e6, 2))


def best_time(fn, repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measured(quick: bool) -> None:
    torch.set_num_threads(1)  # both sides alike: 2-thread kernels stall on a shared 2-core machine
    repeat = 3 if quick else 7
    T, H, E, k = (512, 512, 32, 4) if quick else (2048, 1024, 64, 6)
    x, w, bias = torch.randn(T, H, requires_grad=True), torch.randn(E, H, requires_grad=True), torch.zeros(E)
    g = torch.randn(T, k)
    runner = GraphRunner(ThreadExecutor({"cube": 1, "vector": 1}))

    def gate_graph():
        (run_megagate(x, w, bias, top_k=k, score="sigmoid", runner=runner).weights * g).sum().backward()

    def gate_eager():
        (megagate_reference(x, w, bias, top_k=k, score="sigmoid")[1] * g).sum().backward()

    n, Tm = 4, T // 2
    ins = [torch.randn(Tm, H), torch.randn(Tm, n, H), torch.rand(Tm, n),
           torch.softmax(torch.randn(Tm, n, n), -1), 0.02 * torch.randn(24, n * H), torch.ones(3), torch.zeros(24),
           torch.ones(H)]
    ins = [t.requires_grad_() for t in ins]
    cot = [torch.randn(o.shape) for o in megamhc_reference(*ins)]

    def mhc_graph(tile):
        return lambda: sum((o * c).sum() for o, c in zip(run_megamhc(*ins, runner=runner, tile_tokens=tile),
                                                         cot)).backward()

    def mhc_eager():
        sum((o * c).sum() for o, c in zip(megamhc_reference(*ins), cot)).backward()

    cases = [("megagate", gate_graph, gate_eager, dict(tokens=T, hidden=H, experts=E, top_k=k, tile_tokens=128))]
    cases += [("megamhc", mhc_graph(tile), mhc_eager, dict(tokens=Tm, hidden=H, streams=n, tile_tokens=tile))
              for tile in (32, 128)]
    for name, graph_fn, eager_fn, shape in cases:
        tg, te = best_time(graph_fn, repeat), best_time(eager_fn, repeat)
        emit(figure="cpu", graph=name, **shape, dtype="float32", threads=torch.get_num_threads(),
             graph_ms=round(tg * 1e3, 2), eager_ms=round(te * 1e3, 2), ratio=round(tg / te, 3))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("sim", "cpu", "all"), default="all")
    p.add_argument("--quick", action="store_true", help="smaller shapes, fewer repeats")
    args = p.parse_args()
    torch.manual_seed(0)
    if args.part in ("sim", "all"):
        simulated(args.quick)
    if args.part in ("cpu", "all"):
        measured(args.quick)


if __name__ == "__main__":
    main()
