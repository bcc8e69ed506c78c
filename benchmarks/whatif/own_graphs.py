"""megaloom's own graphs as what-if pairs: a graph executed for real on the ThreadExecutor (side
A), the same family under other unit counts, policies, tiles or shapes (side B), and B/A
predicted by the simulator from a cost model calibrated on A's recorded runs alone.

The calibration is ``megaloom calibrate``'s: the cores the workers really share, measured as
matmul tasks on more cube workers against one (right after A's runs, so under the same load), and
per-op roofline fits of A's traces under that contention (``calibrate --from``). Both sides
are then simulated with it and the prediction is their ratio. Each measured run is the best of ``REPEATS`` executions, so a burst of load from
other jobs on a shared machine does not decide a round; alike, the calibration fits the
fastest ``KEPT`` of ``RECORDED`` runs of A (the least disturbed ones).

    python benchmarks/whatif/own_graphs.py [--rounds 9]     # just these pairs: a table and JSON lines

``benchmarks/whatif_fidelity.py`` runs them with the other kinds.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
from dataclasses import dataclass, field

import torch

from megaloom.graphs import GateSpec, build_megagate
from megaloom.graphs.mlp import build_mlp, mlp_inputs
from megaloom.graphs.moe import MegaMoESpec, build_backward, build_forward, make_routing
from megaloom.runtime import TaskGraph, ThreadExecutor
from megaloom.scheduler import Simulator, load_profile, make_policy
from megaloom.scheduler.calibrate import shared_cores
from megaloom.scheduler.fit import calibrated_profile, fit_traces
from megaloom.scheduler.profile import Contention

try:
    from benchmarks.whatif.pair import Pair, evaluate, summarise
except ImportError:  # run as a script from benchmarks/whatif
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
    from benchmarks.whatif.pair import Pair, evaluate, summarise

UNITS = {"cube": 1, "vector": 1, "comm": 1}
REPEATS = 5       # executions per measured run (the best counts)
RECORDED, KEPT = 12, 4  # recorded runs of side A; the fastest ones, which the calibration fits
FITTED: dict[str, dict] = {}  # per pair: the fitted contention and A's identity error (simulated / recorded median)


@dataclass
class Side:
    """One side of a pair: a graph with its inputs, run with ``units`` and ``policy``."""

    graph: TaskGraph
    inputs: dict[str, torch.Tensor]
    units: dict[str, int] = field(default_factory=lambda: dict(UNITS))
    policy: str = "fifo"

    def __post_init__(self) -> None:
        self.executor = ThreadExecutor(self.units, policy=make_policy(self.policy), intra_op_threads=1)

    def run(self):
        return self.executor.run(self.graph, self.inputs).trace

    def seconds(self) -> float:
        return min(self.run().makespan for _ in range(REPEATS))

    def simulate(self, profile) -> float:
        return Simulator(profile, self.units, make_policy(self.policy)).run(self.graph).trace.makespan


def mlp(tokens: int = 1024, hidden: int = 256, inter: int = 512, tile: int = 64, **side) -> Side:
    g = build_mlp(tokens=tokens, hidden=hidden, inter=inter, tile=tile)
    return Side(g, mlp_inputs(g), **side)


def moe(direction: str = "fwd", tokens: int = 512, hidden: int = 256, inter: int = 256, experts: int = 8,
        top_k: int = 2, seed: int = 0, **opts) -> Side:
    """A MegaMoE graph (``opts``: spec fields, then ``units`` / ``policy``); backward inputs are
    what a forward run saved."""
    side = {k: opts.pop(k) for k in ("units", "policy") if k in opts}
    spec = MegaMoESpec(tokens=tokens, hidden=hidden, intermediate=inter, experts=experts, top_k=top_k, **opts)
    gen = torch.Generator().manual_seed(seed)
    routing = make_routing(torch.rand(tokens, experts, generator=gen).argsort(dim=1)[:, :top_k], spec)
    w = torch.softmax(torch.randn(tokens, top_k, generator=gen), dim=1)
    fwd = {"x": torch.randn(tokens, hidden, generator=gen), "tok": routing.tok, "pos": routing.pos, "w": w,
           "gate_up": torch.randn(experts, hidden, 2 * inter, generator=gen) / hidden ** 0.5,
           "down": torch.randn(experts, inter, hidden, generator=gen) / inter ** 0.5}
    g = build_forward(spec, routing.counts, save=direction == "bwd")
    if direction == "fwd":
        return Side(g, {k: v for k, v in fwd.items() if k in g.buffers}, **side)
    saved = ThreadExecutor(UNITS).run(g, {k: v for k, v in fwd.items() if k in g.buffers})
    g = build_backward(spec, routing.counts)
    inputs = {"dout": torch.randn(tokens, hidden, generator=gen), "ws": w.reshape(-1)[routing.flat][:, None].contiguous(),
              **fwd, **{k: v for k, v in saved.outputs.items() if k in g.buffers}}
    return Side(g, {k: v for k, v in inputs.items() if k in g.buffers}, **side)


def gate(direction: str = "fwd", tokens: int = 2048, hidden: int = 512, experts: int = 64, top_k: int = 6,
         tile_tokens: int = 128, seed: int = 0, **side) -> Side:
    """A MegaGate graph (sigmoid scores); backward inputs are a forward run's outputs."""
    spec = GateSpec(tokens, hidden, experts, top_k, "sigmoid", 2.5, True, tile_tokens=tile_tokens)
    gen = torch.Generator().manual_seed(seed)
    fwd = {"x": torch.randn(tokens, hidden, generator=gen), "weight": torch.randn(experts, hidden, generator=gen),
           "bias": torch.zeros(experts)}
    if direction == "fwd":
        return Side(build_megagate(spec, "fwd"), fwd, **side)
    out = ThreadExecutor(UNITS).run(build_megagate(spec, "fwd"), fwd)
    inputs = {**fwd, "logits": out["logits"], "indices": out["indices"],
              "grad_weights": torch.randn(tokens, top_k, generator=gen),
              "grad_logits": torch.zeros(tokens, experts)}
    g = build_megagate(spec, "bwd")
    return Side(g, {k: v for k, v in inputs.items() if k in g.buffers}, **side)


def calibrated(traces, cores: float) -> object:
    """The ``cpu`` profile with per-op fits to ``traces``, made under ``cores`` shared by the workers."""
    contention = Contention(cores, tuple(UNITS))
    fits = fit_traces(traces, contention=contention)
    return calibrated_profile(load_profile("cpu"), fits, "cpu-fit", source="side A's runs", contention=contention)


def pair(name: str, a: Side, b: Side) -> Pair:
    recorded: list = []
    cores: list[float] = []

    def setup() -> None:
        a.run(), b.run()  # warm-up
        recorded.extend(sorted((a.run() for _ in range(RECORDED)), key=lambda t: t.makespan)[:KEPT])
        cores.append(shared_cores(os.cpu_count() or 1, 128, 1.0))

    def predict() -> float:
        profile = calibrated(recorded, cores[-1])
        sim_a = a.simulate(profile)
        FITTED[name] = {"cores": round(profile.contention.cores, 3),
                        "identity": round(sim_a / statistics.median(t.makespan for t in recorded) - 1, 4)}
        return b.simulate(profile) / sim_a

    return Pair("megaloom_graph", name, a.seconds, b.seconds, predict, setup)


def pairs() -> list[Pair]:
    """Own-graph what-if pairs: units, policies, tiles and shapes of MLP, MegaMoE and MegaGate graphs."""
    two_cubes = {"cube": 2, "vector": 1, "comm": 1}
    two_vectors = {"cube": 1, "vector": 2, "comm": 1}
    return [
        pair("MLP T=1024 tile 64: cube units 1 -> 2", mlp(), mlp(units=two_cubes)),
        pair("MLP T=1024 tile 32: fifo -> critical_path", mlp(tile=32), mlp(tile=32, policy="critical_path")),
        pair("MLP T=1024: tile 64 -> 128", mlp(), mlp(tile=128)),
        pair("MLP tile 64: T 1024 -> 2048, I 512 -> 768", mlp(), mlp(tokens=2048, inter=768)),
        pair("MegaMoE fwd E=8: sequential -> interleaved", moe(schedule="sequential", tile_m=64),
             moe(schedule="interleaved", tile_m=64)),
        pair("MegaMoE fwd: tile_m 64 -> 128, static policy", moe(tile_m=64), moe(tile_m=128, policy="static")),
        pair("MegaMoE bwd: vector units 1 -> 2", moe("bwd", tile_m=64), moe("bwd", tile_m=64, units=two_vectors)),
        pair("MegaMoE bwd: T 512 -> 1024", moe("bwd", tile_m=64), moe("bwd", tokens=1024, tile_m=64)),
        pair("MegaGate fwd: tile 128 -> 256", gate(), gate(tile_tokens=256)),
        pair("MegaGate bwd: cube units 1 -> 2", gate("bwd"), gate("bwd", units=two_cubes)),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=9, help="interleaved rounds per pair (default 9)")
    ap.add_argument("--only", default=None, help="run only the pairs whose name contains this text")
    args = ap.parse_args()
    torch.manual_seed(0)
    results = []
    for p in pairs():
        if args.only and args.only not in p.name:
            continue
        r = evaluate(p, args.rounds)
        results.append(r)
        print(json.dumps({"kind": p.kind, "pair": p.name, "measured": round(r.measured, 4),
                          "range": [round(x, 4) for x in r.spread], "predicted": round(r.predicted, 4),
                          "error": round(r.error, 4), "fitted": FITTED.get(p.name), "load": os.getloadavg()[0]}),
              flush=True)
    print(f"\n| pair | measured B/A (range) | predicted | error |\n|---|---:|---:|---:|")
    for r in results:
        print(f"| {r.pair.name} | {r.measured:.3f} ({r.spread[0]:.3f}-{r.spread[1]:.3f}) | {r.predicted:.3f} | "
              f"{r.error * 100:+.1f}% |")
    s = summarise(results).get("megaloom_graph")
    if s:
        print(f"\nmedian |error| {s['median_abs_error'] * 100:.1f}%, worst {s['worst_abs_error'] * 100:.1f}% over "
              f"{s['pairs']} pairs; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
