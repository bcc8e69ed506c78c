"""The discrete-event Simulator on a >= 1,000,000-task graph against a heapq list scheduler:
end to end from the graph's columns, cold and warm, and peak memory.

Every candidate works from the same random DAG given as columns (CSR predecessors, an engine
code and a cost code per task: what a generator hands over), with the same durations:

* ``end_to_end.megaloom``: ``TaskGraph.from_arrays`` of the columns, then ``Simulator.run``
  (validate, durations, event loop, trace columns): ``cold`` on the new graph, ``warm``
  a second run on the same graph;
* ``end_to_end.heapq``: a ~40-line stand-alone heapq list scheduler as a user would write it:
  Python lists from the same columns (successor lists, unmet counts, engine per task, a
  duration per task from a table of the cost model's duration per cost code), then its loop
  (``warm``: the loop alone, given those lists). Its start, unit and dispatch order per task
  must equal the simulator's (checked every round);
* ``end_to_end.megaloom_task``: the same graph built with ``TaskGraph.task()`` one by one,
  then ``Simulator.run`` (one round: the builder dominates);
* ``memory``: peak RSS of a fresh process that builds and simulates the graph with each
  candidate, alone (``--memory-sizes``), and its peak above the RSS after imports;
* ``loops``: the simulator's Python loop against its compiled loop (identical schedule
  checked), each on the durations alone.

The end-to-end candidates run in interleaved rounds (each round times each once, the order
alternating); medians and ranges of wall time over ``--rounds``, process CPU time beside.
One JSON line per figure.

    python benchmarks/simulator.py [--tasks 1000000] [--rounds 5] [--memory-sizes 1000000,4000000]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections import deque
from heapq import heappop, heappush

import numpy as np

import builder
from builder import COSTS, ENGINES
from megaloom.runtime import TaskGraph
from megaloom.scheduler import Simulator

PROFILE = "ascend-910b"


def random_dag(n: int) -> dict[str, np.ndarray]:
    """Columns of ``n`` tasks (:func:`builder.random_dag`: each task waits for 0-3 of the 64
    before it), with a cost code among the 8 of its engine kind."""
    dag = builder.random_dag(n, max_preds=3)
    dag["cost"] = (dag["engine"] * 8 + dag["cost"] % 8).astype(np.int8)
    return dag


def megaloom_graph(dag: dict[str, np.ndarray]) -> TaskGraph:
    n = len(dag["engine"])
    return TaskGraph.from_arrays((["noop"], np.zeros(n, np.int8)), (dag["indptr"], dag["indices"]),
                                 engines=(ENGINES, dag["engine"]), costs=(COSTS, dag["cost"]), name="bench-sim")


def task_graph(dag: dict[str, np.ndarray]) -> TaskGraph:
    """The same graph added task by task."""
    g = TaskGraph("bench-sim")
    tasks, ptr, idx = g.tasks, dag["indptr"].tolist(), dag["indices"].tolist()
    for i, (e, c) in enumerate(zip(dag["engine"].tolist(), dag["cost"].tolist())):
        g.task("noop", engine=ENGINES[e], cost=COSTS[c], after=[tasks[p] for p in idx[ptr[i]:ptr[i + 1]]])
    return g


def heapq_lists(dag: dict[str, np.ndarray], cost_seconds: list[float]):
    """What a heapq scheduler needs, as Python lists: successors, unmet counts, engine, duration."""
    ptr, idx = dag["indptr"].tolist(), dag["indices"].tolist()
    n = len(ptr) - 1
    succ: list[list[int]] = [[] for _ in range(n)]
    unmet = [0] * n
    for b in range(n):
        preds = idx[ptr[b]:ptr[b + 1]]
        unmet[b] = len(preds)
        for a in preds:
            succ[a].append(b)
    engine = [ENGINES[e] for e in dag["engine"].tolist()]
    dur = [cost_seconds[c] for c in dag["cost"].tolist()]
    return succ, unmet, engine, dur


def heapq_schedule(succ, unmet, engine, dur, units: dict[str, int]):
    """The FIFO list schedule with inline counters and deques: (start, unit, order) per task."""
    unmet = list(unmet)
    ready = {e: deque() for e in units}
    for tid, k in enumerate(unmet):
        if k == 0:
            ready[engine[tid]].append(tid)
    free = {e: list(range(n - 1, -1, -1)) for e, n in units.items()}
    start, unit_of = [0.0] * len(dur), [0] * len(dur)
    order: list[int] = []
    heap: list[tuple[float, int]] = []
    now = 0.0
    while True:
        for e in units:
            f, q = free[e], ready[e]
            while f and q:
                tid = q.popleft()
                unit_of[tid] = f.pop()
                start[tid] = now
                heappush(heap, (now + dur[tid], len(order)))
                order.append(tid)
        if not heap:
            return start, unit_of, order
        now, seq = heappop(heap)
        batch = [order[seq]]
        while heap and heap[0][0] == now:
            batch.append(order[heappop(heap)[1]])
        for tid in batch:
            free[engine[tid]].append(unit_of[tid])
            for s in succ[tid]:
                unmet[s] -= 1
                if unmet[s] == 0:
                    ready[engine[s]].append(s)


def cost_seconds(sim: Simulator) -> list[float]:
    """The cost model's duration of each cost code on its engine kind (8 costs per kind)."""
    return [sim.cost_model.duration(c, ENGINES[i // 8], op="noop") for i, c in enumerate(COSTS)]


def same_schedule(trace, base) -> bool:
    """True when the trace (events in dispatch order) has the heapq schedule's start, unit and order."""
    start, unit, order = base
    c = trace.columns
    tid = c.task_id
    return bool(np.array_equal(tid, np.asarray(order)) and np.array_equal(c.start, np.asarray(start)[tid])
                and np.array_equal(c.unit, np.asarray(unit)[tid]))


def _timed(fn):
    gc.collect()
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w, time.process_time() - c


def _summary(wall: list[float], cpu: list[float], n: int) -> dict:
    return {"median_s": round(statistics.median(wall), 4), "range_s": [round(min(wall), 4), round(max(wall), 4)],
            "median_cpu_s": round(statistics.median(cpu), 4), "tasks_per_s": round(n / statistics.median(wall))}


def end_to_end(n: int, rounds: int) -> None:
    dag = random_dag(n)
    sim = Simulator(PROFILE)
    secs = cost_seconds(sim)
    runs: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in
                                                        ("megaloom.cold", "megaloom.warm", "heapq.cold", "heapq.warm")}

    def heapq_round():
        lists, w, c = _timed(lambda: heapq_lists(dag, secs))
        base, w2, c2 = _timed(lambda: heapq_schedule(*lists, sim.units))
        for k, (a, b) in (("heapq.cold", (w + w2, c + c2)), ("heapq.warm", (w2, c2))):
            runs[k][0].append(a)
            runs[k][1].append(b)
        return base

    def megaloom_round():
        (g, res), w, c = _timed(lambda: (lambda g: (g, sim.run(g)))(megaloom_graph(dag)))
        res2, w2, c2 = _timed(lambda: sim.run(g))
        for k, (a, b) in (("megaloom.cold", (w, c)), ("megaloom.warm", (w2, c2))):
            runs[k][0].append(a)
            runs[k][1].append(b)
        return res.trace

    for r in range(rounds):
        if r % 2:
            trace, base = megaloom_round(), heapq_round()
        else:
            base, trace = heapq_round(), megaloom_round()
        if not same_schedule(trace, base):
            raise SystemExit("the heapq scheduler's schedule differs from the simulator's")
        ref_start = trace.columns.start
        del trace, base
    out = {k: _summary(*v, n) for k, v in runs.items()}
    ratio = {k: [a / b for a, b in zip(runs[f"megaloom.{k}"][0], runs[f"heapq.{k}"][0])] for k in ("cold", "warm")}
    print(json.dumps({"figure": "end_to_end", "tasks": n, "edges": int(dag["indptr"][-1]), "rounds": rounds,
                      "loop": sim.last_loop, "identical_schedule": True, **out,
                      **{f"megaloom_vs_heapq.{k}": {"median": round(statistics.median(v), 3),
                                                    "range": [round(min(v), 3), round(max(v), 3)]}
                         for k, v in ratio.items()}, "target_cold": 0.8}), flush=True)
    (g, res), w, c = _timed(lambda: (lambda g: (g, sim.run(g)))(task_graph(dag)))
    print(json.dumps({"figure": "end_to_end.megaloom_task", "tasks": n, "wall_s": round(w, 3), "cpu_s": round(c, 3),
                      "vs_heapq_cold_median": round(w / statistics.median(runs["heapq.cold"][0]), 2),
                      "identical_schedule": bool(np.array_equal(res.trace.columns.start, ref_start))}), flush=True)


def loops(n: int) -> None:
    """The Python loop (the specification) against the compiled loop, on the durations alone."""
    g = megaloom_graph(random_dag(n))
    dur = Simulator(PROFILE).cost_model.durations(g)
    out = {}
    for name, fast in (("python", False), ("compiled", True)):
        sim = Simulator(PROFILE, fast=fast)
        out[name], w, c = _timed(lambda: sim.schedule(g, dur))
        print(json.dumps({"figure": f"loops.{name}", "tasks": n, "loop": sim.last_loop, "wall_s": round(w, 3),
                          "cpu_s": round(c, 3)}), flush=True)
    a, b = out["python"], out["compiled"]
    if (a.start, a.unit, a.order) != (b.start, b.unit, b.order):
        raise SystemExit("the compiled loop's schedule differs from the Python loop's")


def child(kind: str, n: int) -> None:
    """Build and simulate with one candidate; print peak RSS and RSS after imports (MiB). The
    peak is reset after the imports (torch's import peaks above what it keeps)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status_mib("VmRSS")
    dag = random_dag(n)
    sim = Simulator(PROFILE)
    if kind == "heapq":
        result = heapq_schedule(*heapq_lists(dag, cost_seconds(sim)), sim.units)
    else:
        result = sim.run(megaloom_graph(dag)).trace
    print(json.dumps({"peak_mib": round(_status_mib("VmHWM")), "after_imports_mib": round(base), "kept": len(result)}))


def _status_mib(key: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":")) / 1024


def memory(sizes: list[int]) -> None:
    for n in sizes:
        line = {"figure": "memory", "tasks": n}
        for kind in ("heapq", "megaloom"):
            done = subprocess.run([sys.executable, __file__, "--child", kind, "--tasks", str(n)],
                                  capture_output=True, text=True, check=True)
            got = json.loads(done.stdout.strip().splitlines()[-1])
            line[kind] = {"peak_mib": got["peak_mib"], "above_imports_mib": got["peak_mib"] - got["after_imports_mib"]}
        line["megaloom_vs_heapq_peak"] = round(line["megaloom"]["peak_mib"] / line["heapq"]["peak_mib"], 3)
        print(json.dumps(line), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--memory-sizes", default="1000000,4000000", help="comma-separated; empty: skip")
    ap.add_argument("--child", choices=("heapq", "megaloom"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.tasks)
    print(json.dumps({"figure": "machine", "cpus": os.cpu_count(), "load_avg": os.getloadavg()}), flush=True)
    end_to_end(args.tasks, args.rounds)
    loops(args.tasks)
    memory([int(s) for s in args.memory_sizes.split(",") if s])
    print(json.dumps({"figure": "machine.after", "load_avg": os.getloadavg()}), flush=True)


if __name__ == "__main__":
    main()
