"""All-to-all overlapped with matmuls vs the same tasks one after the other, on gloo ranks.

    overlapped:  comm  a2a0 -> a2a1 -> ... -> a2aK      (chained: same order on every rank)
                 cube  mm0   mm1   ...   mmM            (independent of the comm tasks)
    sequential:  a2a0 -> mm0 -> a2a1 -> mm1 -> ...      (one chain through every task)

Each rank runs both graphs on a ThreadExecutor (1 cube unit, 1 comm unit, 1 torch
thread), alternating, after a warm-up; figures are medians over repeats, averaged over
ranks. ``comm_hidden_fraction`` is the share of comm task time that overlapped compute
(``megaloom.runtime.metrics``); ``comm_time_s`` shows how much the comm tasks stretch
when they share the CPU with matmuls. Prints one JSON line per figure:

    python benchmarks/comm.py [--ranks 4] [--repeats 5] [--rows 2048] [--cols 256] [--mm 512]
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

from megaloom.comm.ops import chain
from megaloom.comm.spawn import run_world
from megaloom.runtime import ExecContext, TaskGraph, ThreadExecutor, metrics


def build(world: int, chunks: int, rows: int, cols: int, mm: int, mms: int, sequential: bool) -> TaskGraph:
    g = TaskGraph("a2a-overlap" + ("-seq" if sequential else ""))
    per = rows // world
    a2a, mats = [], []
    for i in range(chunks):
        send, recv = g.input(f"send{i}", (rows, cols)), g.output(f"recv{i}", (rows, cols))
        a2a.append(g.task("all_to_all", [send], [recv], name=f"a2a{i}",
                          attrs={"send_splits": [per] * world, "recv_splits": [per] * world}))
    w = g.input("w", (mm, mm))
    for j in range(mms):
        x, y = g.input(f"x{j}", (mm, mm)), g.output(f"y{j}", (mm, mm))
        mats.append(g.task("matmul", [x, w], [y], name=f"mm{j}"))
    if sequential:
        order = [t for pair in zip(a2a, mats) for t in pair] + a2a[len(mats):] + mats[len(a2a):]
        chain(*order)
    else:
        chain(*a2a)
    return g


def rank_main(comm, chunks: int, rows: int, cols: int, mm: int, mms: int, repeats: int) -> dict:
    torch.manual_seed(comm.rank)
    ctx = ExecContext(rank=comm.rank, world_size=comm.world_size, comm=comm)
    ex = ThreadExecutor({"cube": 1, "comm": 1}, ctx=ctx, intra_op_threads=1)
    graphs = {s: build(comm.world_size, chunks, rows, cols, mm, mms, s) for s in (False, True)}
    inputs = {b.name: torch.randn(b.shape) for b in graphs[False].inputs}
    runs: dict[bool, list] = {False: [], True: []}
    for i in range(repeats + 1):
        for seq in (True, False):
            comm.barrier()
            res = ex.run(graphs[seq], inputs)
            if i:  # the first round is warm-up
                m = metrics(res.trace)
                runs[seq].append((m.makespan, m.comm_time, m.comm_hidden))
    med = {s: [statistics.median(v[k] for v in runs[s]) for k in range(3)] for s in runs}
    return {"seq": med[True][0], "overlap": med[False][0], "comm_seq": med[True][1], "comm": med[False][1],
            "hidden": med[False][2], "hidden_seq": med[True][2]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--chunks", type=int, default=4, help="all-to-all tasks per graph")
    p.add_argument("--rows", type=int, default=2048, help="rows of each all-to-all send buffer")
    p.add_argument("--cols", type=int, default=256)
    p.add_argument("--mm", type=int, default=512, help="matmul size (mm x mm @ mm x mm)")
    p.add_argument("--mms", type=int, default=8, help="matmul tasks per graph")
    a = p.parse_args()
    res = run_world(rank_main, a.ranks, a.chunks, a.rows, a.cols, a.mm, a.mms, a.repeats,
                    timeout=600, comm_timeout=120)
    avg = {k: sum(r[k] for r in res) / len(res) for k in res[0]}
    shape = {"ranks": a.ranks, "a2a_tasks": a.chunks, "a2a_bytes_per_rank": a.rows * a.cols * 4,
             "matmuls": a.mms, "matmul": a.mm}
    print(json.dumps({"figure": "makespan_sequential_s", "value": round(avg["seq"], 5), **shape}))
    print(json.dumps({"figure": "makespan_overlapped_s", "value": round(avg["overlap"], 5), **shape}))
    print(json.dumps({"figure": "speedup_overlapped_vs_sequential", "value": round(avg["seq"] / avg["overlap"], 3), **shape}))
    print(json.dumps({"figure": "comm_time_s", "overlapped": round(avg["comm"], 5), "sequential": round(avg["comm_seq"], 5), **shape}))
    print(json.dumps({"figure": "comm_hidden_fraction", "overlapped": round(avg["hidden"], 3),
                      "sequential": round(avg["hidden_seq"], 3), **shape}))


if __name__ == "__main__":
    main()
