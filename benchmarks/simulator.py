"""Simulated tasks per second of the discrete-event Simulator on a >= 1,000,000-task graph.

Side by side in one run, on the same random DAG and the same durations:

* ``simulator.schedule.python``: the Python event loop driven by the microkernel Core and
  a policy (the specification; ``Simulator(..., fast=False)``);
* ``simulator.schedule.compiled``: the compiled event loop (``megaloom.scheduler._fastsim``)
  the Simulator picks for key-ordered policies; its schedule is checked identical to the
  Python loop's (start, unit, dispatch order), and its line gives the speed-up over it;
* ``simulator.run.cold``: the first ``Simulator.run`` on the new graph (task costs, duration
  keys, durations, event loop, trace columns), and ``end_to_end``: build + validate + that run;
* ``simulator.run``: later runs (durations asked once per distinct (op, engine, cost), the
  loop, the trace columns), with the loop the Simulator picks;
* ``baseline.heapq`` (FIFO only): a ~40-line stand-alone heapq list scheduler with its own
  counters and deques (no Core, no policy object, no trace) given the durations; its start,
  unit and dispatch order per task must equal the simulator's (checked), and its line gives
  ``Simulator.run``'s speed-up over it.

Timings are the best of ``--repeat`` runs, as wall time and as process CPU time (the
machine may be shared). One JSON line per figure; ``meets_target`` reads CPU time.

    python benchmarks/simulator.py [--tasks 1000000] [--repeat 3] [--profile ascend-910b] [--policy fifo]
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import time
from collections import deque
from heapq import heappop, heappush

import megaloom.ops  # noqa: F401  (registers the built-in ops)
from megaloom.runtime import Cost, TaskGraph
from megaloom.scheduler import Simulator, fastpath

ENGINES = ("cube", "vector", "comm")
TARGET = 1_000_000  # simulated tasks per second


def random_graph(n: int, seed: int = 0, max_preds: int = 3, window: int = 64) -> TaskGraph:
    """``n`` no-op tasks, each waiting for up to ``max_preds`` of the ``window`` tasks before
    it, on a random engine kind, with one of 24 costs (matmul-like on cube, element-wise on
    vector, transfers on comm)."""
    rng = random.Random(seed)
    costs = {
        "cube": [Cost(flops=2.0 * m * 128 * 128, bytes=2.0 * (m * 128 + 128 * 128 + m * 128), precision="bf16")
                 for m in (16, 32, 64, 128, 256, 512, 1024, 2048)],
        "vector": [Cost(flops=4.0 * m * 128, bytes=4.0 * m * 128, precision="bf16") for m in range(64, 64 * 9, 64)],
        "comm": [Cost(comm_bytes=2.0 * m * 128) for m in range(256, 256 * 9, 256)],
    }
    g = TaskGraph("bench-sim")
    tasks = g.tasks
    for i in range(n):
        k = rng.randint(0, min(max_preds, i))
        preds = rng.sample(range(max(0, i - window), i), k) if k else ()
        e = ENGINES[rng.randrange(3)]
        g.task("noop", name=f"t{i}", engine=e, cost=costs[e][rng.randrange(8)], after=[tasks[p] for p in sorted(preds)])
    return g


def heapq_baseline(graph: TaskGraph, dur: list[float], units: dict[str, int]):
    """The same FIFO list schedule with inline counters and deques: (start, unit, order) per task."""
    succ, engine = graph.succ, [t.engine for t in graph.tasks]
    unmet = [len(p) for p in graph.pred]
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


def timed(fn, repeat: int):
    """(result, best wall seconds, best CPU seconds) of ``repeat`` calls."""
    best_wall = best_cpu = float("inf")
    result = None
    for _ in range(repeat):
        result = None  # free the previous result outside the timed region
        gc.collect()
        w, c = time.perf_counter(), time.process_time()
        result = fn()
        best_wall, best_cpu = min(best_wall, time.perf_counter() - w), min(best_cpu, time.process_time() - c)
    return result, best_wall, best_cpu


def emit(figure: str, n: int, wall: float, cpu: float, **extra) -> None:
    print(json.dumps({"figure": figure, "tasks": n, "wall_s": round(wall, 4), "cpu_s": round(cpu, 4),
                      "tasks_per_s_wall": round(n / wall), "tasks_per_s_cpu": round(n / cpu), **extra}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--profile", default="ascend-910b")
    ap.add_argument("--policy", default="fifo")
    args = ap.parse_args()

    graph, b_wall, b_cpu = timed(lambda: random_graph(args.tasks).validate(), 1)
    n = len(graph)
    emit("graph.build_and_validate", n, b_wall, b_cpu, edges=sum(map(len, graph.succ)), builder="TaskGraph.task")
    _, k_wall, k_cpu = timed(graph.costs, 1)
    emit("graph.costs", n, k_wall, k_cpu, note="every task's Cost, computed once per graph version")
    sim = Simulator(args.profile, policy=args.policy)
    _, c_wall, c_cpu = timed(lambda: sim.run(graph, validate=False), 1)
    emit("simulator.run.cold", n, c_wall, c_cpu, loop=sim.last_loop, note="duration keys + durations + "
         "event loop + trace columns, first run on the graph")
    e_wall, e_cpu = b_wall + k_wall + c_wall, b_cpu + k_cpu + c_cpu
    emit("end_to_end", n, e_wall, e_cpu, note="build + validate + costs + first Simulator.run",
         target_tasks_per_s=TARGET, meets_target=n / e_cpu >= TARGET,
         without_build_tasks_per_s_cpu=round(n / (k_cpu + c_cpu)))
    dur, wall, cpu = timed(lambda: sim.cost_model.durations(graph), args.repeat)
    emit("cost_model.durations", n, wall, cpu, note="one cost-model call per task")
    py_sim = Simulator(args.profile, policy=args.policy, fast=False)
    sched, s_wall, s_cpu = timed(lambda: py_sim.schedule(graph, dur), args.repeat)
    emit("simulator.schedule.python", n, s_wall, s_cpu, policy=args.policy, profile=args.profile,
         makespan_s=sched.makespan)
    fast, f_wall, f_cpu = timed(lambda: sim.schedule(graph, dur), args.repeat)
    if sim.last_loop != "compiled":
        print(json.dumps({"figure": "simulator.schedule.compiled", "available": fastpath.AVAILABLE,
                          "note": f"compiled loop not used (extension built: {fastpath.AVAILABLE}, policy "
                                  f"{args.policy!r}); the Simulator ran its Python loop"}), flush=True)
    else:
        if (fast.start, fast.unit, fast.order) != (sched.start, sched.unit, sched.order):
            raise SystemExit("the compiled loop's schedule differs from the Python loop's")
        emit("simulator.schedule.compiled", n, f_wall, f_cpu, policy=args.policy, identical_to_python=True,
             speedup_vs_python_cpu=round(s_cpu / f_cpu, 2), speedup_vs_python_wall=round(s_wall / f_wall, 2))
    res, r_wall, r_cpu = timed(lambda: sim.run(graph, validate=False), args.repeat)
    if len(res.trace) != n:
        raise SystemExit("the trace misses tasks")
    emit("simulator.run", n, r_wall, r_cpu, loop=sim.last_loop, target_tasks_per_s=TARGET,
         meets_target=n / r_cpu >= TARGET, note="durations + event loop + trace columns")
    if args.policy == "fifo":
        base, h_wall, h_cpu = timed(lambda: heapq_baseline(graph, dur, sim.units), args.repeat)
        if base != (sched.start, sched.unit, sched.order):
            raise SystemExit("the heapq baseline's schedule differs from the simulator's")
        emit("baseline.heapq", n, h_wall, h_cpu, identical_schedule=True,
             run_speedup_vs_baseline_cpu=round(h_cpu / r_cpu, 2), run_speedup_vs_baseline_wall=round(h_wall / r_wall, 2),
             cold_run_speedup_vs_baseline_cpu=round(h_cpu / c_cpu, 2))


if __name__ == "__main__":
    main()
