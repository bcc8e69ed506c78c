"""Load + validate time of saved graphs against their size: is it linear?

Two shapes that used to be quadratic, at each size (default 10k, 100k, 1M tasks):

* ``chain``: one ``(4, 4)`` accumulator updated in place by every task (``acc += x``), so
  every task reads and writes the same region (ancestor sets made validation of the
  loaded file quadratic);
* ``columns``: an ``(8, n)`` buffer copied one column per task (tiles along dim 1, which
  the box index used to scan one by one);
* ``indirect``: a crafted file: task 0 writes a scratch tile that every other task reads, and
  the stored edges order each reader only after the task before it (a chain), so each read
  is ordered after its writer indirectly (checking that used to search the chain per read).

Side by side in one run, per size: building the graph with the builder (edges derived)
and validating it, against saving it, loading the file and validating the loaded graph
(stored edges checked by replaying derivation). Each figure is the best of ``--repeat``
runs (process CPU time; wall time alongside, the machine may be shared); ``per_task_us``
should stay flat as the size grows, and ``vs_smallest`` (per-task cost over that of the
smallest size) near 1.

    python benchmarks/loading.py [--sizes 10000,100000,1000000] [--repeat 1]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time

import megaloom.ops  # noqa: F401  (registers the built-in ops)
from megaloom.runtime import TaskGraph


def chain(n: int) -> TaskGraph:
    g = TaskGraph("chain")
    x, acc = g.input("x", (4, 4)), g.output("acc", (4, 4))
    g.task("copy", [x], [acc])
    for _ in range(n - 1):
        g.task("add", [acc, x], [acc])
    return g


def columns(n: int) -> TaskGraph:
    g = TaskGraph("columns")
    x, y = g.input("x", (8, n)), g.output("y", (8, n))
    for a in range(n):
        g.task("copy", [x[:, a:a + 1]], [y[:, a:a + 1]])
    return g


def indirect(n: int) -> TaskGraph:
    g = TaskGraph("indirect")
    x, h, y = g.input("x", (1, 4)), g.buffer("h", (1, 4)), g.output("y", (n - 1, 4))
    g.task("copy", [x], [h])
    for i in range(n - 1):
        g.task("copy", [h], [y[i:i + 1, :]])
    g.set_edges([[]] + [[i] for i in range(n - 1)])  # as the crafted file states them
    return g


def _timed(fn):
    gc.collect()  # the previous graph's cycles are freed here, not inside the next figure
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w, time.process_time() - c


def measure(make, n: int, path: str) -> dict[str, float]:
    g, bw, bc = _timed(lambda: make(n))
    _, vw, vc = _timed(g.validate)
    _, sw, sc = _timed(lambda: g.save(path))
    del g
    h, lw, lc = _timed(lambda: TaskGraph.load(path))
    _, lvw, lvc = _timed(h.validate)
    return {"build_validate_cpu_s": bc + vc, "build_validate_wall_s": bw + vw, "save_cpu_s": sc,
            "load_validate_cpu_s": lc + lvc, "load_validate_wall_s": lw + lvw,
            "load_cpu_s": lc, "loaded_validate_cpu_s": lvc, "file_mb": os.path.getsize(path) / 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="10000,100000,1000000")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--shapes", default="chain,columns,indirect")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory() as d:
        for name in args.shapes.split(","):
            make = {"chain": chain, "columns": columns, "indirect": indirect}[name]
            first = None
            for n in sizes:
                runs = [measure(make, n, os.path.join(d, f"{name}.mlg")) for _ in range(args.repeat)]
                best = {k: min(r[k] for r in runs) for k in runs[0]}
                per_task = best["load_validate_cpu_s"] / n * 1e6
                first = first or per_task
                print(json.dumps({"bench": f"loading.{name}", "tasks": n, **{k: round(v, 3) for k, v in best.items()},
                                  "per_task_us": round(per_task, 2), "vs_smallest": round(per_task / first, 2),
                                  "load_vs_build": round(best["load_validate_cpu_s"] / best["build_validate_cpu_s"], 2)}),
                      flush=True)


if __name__ == "__main__":
    main()
