"""Expert-parallel MegaMoE on real ranks, checked against the golden block.

:func:`ep_check` is meant for :func:`megaloom.comm.spawn.run_world`: every rank builds
the same seeded global problem, runs its share through :class:`MegaMoE` (forward and
backward over the communicator) and compares with :func:`moe_reference` on all tokens
with all experts. It returns relative L2 errors, timings and comm overlap (msgpack-safe).
"""
from __future__ import annotations

import time
from typing import Any

import torch

from megaloom.graphs.moe.module import MegaMoE
from megaloom.graphs.moe.reference import moe_reference
from megaloom.runtime.dtypes import torch_dtype
from megaloom.runtime.metrics import metrics
from megaloom.runtime.testing import rel_l2

SPEC_OPTIONS = ("tile_m", "cube_split", "wgrad_split", "schedule", "group_size", "comm_tile")


def problem(world: int, tokens: int, hidden: int, intermediate: int, experts: int, top_k: int,
            dtype: str = "float32", seed: int = 0, idle: int = 0) -> dict[str, torch.Tensor]:
    """A seeded global problem: per-rank tokens stacked, top-k ids avoiding the last
    ``idle`` experts (so some get no rows), weights, gradient of the output, all experts."""
    gen = torch.Generator().manual_seed(seed)
    dt = torch_dtype(dtype)
    T = world * tokens
    live = experts - idle
    ids = torch.stack([torch.randperm(live, generator=gen)[:top_k] for _ in range(T)])
    return {
        "x": torch.randn(T, hidden, generator=gen).to(dt),
        "ids": ids,
        "w": torch.rand(T, top_k, generator=gen).to(dt),
        "dout": torch.randn(T, hidden, generator=gen).to(dt),
        "gate_up": (torch.randn(experts, hidden, 2 * intermediate, generator=gen) / hidden ** 0.5).to(dt),
        "down": (torch.randn(experts, intermediate, hidden, generator=gen) / intermediate ** 0.5).to(dt),
    }


def ep_check(comm: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    """Run ``cfg`` (problem() keys, spec options such as ``schedule`` or ``tile_m``, ``executor``,
    ``units``, ``policy``, ``repeat``, ``reroute``: a new problem (routing) each repeat, ``check``) on
    this rank: errors of the last run vs the golden block, best fwd+bwd seconds over ``repeat`` runs,
    comm time and overlap of the latest runs, graphs built."""
    world, rank = comm.world_size, comm.rank
    shape = {k: cfg[k] for k in ("tokens", "hidden", "intermediate", "experts", "top_k")}
    p = problem(world, **shape, dtype=cfg.get("dtype", "float32"), seed=cfg.get("seed", 0), idle=cfg.get("idle", 0))
    el, T = shape["experts"] // world, shape["tokens"]
    mine = slice(rank * T, (rank + 1) * T)
    options = {k: cfg[k] for k in SPEC_OPTIONS if k in cfg}
    moe = MegaMoE(shape["hidden"], shape["intermediate"], shape["experts"], shape["top_k"], comm=comm,
                  dtype=p["x"].dtype, units=cfg.get("units"), policy=cfg.get("policy"),
                  executor=cfg.get("executor", "thread"), **options)
    with torch.no_grad():
        moe.gate_up.copy_(p["gate_up"][rank * el:(rank + 1) * el])
        moe.down.copy_(p["down"][rank * el:(rank + 1) * el])
    best = float("inf")
    for i in range(max(1, cfg.get("repeat", 1))):
        if i and cfg.get("reroute"):
            p = {**problem(world, **shape, dtype=cfg.get("dtype", "float32"), seed=cfg.get("seed", 0) + i,
                           idle=cfg.get("idle", 0)), "gate_up": p["gate_up"], "down": p["down"]}
        moe.zero_grad(set_to_none=True)
        x, w = (p[k][mine].clone().requires_grad_() for k in ("x", "w"))
        comm.barrier()
        t0 = time.perf_counter()
        y = moe(x, p["ids"][mine], w)
        y.backward(p["dout"][mine])
        best = min(best, time.perf_counter() - t0)
    out: dict[str, Any] = {"rank": rank, "seconds": best, "builds": moe.runner.builds}
    for d, tr in moe.runner.last_trace.items():
        m = metrics(tr)
        out[d] = {"makespan": m.makespan, "comm_time": m.comm_time, "comm_hidden": m.comm_hidden}
    if cfg.get("check", True):
        ref = {k: p[k].clone().requires_grad_() for k in ("x", "w", "gate_up", "down")}
        r = moe_reference(ref["x"], p["ids"], ref["w"], ref["gate_up"], ref["down"])
        r.backward(p["dout"])
        experts = slice(rank * el, (rank + 1) * el)
        out["errors"] = {
            "out": rel_l2(y, r[mine]), "dx": rel_l2(x.grad, ref["x"].grad[mine]),
            "dw": rel_l2(w.grad, ref["w"].grad[mine]),
            "d_gate_up": rel_l2(moe.gate_up.grad, ref["gate_up"].grad[experts]),
            "d_down": rel_l2(moe.down.grad, ref["down"].grad[experts]),
        }
    return out
