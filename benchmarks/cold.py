"""First-call costs: a graph built, validated and run once, against the plain loop; and the
start-up time of the command line.

* ``cold.matmul_chain``: ``--chain`` (default 5,000) dependent 64x64 fp32 matmuls
  (``h <- h @ w``, ping-pong between two row tiles of a scratch buffer), as a user who builds
  a graph per step runs it: ``TaskGraph`` built task by task, validated, run once by a
  ``ThreadExecutor({"cube": 1})`` made before the rounds (``cold``), then run again on the
  same graph (``warm``); against a plain Python loop of ``torch.mm(src, w, out=dst)`` on two
  tensors, one torch thread. Every round times each candidate once (interleaved, after one
  untimed warm-up round); medians and ranges over ``--rounds``, with the build, validate
  and first-run parts apart.
* ``cold.cli_help``: wall and CPU time of ``megaloom --help`` in a fresh interpreter, beside
  a fresh interpreter that only imports ``argparse`` (what any Python command line pays), and
  whether ``torch`` was imported by it.

The chain is timed twice, on the wall clock and on process CPU time (all threads; the
machine may be shared).

    python benchmarks/cold.py [--chain 5000] [--rounds 7]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

import megaloom.ops  # noqa: F401  (registers the built-in ops)
from megaloom.runtime import ThreadExecutor
from overhead import matmul_chain  # the same chain the dispatch figures run


def loop(x: torch.Tensor, w: torch.Tensor, n: int) -> torch.Tensor:
    """The plain loop a user would write."""
    tiles, src = (torch.empty_like(x), torch.empty_like(x)), x
    for i in range(n):
        torch.mm(src, w, out=tiles[i % 2])
        src = tiles[i % 2]
    return src


def _stats(ts: list[float], n: int) -> dict:
    return {"median_us_per_task": round(statistics.median(ts) / n * 1e6, 2),
            "range_us_per_task": [round(min(ts) / n * 1e6, 2), round(max(ts) / n * 1e6, 2)]}


def chain(n: int, rounds: int) -> None:
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 64, generator=gen), torch.linalg.qr(torch.randn(64, 64, generator=gen))[0]
    ex = ThreadExecutor({"cube": 1})
    names = ("loop", "build", "validate", "first_run", "warm")
    for clock in (time.perf_counter, time.process_time):  # wall, then CPU (the machine may be shared)
        parts: dict[str, list[float]] = {k: [] for k in names}
        for r in range(rounds + 1):  # round 0 warms up torch, the executor and the op registry
            t = [clock()]
            ref = loop(x, w, n)
            t.append(clock())
            g = matmul_chain(n)
            t.append(clock())
            g.validate()
            t.append(clock())
            out = ex.run(g, {"x": x, "w": w})["y"]
            t.append(clock())
            ex.run(g, {"x": x, "w": w})
            t.append(clock())
            if not torch.allclose(out, ref, rtol=1e-4, atol=1e-4):
                raise SystemExit("the executor's chain result differs from the loop's")
            for k, a, b in zip(names, t, t[1:]):
                parts[k].append(b - a) if r else None
        parts["cold"] = [b + v + f for b, v, f in zip(parts["build"], parts["validate"], parts["first_run"])]
        ratio = {k: [c / lp for c, lp in zip(parts[k], parts["loop"])] for k in ("cold", "warm")}
        print(json.dumps({"figure": "cold.matmul_chain", "clock": clock.__name__, "tasks": n, "rounds": rounds,
                          **{k: _stats(v, n) for k, v in parts.items()},
                          **{f"{k}_vs_loop": {"median": round(statistics.median(v), 3), "range": [round(min(v), 3),
                                                                                              round(max(v), 3)]}
                             for k, v in ratio.items()}, "targets": {"cold": 2.0, "warm": 1.1}}), flush=True)


def cli(rounds: int) -> None:
    probe = ("import sys, runpy; sys.argv = ['megaloom', '--help']\n"
             "try:\n    runpy.run_module('megaloom.cli', run_name='__main__')\nexcept SystemExit:\n    pass\n"
             "print('torch' in sys.modules, file=sys.stderr)")
    cands = {"megaloom_help": [sys.executable, "-c", probe], "python_argparse": [sys.executable, "-c", "import argparse"]}
    times: dict[str, list[float]] = {f"{k}.{c}": [] for k in cands for c in ("wall", "cpu")}
    torch_loaded = None
    for _ in range(rounds):
        for k, cmd in cands.items():
            t0, c0 = time.perf_counter(), _children_cpu()
            done = subprocess.run(cmd, capture_output=True, text=True, check=True)
            times[f"{k}.wall"].append(time.perf_counter() - t0)
            times[f"{k}.cpu"].append(_children_cpu() - c0)
            if k == "megaloom_help":
                torch_loaded = done.stderr.strip().endswith("True")
    print(json.dumps({"figure": "cold.cli_help", "rounds": rounds, "torch_imported": torch_loaded, "target_s": 0.5,
                      **{k: {"median_s": round(statistics.median(v), 3), "range_s": [round(min(v), 3), round(max(v), 3)]}
                         for k, v in times.items()}}), flush=True)


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chain", type=int, default=5000)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    print(json.dumps({"figure": "machine", "cpus": os.cpu_count(), "load_avg": os.getloadavg()}), flush=True)
    chain(args.chain, args.rounds)
    cli(args.rounds)
    print(json.dumps({"figure": "machine.after", "load_avg": os.getloadavg()}), flush=True)


if __name__ == "__main__":
    main()
