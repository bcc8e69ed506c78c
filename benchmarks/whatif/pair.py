"""One what-if pair: two real runs that differ in one thing, and a prediction of the second
from what was recorded of the first.

Every source of pairs (PyTorch workloads replayed from their profiler traces, gloo ranks,
megaloom's own graphs) returns ``Pair`` objects; the suite measures both sides in
interleaved rounds, compares the measured B/A ratio with the predicted one, and summarises
the error per kind. The summary is what ``megaloom replay`` prints beside a what-if of that
kind (``ERROR_BARS``, package data of ``megaloom.scheduler``).
"""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

KINDS = ("op_speed", "shape", "moe", "comm", "parallelism", "megaloom_graph")
ERROR_BARS = Path(__file__).resolve().parents[2] / "scheduler" / "whatif_errors.json"


@dataclass
class Pair:
    kind: str                       # one of KINDS
    name: str                       # what differs, e.g. "encoder FFN width 1024 -> 512"
    run_a: Callable[[], float]      # one measured run (a step, or steps) of side A: seconds
    run_b: Callable[[], float]      # the same for side B
    predict: Callable[[], float]    # predicted B/A time ratio, from A's own recording only
    setup: Callable[[], None] | None = None  # warm-up / recording of A, called once first

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"pair {self.name!r}: kind {self.kind!r} is not one of {KINDS}")


@dataclass
class Result:
    pair: Pair
    measured: float                 # median over rounds of (B time / A time) within a round
    spread: tuple[float, float]     # min and max of that ratio over the rounds
    predicted: float

    @property
    def error(self) -> float:
        return self.predicted / self.measured - 1


def measure(pair: Pair, rounds: int) -> tuple[float, tuple[float, float]]:
    """Median and range of B/A over ``rounds`` interleaved rounds (A then B, then B then A,
    alternating, so drift in machine load falls on both sides alike)."""
    ratios = []
    for r in range(rounds):
        if r % 2 == 0:
            a = pair.run_a()
            b = pair.run_b()
        else:
            b = pair.run_b()
            a = pair.run_a()
        ratios.append(b / a)
    return statistics.median(ratios), (min(ratios), max(ratios))


def evaluate(pair: Pair, rounds: int) -> Result:
    if pair.setup is not None:
        pair.setup()
    predicted = pair.predict()
    measured, spread = measure(pair, rounds)
    return Result(pair, measured, spread, predicted)


def summarise(results: list[Result]) -> dict[str, dict]:
    """Per kind: the median and worst |error| and the number of pairs."""
    out = {}
    for kind in KINDS:
        errs = [abs(r.error) for r in results if r.pair.kind == kind]
        if errs:
            out[kind] = {"median_abs_error": statistics.median(errs), "worst_abs_error": max(errs),
                         "pairs": len(errs)}
    return out


def write_error_bars(summary: dict[str, dict], machine: str, path: Path = ERROR_BARS) -> None:
    """The per-kind error bars ``megaloom replay`` prints, with the machine they were measured on."""
    path.write_text(json.dumps({"machine": machine, "source": "benchmarks/whatif_fidelity.py",
                                "kinds": summary}, indent=1, sort_keys=True) + "\n")
