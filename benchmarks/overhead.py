"""Per-task dispatch overhead of ThreadExecutor against ``dask.threaded.get``.

Both run the same random DAG of no-op tasks (default 20,000) spread over cube, vector and
comm engine kinds: megaloom with ``kernels="null"`` (dispatch only), dask with a no-op
function per key. Prints one JSON line per figure; the last line holds the ratio.

    python benchmarks/overhead.py [--tasks 20000] [--repeat 3]

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


def _line(**fields) -> None:
    print(json.dumps(fields), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tasks", type=int, default=20_000)
    ap.add_argument("--repeat", type=int, default=3)
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
