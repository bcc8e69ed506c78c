"""MegaMoE benchmarks: one JSON line per figure.

  sim  simulated on the atlas-a3 profile: H=5120, I=2304, top-6, 4096 tokens per rank,
       48 experts on EP 8 and 384 experts on EP 64 (6 per rank); makespan, engine
       utilisation and comm hidden of ``interleaved`` vs ``sequential``, fwd and bwd.
  cpu  measured: MegaMoE forward+backward via ThreadExecutor (world size 1) vs the golden
       eager block on the same shapes (ratio; target <= 1.10).
  ep   measured: 2 gloo ranks, ``interleaved`` vs ``sequential`` (speed-up, comm hidden).
  mxfp8  simulated on the ascend-950 profile (native MXFP8 cube rate): the MoE module at 4096
       tokens, H=2048, I=9216 (8 experts, top-2, one chip), forward and backward makespan with
       MXFP8 expert GEMMs (operands quantised on the vector units) vs bf16, next to the published
       -15% (forward) / -28% (backward); plus the quantisation-task width it depends on.
  fused  measured: forward+backward graphs on the ThreadExecutor with SwiGLU as ``dvm.fused`` tiles vs
       the unfused ``swiglu`` / ``swiglu_grad`` ops (``fuse_vector``), side by side, T=2048, H=512,
       I=256, 8 experts, top-2, fp32, 1 and 2 intra-op threads: whole run and SwiGLU-stage time, and
       the outputs' difference; plus the simulated gain of fusion on ascend-910b (MegaMoE, MegaMHC).

    python benchmarks/megamoe.py [--part sim|cpu|ep|mxfp8|fused|all] [--quick]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from megaloom.comm.spawn import run_world
from megaloom.graphs.moe import (
    MEGAMOE, MegaMoE, MegaMoESpec, build_backward, build_forward, make_routing, moe_reference,
)
from megaloom.graphs.moe.ep import ep_check, problem
from megaloom.runtime import ThreadExecutor
from megaloom.runtime.metrics import metrics
from megaloom.runtime.testing import rel_l2
from megaloom.scheduler import Simulator

PUBLISHED_GAIN = 0.501  # MegaMoE vs the unfused MoE module, as published
PUBLISHED_MXFP8 = {"fwd": -0.15, "bwd": -0.28}  # MoE module time with MXFP8 experts vs bf16, as published


def emit(**fig) -> None:
    print(json.dumps(fig), flush=True)


def simulated(quick: bool) -> None:
    base = dict(tokens=4096, hidden=5120, intermediate=2304, top_k=6, dtype="bfloat16", cube_split=2,
                wgrad_split=8, routing="balanced")
    configs = [(8, 48)] if quick else [(8, 48), (64, 384)]
    for ep, experts in configs:
        for direction in ("fwd", "bwd"):
            for ordered in (False, True):
                runs = {}
                for schedule, group, comm_tile in (("sequential", 1, 0), ("interleaved", 1, 0), ("interleaved", 2, 0),
                                                   ("interleaved", 1, 128)):
                    g = MEGAMOE.from_options({**base, "ep": ep, "experts": experts, "direction": direction,
                                            "schedule": schedule, "group_size": group, "ordered_comm": ordered,
                                            "comm_tile": comm_tile})
                    m = metrics(Simulator("atlas-a3", policy="priority").run(g).trace)
                    runs[(schedule, group, comm_tile)] = m
                    seq = runs[("sequential", 1, 0)].makespan
                    emit(figure="sim", profile="atlas-a3", ep=ep, experts=experts, direction=direction,
                         ordered_comm=ordered, schedule=schedule, group_size=group, comm_tile=comm_tile, tasks=len(g),
                         makespan_ms=round(m.makespan * 1e3, 4),
                         utilisation={k: round(v, 3) for k, v in sorted(m.utilisation.items())},
                         comm_ms=round(m.comm_time * 1e3, 4), comm_hidden=round(m.comm_hidden, 3),
                         gain_vs_sequential=round(seq / m.makespan - 1, 4), published_gain=PUBLISHED_GAIN)


def simulated_mxfp8(quick: bool) -> None:
    base = dict(tokens=4096, hidden=2048, intermediate=9216, experts=8, top_k=2, dtype="bfloat16", cube_split=4,
                wgrad_split=8, routing="balanced")
    for quant_cols in (1024,) if quick else (512, 1024, 4096):
        for direction in ("fwd", "bwd"):
            runs = {p: metrics(Simulator("ascend-950", policy="priority").run(MEGAMOE.from_options(
                {**base, "direction": direction, "precision": p, "quant_cols": quant_cols})).trace)
                for p in ("none", "mxfp8")}
            bf16, mx = runs["none"], runs["mxfp8"]
            emit(figure="sim_mxfp8", profile="ascend-950", shape={k: base[k] for k in ("tokens", "hidden",
                 "intermediate", "experts", "top_k")}, direction=direction, quant_cols=quant_cols,
                 bf16_us=round(bf16.makespan * 1e6, 1), mxfp8_us=round(mx.makespan * 1e6, 1),
                 change=round(mx.makespan / bf16.makespan - 1, 3), published_change=PUBLISHED_MXFP8[direction],
                 utilisation_bf16={k: round(v, 3) for k, v in sorted(bf16.utilisation.items())},
                 utilisation_mxfp8={k: round(v, 3) for k, v in sorted(mx.utilisation.items())})


def interleaved_best(fns: dict, repeat: int) -> dict:
    """Best seconds of each function, runs alternating so load changes hit them alike."""
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeat):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def with_threads(n: int, fn):
    def run() -> None:
        saved = torch.get_num_threads()
        torch.set_num_threads(n)
        try:
            fn()
        finally:
            torch.set_num_threads(saved)
    return run


def measured_cpu(quick: bool) -> None:
    shape = dict(tokens=1024 if quick else 2048, hidden=512, intermediate=256, experts=8, top_k=2)
    p = problem(1, **shape, seed=0)

    def eager() -> None:
        ref = {k: p[k].clone().requires_grad_() for k in ("x", "w", "gate_up", "down")}
        moe_reference(ref["x"], p["ids"], ref["w"], ref["gate_up"], ref["down"]).backward(p["dout"])

    def mega(units: dict, tile_m: int):
        moe = MegaMoE(shape["hidden"], shape["intermediate"], shape["experts"], shape["top_k"], tile_m=tile_m,
                      units=units)
        with torch.no_grad():
            moe.gate_up.copy_(p["gate_up"])
            moe.down.copy_(p["down"])

        def run() -> None:
            x, w = p["x"].clone().requires_grad_(), p["w"].clone().requires_grad_()
            moe(x, p["ids"], w).backward(p["dout"])
        return run

    threads = sorted({1, torch.get_num_threads()})
    fns = {f"eager/{n}t": with_threads(n, eager) for n in threads}
    configs = {"mega/c1v1/t512": ({"cube": 1, "vector": 1}, 512), "mega/c2v1/t512": ({"cube": 2, "vector": 1}, 512),
               "mega/c2v1/t256": ({"cube": 2, "vector": 1}, 256)}
    fns.update({k: with_threads(1, mega(*v)) for k, v in configs.items()})  # workers run 1 torch thread each
    best = interleaved_best(fns, 3 if quick else 7)
    base = min((k for k in best if k.startswith("eager")), key=best.get)
    for k, (units, tile_m) in configs.items():
        emit(figure="cpu_ws1", shape=shape, units=units, tile_m=tile_m, intra_op_threads=1,
             megamoe_s=round(best[k], 5), eager_s=round(best[base], 5), eager=base,
             eager_all={n: round(v, 5) for n, v in best.items() if n.startswith("eager")},
             ratio=round(best[k] / best[base], 3), target=1.10)


def measured_ep(quick: bool) -> None:
    cfg = dict(tokens=512 if quick else 1024, hidden=512, intermediate=256, experts=8, top_k=2, tile_m=256,
               units={"cube": 1, "vector": 1, "comm": 1}, repeat=3 if quick else 5, check=False)
    shape = {k: cfg[k] for k in ("tokens", "hidden", "intermediate", "experts", "top_k")}
    best: dict[str, tuple[float, list]] = {}
    for trial in range(1 if quick else 3):  # alternate, so load changes hit both alike
        for schedule in ("sequential", "interleaved"):
            ranks = run_world(ep_check, 2, {**cfg, "schedule": schedule}, timeout=300, comm_timeout=60)
            t = max(r["seconds"] for r in ranks)
            if t < best.get(schedule, (float("inf"),))[0]:
                best[schedule] = (t, ranks)
    for schedule, (t, ranks) in best.items():
        emit(figure="ep2_gloo", schedule=schedule, shape=shape, units=cfg["units"], tile_m=cfg["tile_m"],
             seconds=round(t, 5),
             comm_hidden={d: round(sum(r[d]["comm_hidden"] for r in ranks) / 2, 3) for d in ("fwd", "bwd")},
             comm_ms={d: round(sum(r[d]["comm_time"] for r in ranks) / 2 * 1e3, 3) for d in ("fwd", "bwd")})
    emit(figure="ep2_gloo_speedup", speedup=round(best["sequential"][0] / best["interleaved"][0], 3))


SWIGLU_STAGES = ("swiglu", "swiglu_grad")


def moe_step(spec: MegaMoESpec, p: dict, executor) -> tuple[dict, float]:
    """Forward then backward graphs of ``spec`` on ``executor``: outputs and gradients by name, and the
    seconds the SwiGLU stages' tasks ran."""
    r = make_routing(p["ids"], spec)
    fwd = executor.run(build_forward(spec, r.counts), {"x": p["x"], "tok": r.tok, "pos": r.pos, "w": p["w"],
                                                       "gate_up": p["gate_up"], "down": p["down"]})
    ws = p["w"].reshape(-1)[r.flat][:, None].contiguous()
    bwd = executor.run(build_backward(spec, r.counts), {
        "dout": p["dout"], "tok": r.tok, "pos": r.pos, "ws": ws, "gate_up": p["gate_up"], "down": p["down"],
        **{k: fwd[k] for k in ("xr", "gu", "a", "yc")}})
    stage = sum(e.end - e.start for run in (fwd, bwd) for e in run.trace.events
                if e.tags.get("stage") in SWIGLU_STAGES and e.op != "noop")
    return {"out": fwd["out"], **{k: bwd[k] for k in ("dx", "dw", "d_gate_up", "d_down")}}, stage


def measured_fused(quick: bool) -> None:
    shape = dict(tokens=1024 if quick else 2048, hidden=512, intermediate=256, experts=8, top_k=2)
    p = problem(1, **shape, seed=0)
    specs = {fuse: MegaMoESpec(**shape, tile_m=256, fuse_vector=fuse) for fuse in (True, False)}
    for threads in (1, 2):
        ex = ThreadExecutor({"cube": 1, "vector": 1}, intra_op_threads=threads)
        got = {fuse: moe_step(spec, p, ex)[0] for fuse, spec in specs.items()}  # also warms the kernels
        times, stage = {f: [] for f in specs}, {f: [] for f in specs}
        for _ in range(5 if quick else 11):  # alternate, so load changes hit both alike
            for fuse, spec in specs.items():
                t0 = time.perf_counter()
                _, s = moe_step(spec, p, ex)
                times[fuse].append(time.perf_counter() - t0)
                stage[fuse].append(s)
        ratios = sorted(u / f for f, u in zip(times[True], times[False]))
        emit(figure="cpu_fused_swiglu", shape=shape, dtype="float32", tile_m=256, units={"cube": 1, "vector": 1},
             intra_op_threads=threads, fused_s=round(min(times[True]), 5), unfused_s=round(min(times[False]), 5),
             speedup_best=round(min(times[False]) / min(times[True]), 3),
             speedup_median_pair=round(ratios[len(ratios) // 2], 3),
             swiglu_stage_fused_ms=round(min(stage[True]) * 1e3, 3),
             swiglu_stage_unfused_ms=round(min(stage[False]) * 1e3, 3),
             stage_speedup=round(min(stage[False]) / min(stage[True]), 3),
             max_rel_l2_fused_vs_unfused=max(float(rel_l2(got[True][k], got[False][k])) for k in got[True]))


def measured_fused_tiles(quick: bool) -> None:
    """One tile's kernel, fused program vs the unfused op, 1 thread: SwiGLU and its gradient (256 x 256
    over halves of gu), MegaMHC's coefficients (n = 4, 20 Sinkhorn rounds)."""
    from megaloom.graphs.mhc.ops import _coeff_kernel, coeff_attrs, fused_coeff
    from megaloom.graphs.moe.ops import _swiglu_grad_kernel, _swiglu_kernel, swiglu_program
    from megaloom.ops.dvm.fused import fused_kernel

    gen = torch.Generator().manual_seed(0)
    gu, da, a, dgu = (torch.randn(256, n, generator=gen) for n in (512, 256, 256, 512))
    fwd, bwd = swiglu_program(256, 256, "float32"), swiglu_program(256, 256, "float32", backward=True)  # built once
    g, u, dg, du = gu[:, :256], gu[:, 256:], dgu[:, :256], dgu[:, 256:]
    cases = {"swiglu": (lambda: fused_kernel([g, u], [a], **fwd), lambda: _swiglu_kernel([gu], [a])),
             "swiglu_grad": (lambda: fused_kernel([da, g, u], [dg, du], **bwd),
                             lambda: _swiglu_grad_kernel([gu, da], [dgu]))}
    for t in (32, 128):
        raw, inv = torch.randn(t, 24, generator=gen), torch.rand(t, 1, generator=gen) + 0.5
        alpha, bias = torch.rand(3, generator=gen), torch.randn(24, generator=gen)
        outs = [torch.empty(t, 4), torch.empty(t, 4), torch.empty(t, 4, 4)]
        cols, ocols = fused_coeff([raw, inv, alpha, bias], outs)  # the graph's operands, as tensors
        cases[f"mhc_coeff/t{t}"] = (lambda c=cols, o=ocols, at=coeff_attrs(t, 4, 20, 1e-6): fused_kernel(c, o, **at),
                                    lambda i=[raw, inv, alpha, bias], o=outs: _coeff_kernel(i, o))
    for name, (fused, unfused) in cases.items():
        best = interleaved_best({"fused": with_threads(1, fused), "unfused": with_threads(1, unfused)},
                                20 if quick else 100)
        emit(figure="cpu_fused_tile", tile=name, intra_op_threads=1, fused_us=round(best["fused"] * 1e6, 1),
             unfused_us=round(best["unfused"] * 1e6, 1), speedup=round(best["unfused"] / best["fused"], 2))


def simulated_fused(quick: bool) -> None:
    from megaloom.graphs.mhc import MEGAMHC

    moe = dict(tokens=4096, hidden=2048, intermediate=1408 if quick else 9216, experts=8, top_k=2,
               dtype="bfloat16", cube_split=4, wgrad_split=8, routing="balanced")
    mhc = dict(tokens=4096, hidden=2048, dtype="bfloat16", tile_tokens=64)
    for name, builder, base in (("megamoe", MEGAMOE, moe), ("megamhc", MEGAMHC, mhc)):
        for direction in ("fwd", "bwd"):
            runs = {fuse: metrics(Simulator("ascend-910b", policy="priority").run(builder.from_options(
                {**base, "direction": direction, "fuse_vector": fuse})).trace) for fuse in (True, False)}
            emit(figure="sim_fused", profile="ascend-910b", graph=name, shape=base, direction=direction,
                 fused_us=round(runs[True].makespan * 1e6, 1), unfused_us=round(runs[False].makespan * 1e6, 1),
                 gain=round(runs[False].makespan / runs[True].makespan - 1, 4),
                 vector_busy_fused_us=round(runs[True].busy.get("vector", 0) * 1e6, 1),
                 vector_busy_unfused_us=round(runs[False].busy.get("vector", 0) * 1e6, 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("sim", "cpu", "ep", "mxfp8", "fused", "all"), default="all")
    ap.add_argument("--quick", action="store_true", help="smaller shapes, fewer repeats")
    args = ap.parse_args()
    if args.part in ("sim", "all"):
        simulated(args.quick)
    if args.part in ("cpu", "all"):
        measured_cpu(args.quick)
    if args.part in ("ep", "all"):
        measured_ep(args.quick)
    if args.part in ("mxfp8", "all"):
        simulated_mxfp8(args.quick)
    if args.part in ("fused", "all"):
        measured_fused_tiles(args.quick)
        measured_fused(args.quick)
        simulated_fused(args.quick)


if __name__ == "__main__":
    main()
