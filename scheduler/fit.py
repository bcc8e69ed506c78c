"""Calibration: fit the cost model's per-op coefficients to measured traces.

For each op class (the op name) the model is the cost model's own roofline,
``duration = overhead + max(work / throughput, bytes / mem_bw)``, where work is the flops of a
compute op and the bytes on the wire (``comm_bytes``) of a comm or copy op. Three candidates are
fitted by weighted least squares on relative error (durations span orders of
magnitude): compute-bound (flops term only), memory-bound (bytes term only) and both
(each slope from its single-term fit, overhead refitted). The candidate with the
smallest residual wins; an unused term gets an unbounded rate, so the profile's own
figure cannot take over. Ops with no flops and no bytes get the mean duration as
overhead.

A real executor also spends time between tasks (waking a worker, handing the task
out). :func:`dispatch_latency` measures it from the traces as the mean gap between the
moment a task could start (its unit free, its dependencies done) and its start (the mean,
not the median: a run's length is the sum of its gaps, the rare long ones included);
:func:`fit_traces` adds it to every op's overhead, since the simulator starts tasks the
instant they can run.

Units that share cores slow each other (:mod:`megaloom.scheduler.contention`): given a
contention, each sample is the event's full-speed work under it, not its recorded duration.
:func:`fit_overlap` fits the slowdown of compute overlapped by comm (as Echo does), the
contention figure that traces show best; the shared cores are measured (``megaloom
calibrate``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from operator import itemgetter
from typing import Iterable

import numpy as np

from megaloom.runtime.errors import ConfigError
from megaloom.runtime.registry import MOVERS
from megaloom.runtime.trace import Trace
from megaloom.scheduler.contention import work
from megaloom.scheduler.cost import OpCoeffs
from megaloom.scheduler.profile import Contention, HardwareProfile, parse_profile

UNBOUNDED = 1e30  # a rate so high its term never wins the roofline max


@dataclass(frozen=True, slots=True)
class OpFit:
    """Fitted coefficients of one op class and how well they explain the samples."""

    op: str
    engine: str
    coeffs: OpCoeffs
    samples: int
    median_rel_error: float
    max_rel_error: float


def _line(x: np.ndarray, d: np.ndarray) -> tuple[float, float] | None:
    """(overhead, slope) of d ~ o + s x, weighted by 1/d; None when the slope is not positive."""
    w = 1.0 / np.maximum(d, 1e-12)
    a = np.stack([np.ones_like(x), x], axis=1) * w[:, None]
    (o, s), *_ = np.linalg.lstsq(a, d * w, rcond=None)
    if o < 0:  # no negative fixed cost: refit through the origin
        o, s = 0.0, float(np.sum(x * d * w * w) / max(np.sum(x * x * w * w), 1e-300))
    return (float(o), float(s)) if s > 0 else None


def fit_op(op: str, engine: str, flops: np.ndarray, nbytes: np.ndarray, d: np.ndarray, latency: float = 0.0) -> OpFit:
    """Fit one op class from its samples (flops, bytes, measured seconds); ``latency`` is added
    to the fitted overhead (the residuals are those of the fit)."""
    candidates: list[OpCoeffs] = []
    fl, by = _line(flops, d) if flops.any() else None, _line(nbytes, d) if nbytes.any() else None
    if fl:
        candidates.append(OpCoeffs(1.0 / fl[1], fl[0], UNBOUNDED))
    if by:
        candidates.append(OpCoeffs(UNBOUNDED, by[0], 1.0 / by[1]))
    if fl and by:
        rest = d - np.maximum(flops * fl[1], nbytes * by[1])
        candidates.append(OpCoeffs(1.0 / fl[1], max(0.0, float(np.median(rest))), 1.0 / by[1]))
    best = None
    for c in candidates or [OpCoeffs(UNBOUNDED, float(np.mean(d)), UNBOUNDED)]:  # no term: the mean as overhead
        err = np.abs(c.overhead + np.maximum(flops / c.throughput, nbytes / c.mem_bw) - d) / np.maximum(d, 1e-12)
        score = float(np.mean(err ** 2))
        if best is None or score < best[0] - 1e-12:  # ties go to the simpler, earlier candidate
            best = (score, c, err)
    _, c, err = best
    return OpFit(op, engine, replace(c, overhead=c.overhead + latency), len(d), float(np.median(err)), float(err.max()))


def dispatch_latency(traces: Iterable[Trace]) -> float:
    """Mean seconds from "could start" (unit free, dependencies done) to start, over the
    tasks that had something to wait for (a dependency or an earlier task on their unit)."""
    gaps = []
    for t in traces:
        end = {(e.rank, e.task_id): e.end for e in t.events}
        last: dict[tuple, list[float]] = {}  # per unit: the end of its latest task
        for e in sorted(t.events, key=lambda e: e.start):
            key = (e.rank, e.engine, e.unit)
            waits = [end[(e.rank, d)] for d in e.deps if (e.rank, d) in end] + last.get(key, [])
            if waits and max(waits) <= e.start:
                gaps.append(e.start - max(waits))
            last[key] = [e.end]
    return float(np.mean(gaps)) if gaps else 0.0


def fit_traces(traces: Iterable[Trace], min_samples: int = 1, dispatch: bool = True,
               contention: Contention | None = None) -> dict[str, OpFit]:
    """Per-op fits over every event of ``traces`` (ops with fewer samples are left out);
    with ``dispatch``, each overhead includes the traces' :func:`dispatch_latency`; with
    ``contention``, each sample is the event's full-speed work under it."""
    traces = list(traces)
    latency = dispatch_latency(traces) if dispatch else 0.0
    rows: dict[str, list[tuple[float, float, float]]] = {}
    engine: dict[str, str] = {}
    for t in traces:
        seconds = work(t.events, contention) if contention else [e.end - e.start for e in t.events]
        for e, d in zip(t.events, seconds):
            if e.end > e.start:
                rows.setdefault(e.op, []).append((e.comm_bytes if e.engine in MOVERS else e.flops, e.bytes, d))
                engine[e.op] = e.engine
    if not rows:
        raise ConfigError("calibration needs traces with timed events; none were given")
    return {op: fit_op(op, engine[op], *np.asarray(r, dtype=np.float64).T, latency)
            for op, r in sorted(rows.items()) if len(r) >= min_samples}


def fit_overlap(traces: Iterable[Trace], base: Contention, **options) -> tuple[Contention, dict[str, OpFit]]:
    """``base`` with the overlap slowdown (0 to 1 in steps of 0.05) under which :func:`fit_traces`
    (given ``options``) explains the traces best, and those fits. The score is the sum over ops
    of samples times median relative error; where the traces hold no comm, or cannot tell,
    ``base``'s figure stays."""
    traces = list(traces)

    def fitted(overlap: float) -> tuple[float, Contention, dict[str, OpFit]]:
        c = replace(base, overlap=float(overlap))
        fits = fit_traces(traces, contention=c, **options)
        return sum(f.samples * f.median_rel_error for f in fits.values()), c, fits

    comm = any(e.engine in MOVERS for t in traces for e in t.events)
    # the first of equal scores: base's figure
    return min(map(fitted, (base.overlap, *(np.linspace(0.0, 1.0, 21) if comm else ()))), key=itemgetter(0))[1:]


def fit_table(fits: dict[str, OpFit]) -> str:
    """A text table of the fits and their residuals."""
    def rate(x: float | None, unit: str) -> str:
        return "-" if x is None or x >= UNBOUNDED else f"{x:.3g} {unit}"

    w = max([len(op) for op in fits] + [2]) + 2
    head = (f"{'op':<{w}}{'engine':<8}{'samples':>8}{'throughput':>16}{'mem_bw':>14}{'overhead':>12}"
            f"{'median err':>12}{'max err':>10}")
    return "\n".join([head, *(f"{f.op:<{w}}{f.engine:<8}{f.samples:>8}{rate(f.coeffs.throughput, 'flop/s'):>16}"
                              f"{rate(f.coeffs.mem_bw, 'B/s'):>14}{(f.coeffs.overhead or 0) * 1e6:>9.1f} us"
                              f"{f.median_rel_error * 100:>11.1f}%{f.max_rel_error * 100:>9.1f}%"
                              for f in fits.values())])


def calibrated_profile(base: HardwareProfile, fits: dict[str, OpFit], name: str | None = None,
                       source: str = "traces", contention: Contention | None = None) -> HardwareProfile:
    """``base`` with the fits in its ``ops`` section (coefficients and residuals), and
    ``contention`` (as fitted with them) in place of its own."""
    data = base.to_dict()
    if contention is not None:
        data["contention"] = contention.to_dict()
        data["sources"]["contention"] = f"fitted by `megaloom calibrate --from` on {source}"
    data["name"] = name or base.name
    data["ops"] = {**data.get("ops", {}), **{
        op: {"throughput": f.coeffs.throughput or UNBOUNDED, "overhead": f.coeffs.overhead or 0.0,
             "mem_bw": f.coeffs.mem_bw or UNBOUNDED, "samples": f.samples,
             "median_rel_error": f.median_rel_error, "max_rel_error": f.max_rel_error}
        for op, f in fits.items()}}
    data["sources"]["ops"] = f"fitted by `megaloom calibrate --from` on {source}"
    return parse_profile(data, f"<calibration of {base.name}>")
