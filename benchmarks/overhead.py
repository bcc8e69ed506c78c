"""Per-task dispatch overhead of ThreadExecutor against ``dask.threaded.get``, and a chain of
dependent matmuls against a plain Python loop.

Both run the same random DAG of no-op tasks (default 20,000) spread over cube, vector and
comm engine kinds: megaloom with ``kernels="null"`` (dispatch only), dask with a no-op
function per key. Then ``--chain`` (default 5,000) dependent 64x64 fp32 matmuls
(``h <- h @ w``, ping-pong between two tiles of a scratch buffer): ThreadExecutor with one
worker (its dispatch plan cached after the first run) against a plain loop calling the same
matmul kernel on two tensors, in alternating rounds, one torch thread. Prints one JSON line
per figure.

    python benchmarks/overhead.py [--tasks 20000] [--chain 5000] [--repeat 3]

dask is only needed for the side-by-side figure (``pip install dask``); without it the
dask line is skipped with a message.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from megaloom.runtime import TaskGraph, ThreadExecutor
from megaloom.scheduler import parse_units

ENGINES = ("cube", "vector", "comm")


def random_dag(n: int, seed: int = 0, max_preds: int = 3, window: int = 64) -> list[tuple[str, list[int]]]:
    """``(engine, predecessors)`` per task: each task waits for up to ``max_preds`` of the
    ``window`` tasks before it, so the DAG is wide enough to keep every engine busy."""
    rng = random.Random(seed)
    dag = []
    for i in range(n):
        k = rng.randint(0, min(max_preds, i))
        preds = sorted(rng.sample(range(max(0, i - window), i), k)) if k else []
        dag.append((rng.choice(ENGINES), preds))
    return dag


def megaloom_graph(dag: list[tuple[str, list[int]]]) -> TaskGraph:
    g = TaskGraph("overhead")
    tasks = []
    for i, (engine, preds) in enumerate(dag):
        tasks.append(g.task("noop", name=f"t{i}", engine=engine, after=[tasks[p] for p in preds]))
    return g


def _noop(*args) -> None:
    return None


def dask_graph(dag: list[tuple[str, list[int]]]) -> dict:
    return {f"t{i}": (_noop, *[f"t{p}" for p in preds]) for i, (_, preds) in enumerate(dag)}


def matmul_chain(n: int, d: int = 64) -> TaskGraph:
    """``n`` dependent ``d x d`` matmuls: each multiplies the previous result by ``w``."""
    g = TaskGraph("chain")
    x, w = g.input("x", (d, d)), g.input("w", (d, d))
    h, y = g.buffer("h", (2 * d, d)), g.output("y", (d, d))
    src = x
    for i in range(n):
        dst = y if i == n - 1 else h[(i % 2) * d:(i % 2 + 1) * d, :]
        g.task("matmul", [src, w], [dst])
        src = dst
    return g


def chain_figures(n: int, repeat: int) -> None:
    import torch

    from megaloom.runtime.registry import get_op

    torch.set_num_threads(1)
    g = matmul_chain(n)
    g.validate()
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 64, generator=gen), torch.linalg.qr(torch.randn(64, 64, generator=gen))[0]
    kernel = get_op("matmul").kernel

    def loop(same_layout: bool = False) -> torch.Tensor:
        """The plain loop on two tensors, or (``same_layout``) on the two row tiles of one
        (128, 64) tensor, as the graph's scratch buffer lays them out."""
        h = torch.empty(128, 64)
        tiles, src = (h[:64], h[64:]) if same_layout else (torch.empty(64, 64), torch.empty(64, 64)), x
        for i in range(n):
            dst = tiles[i % 2]
            kernel([src, w], [dst])
            src = dst
        return src

    ex = ThreadExecutor({"cube": 1})
    first = time.perf_counter()
    out = ex.run(g, {"x": x, "w": w})["y"]
    first = time.perf_counter() - first
    if not torch.allclose(out, loop(), rtol=1e-4, atol=1e-4):
        raise SystemExit("the executor's chain result differs from the loop's")
    t_loop, t_tiles, t_ex = [], [], []
    for _ in range(repeat):  # interleaved rounds: every candidate sees the same machine load
        t0 = time.perf_counter()
        loop()
        t1 = time.perf_counter()
        ex.run(g, {"x": x, "w": w})
        t2 = time.perf_counter()
        loop(same_layout=True)
        t_tiles.append(time.perf_counter() - t2)
        t_ex.append(t2 - t1)
        t_loop.append(t1 - t0)
    lp, tl, ml = (statistics.median(t) / n for t in (t_loop, t_tiles, t_ex))
    _line(figure="matmul_chain", tasks=n, loop_us_per_task=round(lp * 1e6, 2),
          loop_same_layout_us_per_task=round(tl * 1e6, 2), thread_us_per_task=round(ml * 1e6, 2),
          first_run_us_per_task=round(first / n * 1e6, 2), ratio=round(ml / lp, 3),
          ratio_same_layout=round(ml / tl, 3), best_ratio=round(min(t_ex) / min(t_loop), 3), target_ratio=1.15,
          meets_target=ml / lp <= 1.15)


def _line(**fields) -> None:
    print(json.dumps(fields), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tasks", type=int, default=20_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--chain", type=int, default=5_000, help="dependent matmuls (0: skip)")
    ap.add_argument("--units", default="cube=2,vector=2,comm=1", help="engine units, e.g. cube=2,vector=2,comm=1")
    args = ap.parse_args()
    units = parse_units(args.units)
    workers = sum(units.values())
    dag = random_dag(args.tasks)
    n = len(dag)

    t0 = time.perf_counter()
    g = megaloom_graph(dag)
    g.validate()
    build = time.perf_counter() - t0
    ex = ThreadExecutor(units, kernels="null")
    times = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        res = ex.run(g)
        times.append(time.perf_counter() - t0)
        assert len(res.trace.events) == n
    ml = statistics.median(times) / n
    _line(figure="megaloom_thread_dispatch", tasks=n, units=units, us_per_task=round(ml * 1e6, 2),
          best_us_per_task=round(min(times) / n * 1e6, 2), build_and_validate_s=round(build, 3))
    one = ThreadExecutor({e: 1 for e in units}, kernels="null")
    one.run(g)
    t1 = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        one.run(g)
        t1.append(time.perf_counter() - t0)
    _line(figure="megaloom_thread_dispatch_one_unit_each", tasks=n, us_per_task=round(statistics.median(t1) / n * 1e6, 2),
          target_us_per_task=6, meets_target=statistics.median(t1) / n <= 6e-6)
    if args.chain:
        chain_figures(args.chain, max(args.repeat, 5))

    try:
        import dask
        import dask.threaded
    except ImportError:
        _line(figure="dask_threaded_get", skipped="dask is not installed: pip install dask")
        return
    dsk = dask_graph(dag)
    keys = list(dsk)
    times = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        dask.threaded.get(dsk, keys, num_workers=workers)
        times.append(time.perf_counter() - t0)
    dk = statistics.median(times) / n
    _line(figure="dask_threaded_get", tasks=n, num_workers=workers, us_per_task=round(dk * 1e6, 2),
          best_us_per_task=round(min(times) / n * 1e6, 2), dask=dask.__version__)
    _line(figure="dask_over_megaloom", ratio=round(dk / ml, 1), target_ratio=20, target_us_per_task=10,
          meets_targets=bool(ml <= 10e-6 and dk / ml >= 20))


if __name__ == "__main__":
    main()
