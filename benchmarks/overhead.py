"""Per-task dispatch overhead of ThreadExecutor against a bare thread pool and ``dask.threaded.get``,
and a chain of dependent matmuls against a plain torch loop; cold (first run) and warm apart.

Dispatch: the same random DAG of no-op tasks (default 20,000) spread over cube, vector and comm
engine kinds, run by

- ``megaloom``: ``ThreadExecutor(units, kernels="null")`` (dispatch and the trace, no kernels);
- ``bare_pool``: the peer a user would write, persistent threads (as many as megaloom's units)
  around one lock, one ready deque and per-task dependency counters, no engine kinds, no trace;
- ``dask``: ``dask.threaded.get`` with a no-op function per key (in the first ``--dask-rounds``
  rounds only; skipped without dask).

Chain: ``--chain`` (default 5,000) dependent 64x64 fp32 matmuls (``h <- h @ w``, ping-pong between
two row tiles of a scratch buffer), ``ThreadExecutor({"cube": 1})`` against a plain torch loop
(``torch.mm(h, w, out=...)`` on two tensors, and on the two row tiles of one tensor as the graph
lays them out), one torch thread.

Every candidate runs once cold (megaloom: on a graph it has not run; the bare pool: starting its
threads), then ``--repeat`` interleaved rounds time each candidate once per round (warm). One JSON
line per figure: medians and ranges of the rounds, per task.

    python benchmarks/overhead.py [--tasks 20000] [--chain 5000] [--repeat 9] [--units cube=2,vector=2,comm=1]
                                  [--dask-rounds 3]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
from collections import deque
from typing import Callable

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


class BarePool:
    """``workers`` persistent threads around one condition: a ready deque and dependency counters."""

    def __init__(self, workers: int):
        self.cv = threading.Condition(threading.Lock())
        self.ready: deque[int] = deque()
        self.waiting = self.left = 0
        self.done = threading.Event()
        for _ in range(workers):
            threading.Thread(target=self._work, daemon=True).start()

    def run(self, succ: list[list[int]], preds: list[int], fn: Callable[[int], None]) -> None:
        with self.cv:
            self.succ, self.unmet, self.fn, self.left = succ, list(preds), fn, len(preds)
            self.done.clear()
            self.ready.extend(t for t, n in enumerate(preds) if n == 0)
            self.cv.notify_all()
        self.done.wait()

    def _work(self) -> None:
        cv, ready = self.cv, self.ready
        cv.acquire()
        while True:
            while not ready:
                self.waiting += 1
                cv.wait()
                self.waiting -= 1
            t = ready.popleft()
            if ready and self.waiting:
                cv.notify()
            cv.release()
            self.fn(t)
            cv.acquire()
            unmet = self.unmet
            for s in self.succ[t]:
                unmet[s] -= 1
                if unmet[s] == 0:
                    ready.append(s)
            self.left -= 1
            if not self.left:
                self.done.set()
            elif ready and self.waiting:
                cv.notify()


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _line(**fields) -> None:
    print(json.dumps(fields), flush=True)


def _us(seconds: float, n: int) -> float:
    return round(seconds / n * 1e6, 3)


def rounds(candidates: dict[str, Callable[[], object]], repeat: int, few: dict[str, int] | None = None
           ) -> dict[str, list[float]]:
    """Seconds per call of each candidate, ``repeat`` interleaved rounds (each round times every one once;
    a candidate in ``few`` only in that many first rounds)."""
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for r in range(repeat):
        for name, fn in candidates.items():
            if r < (few or {}).get(name, repeat):
                times[name].append(_timed(fn))
    return times


def summary(times: dict[str, list[float]], n: int, base: str) -> dict:
    """Per-task median and range of each candidate timed at least once, and its median over the baseline's."""
    times = {name: ts for name, ts in times.items() if ts}
    med = {name: statistics.median(ts) for name, ts in times.items()}
    return {name: {"us_per_task": _us(med[name], n), "range_us": [_us(min(ts), n), _us(max(ts), n)],
                   f"vs_{base}": round(med[name] / med[base], 3)} for name, ts in times.items()}


def dispatch_figures(dag: list[tuple[str, list[int]]], units: dict[str, int], repeat: int, dask_rounds: int) -> None:
    n, workers = len(dag), sum(units.values())
    succ: list[list[int]] = [[] for _ in dag]
    for i, (_, preds) in enumerate(dag):
        for p in preds:
            succ[p].append(i)
    preds = [len(p) for _, p in dag]
    t0 = time.perf_counter()
    g = megaloom_graph(dag)
    g.validate()
    build = time.perf_counter() - t0
    ex = ThreadExecutor(units, kernels="null")
    candidates: dict[str, Callable[[], object]] = {"megaloom": lambda: ex.run(g)}
    cold = {"megaloom": _timed(candidates["megaloom"])}
    pool: list[BarePool] = []
    cold["bare_pool"] = _timed(lambda: pool.append(BarePool(workers)) or pool[0].run(succ, preds, _noop))
    candidates["bare_pool"] = lambda: pool[0].run(succ, preds, _noop)
    try:
        import dask
        import dask.threaded

        dsk, keys = dask_graph(dag), [f"t{i}" for i in range(n)]
        candidates["dask"] = lambda: dask.threaded.get(dsk, keys, num_workers=workers)
        cold["dask"] = _timed(candidates["dask"])
    except ImportError:
        _line(figure="dask_threaded_get", skipped="dask is not installed: pip install dask")
    if len(ex.run(g).trace.events) != n:
        raise SystemExit("the executor's trace misses tasks")
    warm = summary(rounds(candidates, repeat, {"dask": dask_rounds}), n, "bare_pool")
    _line(figure="thread_dispatch", tasks=n, units=units, threads=workers, rounds=repeat, warm=warm,
          cold_us_per_task={k: _us(v, n) for k, v in cold.items()}, build_and_validate_s=round(build, 3),
          target_vs_bare_pool=1.2, meets_target=warm["megaloom"]["vs_bare_pool"] <= 1.2)


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

    torch.set_num_threads(1)
    g = matmul_chain(n)
    g.validate()
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 64, generator=gen), torch.linalg.qr(torch.randn(64, 64, generator=gen))[0]

    def loop(same_layout: bool = False) -> torch.Tensor:
        """The plain torch loop on two tensors, or (``same_layout``) on the two row tiles of one
        (128, 64) tensor, as the graph's scratch buffer lays them out."""
        h = torch.empty(128, 64)
        tiles, src = (h[:64], h[64:]) if same_layout else (torch.empty(64, 64), torch.empty(64, 64)), x
        for i in range(n):
            dst = tiles[i % 2]
            torch.mm(src, w, out=dst)
            src = dst
        return src

    ex = ThreadExecutor({"cube": 1})
    candidates = {"loop": loop, "loop_same_layout": lambda: loop(True), "megaloom": lambda: ex.run(g, {"x": x, "w": w})}
    cold = {name: _timed(fn) for name, fn in candidates.items()}
    if not torch.allclose(ex.run(g, {"x": x, "w": w})["y"], loop(), rtol=1e-4, atol=1e-4):
        raise SystemExit("the executor's chain result differs from the loop's")
    warm = summary(rounds(candidates, repeat), n, "loop")
    _line(figure="matmul_chain", tasks=n, rounds=repeat, warm=warm, cold_us_per_task={k: _us(v, n) for k, v in cold.items()},
          target_vs_loop=1.15, meets_target=warm["megaloom"]["vs_loop"] <= 1.15)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tasks", type=int, default=20_000)
    ap.add_argument("--repeat", type=int, default=9, help="interleaved rounds")
    ap.add_argument("--chain", type=int, default=5_000, help="dependent matmuls (0: skip)")
    ap.add_argument("--units", default="cube=2,vector=2,comm=1", help="engine units, e.g. cube=2,vector=2,comm=1")
    ap.add_argument("--dask-rounds", type=int, default=3, help="rounds that time dask too (it takes seconds a run)")
    args = ap.parse_args()
    dispatch_figures(random_dag(args.tasks), parse_units(args.units), args.repeat, args.dask_rounds)
    if args.chain:
        chain_figures(args.chain, args.repeat)


if __name__ == "__main__":
    main()
