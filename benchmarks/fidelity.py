"""Fidelity of the simulator: calibrate on real CPU runs of one set of graphs, then predict
the makespan of other graphs (other shapes, other schedules, MegaMoE included) and compare
with their measured runs. Target: median absolute error <= 10%.

    python benchmarks/fidelity.py [--repeats 3]

Every graph runs on a ThreadExecutor with one cube, one vector and one comm worker and one
torch thread per kernel, so the two cores of the machine hold the cube and vector work;
the simulator is given the same unit counts and the calibrated cost model.
Prints one JSON line per graph, then a summary line.
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

from megaloom.graphs.mlp import build_mlp, mlp_inputs
from megaloom.graphs.moe import MegaMoESpec, build_forward, make_routing
from megaloom.runtime import ThreadExecutor
from megaloom.scheduler import CostModel, Simulator, load_profile, make_policy
from megaloom.scheduler.fit import fit_table, fit_traces

UNITS = {"cube": 1, "vector": 1, "comm": 1}


def mlp(tokens: int, hidden: int, inter: int, tile: int, policy: str = "fifo"):
    g = build_mlp(tokens=tokens, hidden=hidden, inter=inter, tile=tile)
    return f"mlp T={tokens} H={hidden} I={inter} tile={tile} {policy}", g, mlp_inputs(g), policy


def moe(tokens: int, hidden: int, inter: int, experts: int, top_k: int, schedule: str, group_size: int = 1,
        tile_m: int = 64, policy: str = "fifo"):
    spec = MegaMoESpec(tokens=tokens, hidden=hidden, intermediate=inter, experts=experts, top_k=top_k,
                       tile_m=tile_m, schedule=schedule, group_size=group_size)
    gen = torch.Generator().manual_seed(tokens + hidden)
    ids = torch.rand(tokens, experts, generator=gen).argsort(dim=1)[:, :top_k]
    routing = make_routing(ids, spec, 0, None)
    g = build_forward(spec, routing.counts, save=False)
    w = torch.softmax(torch.randn(tokens, top_k, generator=gen), dim=1)
    inputs = {"x": torch.randn(tokens, hidden, generator=gen), "tok": routing.tok, "pos": routing.pos, "w": w,
              "gate_up": torch.randn(experts, hidden, 2 * inter, generator=gen) / hidden ** 0.5,
              "down": torch.randn(experts, inter, hidden, generator=gen) / inter ** 0.5}
    inputs = {k: v for k, v in inputs.items() if k in g.buffers}
    return f"megamoe-fwd T={tokens} H={hidden} I={inter} E={experts} k={top_k} {schedule} g={group_size}", g, inputs, policy


CALIBRATION = [  # task sizes spanning those of the predicted graphs
    lambda: mlp(512, 256, 512, 64),
    lambda: mlp(1024, 512, 1024, 128),
    lambda: mlp(512, 128, 512, 32),
    lambda: moe(256, 256, 128, 8, 2, "interleaved"),
    lambda: moe(512, 128, 256, 16, 2, "sequential", tile_m=128),
]
PREDICTION = [
    lambda: mlp(2048, 384, 768, 128),
    lambda: mlp(1024, 256, 1024, 32, policy="critical_path"),
    lambda: moe(512, 384, 192, 8, 2, "sequential"),
    lambda: moe(512, 384, 192, 8, 2, "interleaved", group_size=2),
    lambda: moe(1024, 256, 256, 16, 2, "interleaved", tile_m=128, policy="critical_path"),
]


def measure(graph, inputs, policy: str, repeats: int):
    """Traces of ``repeats`` runs (after a warm-up) of the graph on the thread executor,
    sorted by makespan (the middle one is the median run)."""
    ex = ThreadExecutor(UNITS, policy=make_policy(policy), intra_op_threads=1)
    ex.run(graph, inputs)
    return sorted((ex.run(graph, inputs).trace for _ in range(repeats)), key=lambda t: t.makespan)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.manual_seed(0)
    traces = []
    for make in CALIBRATION:
        name, g, inputs, policy = make()
        runs = measure(g, inputs, policy, args.repeats)
        traces += runs  # every run is a sample for the fit
        print(json.dumps({"set": "calibration", "graph": name, "tasks": len(g),
                          "measured_s": runs[len(runs) // 2].makespan}))
    fits = fit_traces(traces)
    print(fit_table(fits))
    model = CostModel(load_profile("cpu"), overrides={op: f.coeffs for op, f in fits.items()})
    errors = []
    for make in PREDICTION:
        name, g, inputs, policy = make()
        runs = measure(g, inputs, policy, args.repeats)
        measured = runs[len(runs) // 2].makespan
        predicted = Simulator("cpu", UNITS, make_policy(policy), model).run(g).trace.makespan
        errors.append(abs(predicted - measured) / measured)
        print(json.dumps({"set": "prediction", "graph": name, "tasks": len(g), "measured_s": measured,
                          "predicted_s": predicted, "error": predicted / measured - 1}))
    med = statistics.median(errors)
    print(json.dumps({"figure": "median_abs_error", "value": med, "target": 0.10, "met": med <= 0.10}))


if __name__ == "__main__":
    main()
