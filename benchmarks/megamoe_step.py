"""MegaMoE training step vs transformers' Qwen3-MoE block, a new routing every step.

One JSON line per figure. Both sides run the same block: transformers' ``Qwen3MoeSparseMoeBlock``
from a one-layer ``Qwen3MoeForCausalLM`` built from its config (the experts implementation is
the one transformers picks for a user: ``grouped_mm`` where torch has it), and its router feeding
:class:`~megaloom.graphs.MegaMoE` with the same expert weights. Every step draws new hidden states
(so a new routing), runs forward and backward, and times it; figures are medians over the steps,
the sides taking turns in each step; wall and process-CPU seconds. ``megamoe`` is the module as built by
default (grouped graphs at small call sizes, one compute worker thread); ``megamoe_tiles`` the same with one
task per row tile at every size; ``megamoe_rebuild`` the same with its graphs built for the step's counts
(the graph cache missing every step, as before dynamic graphs); ``host_seconds``: the step time
outside the two graph runs (router, routing, building, autograd), less sensitive to a busy machine; ``megamoe_units`` runs ``--cubes``
cube units and one vector unit, each kernel on one torch thread (so it uses ``cubes + 1`` threads
whatever ``--threads`` says: compare it at the thread count that matches the cores it uses).

    python benchmarks/megamoe_step.py [--tokens 2048] [--threads 1 2] [--steps 9]
"""
from __future__ import annotations

import argparse
import json
from dataclasses import replace
import os
import statistics
import time

import torch

from megaloom.graphs.moe import MEGAMOE, MegaMoE
from megaloom.graphs.moe.module import MegaMoERunner
from megaloom.runtime import ThreadExecutor
from megaloom.runtime.testing import rel_l2


def emit(**fig) -> None:
    print(json.dumps(fig), flush=True)


def hf_block(H: int, I: int, E: int, k: int, seed: int = 0):
    """A Qwen3-MoE block as a user gets it from a model built from its config, and its experts implementation."""
    from megaloom.models.hf_moe import model_classes

    config_cls, model_cls = model_classes("qwen3_moe")
    cfg = config_cls(hidden_size=H, moe_intermediate_size=I, intermediate_size=2 * I, num_experts=E,
                     num_experts_per_tok=k, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=H // 4, vocab_size=64, norm_topk_prob=True)
    torch.manual_seed(seed)
    model = model_cls(cfg)
    return model.model.layers[0].mlp, model.config._experts_implementation


class Rebuild(MegaMoERunner):
    """MegaMoE as before dynamic graphs: forward and backward graphs built (and validated) for the
    counts of each step; the cache misses whenever the counts change (every training step)."""

    def forward(self, spec, routing, x, w, gate_up, down, save=True):
        g = self.graph(MEGAMOE, replace(spec, grouped=False), "fwd", routing.counts, save=save)  # counts graphs tile
        return self.run(g, {"x": x, "tok": routing.tok, "pos": routing.pos, "w": w, "gate_up": gate_up,
                            "down": down}, "fwd", contiguous=False)

    def backward(self, spec, routing, dout, w, saved, gate_up, down):
        g = self.graph(MEGAMOE, replace(spec, grouped=False), "bwd", routing.counts)
        ws = w.reshape(-1).index_select(0, routing.flat).unsqueeze(1)
        return self.run(g, {"dout": dout, "tok": routing.tok, "pos": routing.pos, "ws": ws, **saved,
                            "gate_up": gate_up, "down": down}, "bwd", contiguous=False)


class Tiled(MegaMoERunner):
    """MegaMoE with one task per row tile at every call size (never grouped)."""

    def spec_for(self, tokens, dtype, mx):
        return replace(super().spec_for(tokens, dtype, mx), grouped=False)


def megamoe_block(block, tile_m: int, rebuild: bool = False, cubes: int = 0, tiled: bool = False) -> MegaMoE:
    """MegaMoE with the block's expert weights (transformers keeps them transposed); ``cubes``: that many
    cube units (and one vector unit), each kernel on one torch thread (0: the module's default executor)."""
    ex = block.experts
    E, two_i, H = ex.gate_up_proj.shape
    executor = ThreadExecutor({"cube": cubes, "vector": 1}, intra_op_threads=1) if cubes else "thread"
    moe = MegaMoE(H, two_i // 2, E, block.gate.top_k, tile_m=tile_m, executor=executor)
    if rebuild or tiled:
        moe.runner = (Rebuild if rebuild else Tiled)(moe.spec)
    with torch.no_grad():
        moe.gate_up.copy_(ex.gate_up_proj.transpose(1, 2))
        moe.down.copy_(ex.down_proj.transpose(1, 2))
    return moe


def _span(trace) -> float:
    return max(e.end for e in trace.events) - min(e.start for e in trace.events) if trace.events else 0.0


def step(run, x: torch.Tensor, dout: torch.Tensor) -> tuple[float, float, torch.Tensor, torch.Tensor]:
    """Wall and process-CPU seconds of one forward and backward, the output and the input gradient."""
    x = x.clone().requires_grad_()
    t0, c0 = time.perf_counter(), time.process_time()
    y = run(x)
    y.backward(dout)
    return time.perf_counter() - t0, time.process_time() - c0, y.detach(), x.grad


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=256)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--tile-m", type=int, default=256)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument("--no-rebuild", action="store_true", help="skip the rebuild-every-step side")
    ap.add_argument("--cubes", type=int, default=2, help="cube units of the megamoe_units side (0: no such side)")
    args = ap.parse_args(argv)
    T, H = args.tokens, args.hidden
    block, impl = hf_block(H, args.intermediate, args.experts, args.top_k)
    sides = {"megamoe": megamoe_block(block, args.tile_m),
             "megamoe_tiles": megamoe_block(block, args.tile_m, tiled=True)}
    if not args.no_rebuild:
        sides["megamoe_rebuild"] = megamoe_block(block, args.tile_m, rebuild=True)
    if args.cubes:
        sides["megamoe_units"] = megamoe_block(block, args.tile_m, cubes=args.cubes)

    def mega(moe):
        def run(x):
            _, w, ids = block.gate(x)
            return moe(x, ids, w)
        return run

    runs = {"transformers": lambda x: block(x.view(1, T, H)).view(T, H), **{k: mega(m) for k, m in sides.items()}}
    params = [*block.parameters(), *(p for m in sides.values() for p in m.parameters())]
    gen = torch.Generator().manual_seed(1)
    for threads in args.threads:
        torch.set_num_threads(threads)
        times: dict[str, list[float]] = {k: [] for k in runs}
        cpu: dict[str, list[float]] = {k: [] for k in runs}
        host: dict[str, list[float]] = {k: [] for k in sides}  # step time outside the two graph runs
        errs: dict[str, float] = {}
        for s in range(args.steps + 1):  # step 0 warms up (and builds the cached graphs)
            x, dout = torch.randn(T, H, generator=gen), torch.randn(T, H, generator=gen)
            got = {}
            for name in (list(runs) if s % 2 else list(runs)[::-1]):
                for p in params:
                    p.grad = None
                dt, dc, y, dx = step(runs[name], x, dout)
                got[name] = (y, dx)
                if s:
                    times[name].append(dt)
                    cpu[name].append(dc)
                    if name in sides:
                        host[name].append(dt - sum(_span(t) for t in sides[name].runner.last_trace.values()))
            for name in sides:
                errs[name] = max(errs.get(name, 0.0), *(rel_l2(a, b) for a, b in zip(got[name], got["transformers"])))
        med = {k: statistics.median(v) for k, v in times.items()}
        med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
        fig = dict(figure="megamoe_step", threads=threads, tokens=T, hidden=H, intermediate=args.intermediate,
                   experts=args.experts, top_k=args.top_k, tile_m=args.tile_m, hf_experts=impl, steps=args.steps,
                   seconds={k: round(v, 5) for k, v in med.items()},
                   ratio_vs_transformers={k: round(med[k] / med["transformers"], 3) for k in sides},
                   cpu_seconds={k: round(v, 5) for k, v in med_cpu.items()},
                   cpu_ratio_vs_transformers={k: round(med_cpu[k] / med_cpu["transformers"], 3) for k in sides},
                   builds={k: m.runner.builds for k, m in sides.items()},
                   host_seconds={k: round(statistics.median(v), 5) for k, v in host.items()},
                   max_rel_err={k: float(f"{v:.2e}") for k, v in errs.items()}, load=os.getloadavg()[0])
        if "megamoe_rebuild" in med:
            fig["cached_vs_rebuild"] = round(med["megamoe"] / med["megamoe_rebuild"], 3)
        emit(**fig)


if __name__ == "__main__":
    main()
