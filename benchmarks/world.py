"""World simulation of MegaMoE EP: every rank's graph at once vs the rank-0-only simulation.

    python benchmarks/world.py [--ep 8] [--profile atlas-a3] [--direction fwd]

One JSON line per (routing, slowdown): the rank-0-only makespan, the slowest single-rank
makespan (each rank simulated alone, times its slowdown), the world makespan (collectives synchronised), their
ratios, and the wall seconds of the world simulation.
"""
from __future__ import annotations

import argparse
import json
import time

from megaloom.graphs.moe import MegaMoESpec, build_backward, build_forward, synthetic_counts
from megaloom.scheduler import Simulator
from megaloom.scheduler.world import rank_ends, simulate_world


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ep", type=int, default=8)
    ap.add_argument("--profile", default="atlas-a3")
    ap.add_argument("--direction", default="fwd", choices=("fwd", "bwd"))
    ap.add_argument("--policy", default="priority")
    ap.add_argument("--quick", action="store_true", help="small shapes (seconds)")
    a = ap.parse_args()
    shape = dict(tokens=512, hidden=1024, intermediate=512) if a.quick else dict(tokens=4096, hidden=5120, intermediate=2304)
    spec = MegaMoESpec(**shape, experts=6 * a.ep, top_k=6, ep=a.ep, dtype="bfloat16", tile_m=128, cube_split=2,
                       wgrad_split=8)
    build = build_forward if a.direction == "fwd" else build_backward
    for routing, slowdown in (("balanced", {}), ("skewed", {}), ("balanced", {a.ep - 1: 1.2})):
        graphs = [build(spec, synthetic_counts(spec, routing, rank=r)) for r in range(a.ep)]
        alone = [Simulator(a.profile, policy=a.policy).run(g).trace.makespan for g in graphs]
        alone = [m * slowdown.get(r, 1.0) for r, m in enumerate(alone)]  # all durations scaled: makespan too
        t0 = time.perf_counter()
        trace = simulate_world(graphs, a.profile, policy=a.policy, slowdown=slowdown).trace
        wall = time.perf_counter() - t0
        ends = rank_ends(trace)
        world = max(ends.values())
        print(json.dumps({
            "figure": "world_vs_rank0", "ep": a.ep, "profile": a.profile, "direction": a.direction,
            "routing": routing, "slowdown": {str(k): v for k, v in slowdown.items()},
            "tasks": sum(map(len, graphs)), "collectives": trace.meta["collectives"],
            "rank0_ms": round(alone[0] * 1e3, 4), "slowest_alone_ms": round(max(alone) * 1e3, 4),
            "world_ms": round(world * 1e3, 4), "world_vs_rank0": round(world / alone[0], 4),
            "world_vs_slowest_alone": round(world / max(alone), 4), "loop": trace.meta["loop"],
            "world_sim_s": round(wall, 2),
        }), flush=True)


if __name__ == "__main__":
    main()
