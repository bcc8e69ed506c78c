"""FSDP weight-gather prefetch: ``build_fsdp_mlp_graph`` with ``prefetch=1`` vs ``prefetch=0``.

Simulated: one rank's forward + backward graph on hardware profiles (the simulator's
virtual clock), makespan and the share of comm time under compute
(``megaloom.runtime.metrics``). Measured (``--ranks N``, 0 skips it): the same graphs
at a small size on N local gloo ranks (ThreadExecutor: 1 cube, 1 vector, 1 comm unit, 1
torch thread per rank), alternating, medians over repeats after a warm-up, averaged over
ranks. Prints one JSON line per figure:

    python benchmarks/fsdp_prefetch.py [--ranks 2] [--repeats 5]
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

from megaloom.graphs.fsdp import build_fsdp_mlp_graph, fsdp_mlp_inputs
from megaloom.comm.spawn import run_world
from megaloom.runtime import ExecContext, ThreadExecutor, metrics
from megaloom.scheduler import Simulator

# (profile, width, layers, tokens per rank, tile, ranks); 4097 rows shard unevenly over 3 and 8 ranks
SIMULATED = [("h100", 4096, 8, 8192, 128, 8), ("h100", 4097, 8, 8192, 128, 3),
             ("ascend-910b", 4096, 8, 8192, 256, 8), ("ascend-910b", 4097, 8, 8192, 256, 3)]


def simulate(profile: str, width: int, layers: int, tokens: int, tile: int, ranks: int) -> None:
    m = {}
    for p in (0, 1):
        g = build_fsdp_mlp_graph([width] * (layers + 1), tokens, ranks, 0, tile=tile, prefetch=p, dtype="bfloat16")
        m[p] = metrics(Simulator(profile).run(g).trace)
    shape = {"profile": profile, "width": width, "layers": layers, "tokens": tokens, "tile": tile, "ranks": ranks,
             "dtype": "bfloat16"}
    print(json.dumps({"figure": "simulated_fsdp_prefetch", **shape,
                      "makespan_ms": {p: round(m[p].makespan * 1e3, 3) for p in m},
                      "speedup_prefetch1_vs_0": round(m[0].makespan / m[1].makespan, 3),
                      "comm_ms": round(m[1].comm_time * 1e3, 3),
                      "comm_hidden": {p: round(m[p].comm_hidden, 3) for p in m}}))


def rank_main(comm, width: int, layers: int, tokens: int, tile: int, repeats: int) -> dict:
    torch.manual_seed(0)
    dims = [width] * (layers + 1)
    weights = [torch.randn(width, width) / width ** 0.5 for _ in range(layers)]
    x, dy = torch.randn(tokens, width), torch.randn(tokens, width)
    ctx = ExecContext(rank=comm.rank, world_size=comm.world_size, comm=comm)
    ex = ThreadExecutor({"cube": 1, "vector": 1, "comm": 1}, ctx=ctx, intra_op_threads=1)
    graphs = {p: build_fsdp_mlp_graph(dims, tokens, comm.world_size, comm.rank, tile=tile, prefetch=p) for p in (0, 1)}
    inputs = fsdp_mlp_inputs(weights, x, dy, comm.world_size, comm.rank)
    runs: dict[int, list] = {0: [], 1: []}
    for i in range(repeats + 1):
        for p in (0, 1):
            comm.barrier()
            m = metrics(ex.run(graphs[p], inputs).trace)
            if i:  # the first round is warm-up
                runs[p].append((m.makespan, m.comm_time, m.comm_hidden))
    return {str(p): [statistics.median(v[k] for v in runs[p]) for k in range(3)] for p in runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2, help="gloo ranks of the measured run (0: skip it)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--width", type=int, default=1023)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--tile", type=int, default=128)
    a = ap.parse_args()
    for case in SIMULATED:
        simulate(*case)
    if a.ranks:
        res = run_world(rank_main, a.ranks, a.width, a.layers, a.tokens, a.tile, a.repeats,
                        timeout=600, comm_timeout=120)
        avg = {p: [sum(r[p][k] for r in res) / len(res) for k in range(3)] for p in ("0", "1")}
        print(json.dumps({"figure": "measured_fsdp_prefetch_gloo", "ranks": a.ranks, "width": a.width,
                          "layers": a.layers, "tokens": a.tokens, "tile": a.tile, "dtype": "float32",
                          "makespan_s": {p: round(avg[p][0], 5) for p in avg},
                          "speedup_prefetch1_vs_0": round(avg["0"][0] / avg["1"][0], 3),
                          "comm_s": {p: round(avg[p][1], 5) for p in avg},
                          "comm_hidden": {p: round(avg[p][2], 3) for p in avg}}))


if __name__ == "__main__":
    main()
