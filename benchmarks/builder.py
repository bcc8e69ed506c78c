"""Build rate and memory of a 1,000,000-task random DAG: ``TaskGraph.from_arrays`` beside a plain
dask graph dict and a networkx DiGraph of the same DAG, and ``TaskGraph.task()`` one by one.

Side by side in one run, on the same DAG (each task waits for 0-4 of the 64 tasks before it,
about 2 on average; a random engine kind of three and one of 24 costs per task):

* ``builder.from_arrays``: ``TaskGraph.from_arrays`` from NumPy columns (op and engine codes,
  cost codes into a table of 24 ``Cost`` objects, CSR predecessors); the target is >= 1M
  tasks/s and <= 150 bytes/task;
* ``builder.from_arrays.lists``: the same from Python lists (engine names and ``Cost`` objects
  per task, a list of predecessors per task), as code without NumPy columns would give;
* ``baseline.dask_dict``: ``{"t<i>": (func, "t<p>", ...)}``, dask's graph format, from Python
  lists of predecessors (made beforehand, untimed);
* ``baseline.networkx``: ``nx.DiGraph`` with every node and edge, from Python lists of edges
  (made beforehand, untimed);
* ``builder.task``: ``TaskGraph.task(op, engine=..., cost=..., after=[...])`` per task (the
  returned tasks kept in a list, as a builder keeps them to name predecessors), on the first
  ``--task-tasks`` tasks (checked identical to ``from_arrays`` of the same columns), and
  ``builder.task_vs_dask_dict``: it and the dask graph dict of the same tasks in interleaved
  rounds (each round builds each once; median and range of the CPU-time rates over ``--repeat``);
* ``graph.validate``: ``validate()`` of the array-built graph, then again (remembered);
* ``graph.arrays``: ``arrays()`` of the array-built graph (the columns the simulator reads).

Times are the best of ``--repeat`` builds (wall and process CPU; the machine may be shared);
bytes per task are what the built graph holds (tracemalloc, in a separate build). One JSON
line per figure; ``ratio.*`` lines compare from_arrays with the baselines.

    python benchmarks/builder.py [--tasks 1000000] [--task-tasks 200000] [--repeat 3]

dask and networkx (``pip install -e .[bench]``) are only needed for their lines.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
import tracemalloc

import numpy as np

import megaloom.ops  # noqa: F401  (registers the built-in ops)
from megaloom.runtime import Cost, TaskGraph
from megaloom.runtime.serialize import graph_to_dict

ENGINES = ["cube", "vector", "comm"]
COSTS = ([Cost(flops=2.0 * m * 128 * 128, bytes=2.0 * (2 * m * 128 + 128 * 128), precision="bf16")
          for m in (16, 32, 64, 128, 256, 512, 1024, 2048)]
         + [Cost(flops=4.0 * m * 128, bytes=4.0 * m * 128, precision="bf16") for m in range(64, 64 * 9, 64)]
         + [Cost(comm_bytes=2.0 * m * 128) for m in range(256, 256 * 9, 256)])


def random_dag(n: int, seed: int = 0, max_preds: int = 4, window: int = 64) -> dict[str, np.ndarray]:
    """Columns of ``n`` tasks: engine and cost codes, and CSR predecessors (ascending ids), each
    task waiting for 0..``max_preds`` distinct tasks among the ``window`` before it."""
    rng = np.random.default_rng(seed)
    k = rng.integers(0, max_preds + 1, n)
    back = np.cumsum(rng.integers(1, window // max_preds + 1, (n, max_preds)), axis=1)[:, ::-1]
    ids = np.arange(n)[:, None] - back
    keep = (np.arange(max_preds)[::-1] < k[:, None]) & (ids >= 0)
    indptr = np.zeros(n + 1, np.int64)
    np.cumsum(keep.sum(axis=1), out=indptr[1:])
    return {"indptr": indptr, "indices": ids[keep], "engine": rng.integers(0, 3, n).astype(np.int8),
            "cost": rng.integers(0, len(COSTS), n).astype(np.int8)}


def from_arrays(dag: dict[str, np.ndarray], n: int | None = None) -> TaskGraph:
    if n is not None:  # the first n tasks (edges only point back, so they stand alone)
        dag = {"indptr": dag["indptr"][:n + 1], "indices": dag["indices"][:dag["indptr"][n]],
               "engine": dag["engine"][:n], "cost": dag["cost"][:n]}
    m = len(dag["engine"])
    return TaskGraph.from_arrays((["noop"], np.zeros(m, np.int8)), (dag["indptr"], dag["indices"]),
                                 engines=(ENGINES, dag["engine"]), costs=(COSTS, dag["cost"]), name="bench-builder")


def by_task(engine: list[int], cost: list[int], preds: list[list[int]]) -> TaskGraph:
    g = TaskGraph("bench-builder")
    tasks = []
    for e, c, ps in zip(engine, cost, preds):
        tasks.append(g.task("noop", engine=ENGINES[e], cost=COSTS[c], after=[tasks[p] for p in ps]))
    return g


def _noop(*args) -> None:
    return None


def dask_dict(preds: list[list[int]]) -> dict:
    return {f"t{i}": (_noop, *[f"t{p}" for p in ps]) for i, ps in enumerate(preds)}


def networkx_graph(n: int, edges: list[tuple[int, int]]):
    import networkx as nx

    g = nx.DiGraph()
    g.add_nodes_from(range(n))
    g.add_edges_from(edges)
    return g


def measure(build, repeat: int) -> tuple[float, float, float]:
    """(best wall s, best CPU s, bytes held by the result) of ``build()``."""
    best_wall = best_cpu = float("inf")
    for _ in range(repeat):
        gc.collect()
        w, c = time.perf_counter(), time.process_time()
        result = build()
        best_wall, best_cpu = min(best_wall, time.perf_counter() - w), min(best_cpu, time.process_time() - c)
        del result
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    result = build()
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    del result
    return best_wall, best_cpu, held


def emit(figure: str, n: int, wall: float, cpu: float, held: float | None = None, **extra) -> dict:
    line = {"figure": figure, "tasks": n, "wall_s": round(wall, 4), "cpu_s": round(cpu, 4),
            "tasks_per_s_wall": round(n / wall), "tasks_per_s_cpu": round(n / cpu)}
    if held is not None:
        line["bytes_per_task"] = round(held / n, 1)
    line.update(extra)
    print(json.dumps(line), flush=True)
    return line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=1_000_000)
    ap.add_argument("--task-tasks", type=int, default=200_000, help="tasks built one by one with TaskGraph.task()")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    n = args.tasks
    print(json.dumps({"figure": "machine", "cpus": os.cpu_count(), "load_avg": os.getloadavg()}), flush=True)
    dag = random_dag(n)
    edges = len(dag["indices"])
    preds = [ps.tolist() for ps in np.split(dag["indices"], dag["indptr"][1:-1])]

    wall, cpu, held = measure(lambda: from_arrays(dag), args.repeat)
    ours = emit("builder.from_arrays", n, wall, cpu, held, edges=edges, target_tasks_per_s=1_000_000,
                target_bytes_per_task=150, meets_target=n / cpu >= 1_000_000 and held / n <= 150)
    engines, costs = [ENGINES[e] for e in dag["engine"].tolist()], [COSTS[c] for c in dag["cost"].tolist()]
    wall, cpu, held = measure(lambda: TaskGraph.from_arrays("noop", preds, engines=engines, costs=costs), args.repeat)
    emit("builder.from_arrays.lists", n, wall, cpu, held)
    g = from_arrays(dag)
    w, c = time.perf_counter(), time.process_time()
    g.validate()
    emit("graph.validate", n, time.perf_counter() - w, time.process_time() - c)
    w = time.perf_counter()
    g.validate()
    print(json.dumps({"figure": "graph.validate.again", "tasks": n, "wall_us": round((time.perf_counter() - w) * 1e6, 1),
                      "remembered": g.validated}), flush=True)
    w, c = time.perf_counter(), time.process_time()
    g.arrays()
    emit("graph.arrays", n, time.perf_counter() - w, time.process_time() - c)
    del g

    m = min(args.task_tasks, n)
    engine, cost = dag["engine"][:m].tolist(), dag["cost"][:m].tolist()
    wall, cpu, held = measure(lambda: by_task(engine, cost, preds[:m]), 1)
    same = graph_to_dict(by_task(engine, cost, preds[:m])) == graph_to_dict(from_arrays(dag, m))
    emit("builder.task", m, wall, cpu, held, identical_to_from_arrays=same)
    rates: dict[str, list[float]] = {"task": [], "dask_dict": []}
    for _ in range(args.repeat):  # interleaved rounds: both see the same machine load
        for k, build in (("task", lambda: by_task(engine, cost, preds[:m])), ("dask_dict", lambda: dask_dict(preds[:m]))):
            gc.collect()
            w = time.process_time()  # CPU time: the machine may be shared
            build()
            rates[k].append(m / (time.process_time() - w))
    ratio = [a / b for a, b in zip(rates["task"], rates["dask_dict"])]
    print(json.dumps({"figure": "builder.task_vs_dask_dict", "tasks": m, "rounds": args.repeat,
                      **{f"{k}_tasks_per_s": {"median": round(statistics.median(v)), "range": [round(min(v)), round(max(v))]}
                         for k, v in rates.items()},
                      "ratio": {"median": round(statistics.median(ratio), 3), "range": [round(min(ratio), 3),
                                                                                         round(max(ratio), 3)]},
                      "target_ratio": 1.0, "load_avg": os.getloadavg()}), flush=True)

    for figure, build, module in [("baseline.dask_dict", lambda: dask_dict(preds), "dask"),
                                  ("baseline.networkx", None, "networkx")]:
        try:
            mod = __import__(module)
        except ImportError:
            print(json.dumps({"figure": figure, "skipped": f"{module} is not installed"}), flush=True)
            continue
        if build is None:
            pairs = [(p, i) for i, ps in enumerate(preds) for p in ps]
            build = lambda: networkx_graph(n, pairs)  # noqa: E731
        wall, cpu, held = measure(build, args.repeat)
        emit(figure, n, wall, cpu, held, version=mod.__version__)
        print(json.dumps({"figure": f"ratio.from_arrays_vs_{module}", "speedup_cpu": round(cpu / ours["cpu_s"], 2),
                          "speedup_wall": round(wall / ours["wall_s"], 2),
                          "memory_fraction": round(ours["bytes_per_task"] / (held / n), 3)}), flush=True)


if __name__ == "__main__":
    main()
