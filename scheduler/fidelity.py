"""How well a replay reproduces its recording, and the side-by-side table the CLI prints.

Every what-if is shown beside the identity replay's error (the recording replayed on its own
device): if the identity replay is off by 5%, no what-if is better than that; and beside the
share of the recorded span that no what-if can move (:func:`frozen`), by cause.
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from megaloom.runtime.metrics import HOST_ENGINES, Metrics, metrics
from megaloom.runtime.trace import Trace

ERROR_BARS = Path(__file__).with_name("whatif_errors.json")
"""Per kind of what-if, the errors ``benchmarks/whatif_fidelity.py`` measured on real A/B pairs."""
LAUNCH_LATENCY = 10e-6
"""A device op's delay up to this is launch latency; beyond it, a wait the trace does not explain."""

START_TOLERANCE = 0.01
"""A replayed device op starts "on time" within this fraction of the recorded device span."""


@dataclass(slots=True)
class Fidelity:
    """Recorded and replayed figures (seconds), and how many device ops started on time."""

    recorded: Metrics
    replayed: Metrics
    on_time: float
    """Fraction of device ops starting within :data:`START_TOLERANCE` of the span of their recorded start."""
    worst_start: float
    """Largest difference between a device op's replayed and recorded start (seconds)."""
    errors: dict[str, float] = field(default_factory=dict)

    def error(self, key: str) -> float:
        """Relative error of ``span``, ``exposed_comm`` or ``busy <engine>``."""
        return self.errors[key]


def _rel(a: float, b: float, floor: float = 0.0) -> float:
    base = max(abs(a), floor)
    return (b - a) / base if base > 0 else 0.0


def fidelity(recorded: Trace, replayed: Trace) -> Fidelity:
    """Compare a replay with its recording, task by task (events match by rank and task id)."""
    a, b = metrics(recorded), metrics(replayed)
    # starts from each trace's first event: a wall-clock recording starts wherever its clock stood
    r0, p0 = (min((e.start for e in t.events), default=0.0) for t in (recorded, replayed))
    rec = {(e.rank, e.task_id): e.start - r0 for e in recorded.events if e.engine not in HOST_ENGINES}
    tol = START_TOLERANCE * a.device_span
    diffs = [abs(e.start - p0 - rec[(e.rank, e.task_id)]) for e in replayed.events if (e.rank, e.task_id) in rec]
    errors = {"span": _rel(a.device_span, b.device_span),
              # exposed comm: relative to the recorded figure, or to a tenth of the span when that is
              # larger (so "within 10%" means within 10% of it or 1% of the span)
              "exposed_comm": _rel(a.exposed_comm, b.exposed_comm, 0.1 * a.device_span),
              **{f"busy {k}": _rel(a.busy.get(k, 0.0), b.busy.get(k, 0.0)) for k in sorted(set(a.busy) | set(b.busy))}}
    return Fidelity(a, b, sum(d <= tol for d in diffs) / len(diffs) if diffs else 1.0, max(diffs, default=0.0), errors)


def frozen(trace: Trace) -> dict[str, float]:
    """Seconds of the recorded run that no what-if moves, by cause: the untraced delays along the
    chain that ends the run (from its last device op, else its last task, back through each
    task's latest-ending dependency). Waits that are edges move with what they wait for."""
    by = {(e.rank, e.task_id): e for e in trace.events}
    device = [e for e in trace.events if e.engine not in HOST_ENGINES]
    e = max(device or trace.events, key=lambda e: e.end, default=None)
    first = min((e.start for e in trace.events), default=0.0)
    out: Counter[str] = Counter()
    while e is not None:
        d = e.tags.get("delay", 0.0)
        d = (d if e.deps else min(d, e.start - first)) if isinstance(d, (int, float)) else 0.0  # inside the span only
        causes = {}
        if d > 0 and (e.engine in HOST_ENGINES or trace.meta.get("cpu_only")):
            cpu = min(d, float(e.tags.get("cpu", 0.0)))
            causes = {"host between calls: CPU ops": cpu, "host between calls: untraced (Python, idle)": d - cpu}
        elif d > 0:
            causes = {"device: launch latency" if d <= LAUNCH_LATENCY else "device: waits no record explains": d}
        if e.engine in HOST_ENGINES and "Launch" not in e.op:  # launches move with --cuda-graphs
            causes["host: runtime calls other than launches"] = e.end - e.start
        out.update({k: v for k, v in causes.items() if v > 0})
        e = max((by[(e.rank, p)] for p in e.deps if (e.rank, p) in by), key=lambda p: p.end, default=None)
    return dict(out)


def frozen_share(trace: Trace) -> dict[str, float]:
    """:func:`frozen` as shares of the run (its first start to its last device op's end)."""
    parts = frozen(trace)
    device = [e.end for e in trace.events if e.engine not in HOST_ENGINES]
    span = max(device or [e.end for e in trace.events]) - min(e.start for e in trace.events) if parts else 0.0
    return {k: v / span for k, v in parts.items()} if span > 0 else {}


def frozen_line(trace: Trace) -> str:
    """The frozen share of ``trace``'s run as the CLI prints it (empty without delays)."""
    if not (parts := frozen_share(trace)):
        return ""
    causes = ", ".join(f"{k} {v:.1%}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1]))
    return f"  frozen (no what-if moves it): {sum(parts.values()):.1%} of the run: {causes}"


def table(identity: Fidelity, whatif: Metrics | None = None, label: str = "what-if") -> str:
    """Recorded figures, the identity replay with its error, and a what-if with its ratio to the recording."""
    a, b = identity.recorded, identity.replayed
    head = (f"  {'(microseconds)':<22}{'recorded':>14}{'identity replay':>16}{'error':>9}"
            + (f"{label:>16}{'vs recorded':>13}" if whatif is not None else ""))

    def row(name: str, figure: Callable[[Metrics], float], err: float | None = None) -> str:
        x, y = figure(a), figure(b)
        line = f"  {name:<22}{x * 1e6:14.1f}{y * 1e6:16.1f}{(_rel(x, y) if err is None else err) * 100:>+8.2f}%"
        if whatif is not None:
            z = figure(whatif)
            line += f"{z * 1e6:16.1f}{(f'{z / x:12.3f}x' if x > 0 else '           -')}"
        return line

    return "\n".join([head, row("makespan", lambda m: m.makespan),
                      row("device span", lambda m: m.device_span, identity.errors["span"]),
                      *(row(f"busy {k}", lambda m: m.busy.get(k, 0.0), identity.errors[f"busy {k}"])
                        for k in sorted(set(a.busy) | set(b.busy))),
                      row("exposed comm", lambda m: m.exposed_comm, identity.errors["exposed_comm"]),
                      row("critical path", lambda m: m.critical_path),
                      f"  device ops starting within {START_TOLERANCE:.0%} of the span of their recorded start: "
                      f"{identity.on_time * 100:.1f}% (largest difference {identity.worst_start * 1e6:.1f} us)"])


def error_bars(kinds: list[str]) -> str:
    """One line per what-if kind: the median and worst error measured on real pairs of that kind."""
    try:
        data = json.loads(ERROR_BARS.read_text())
    except (OSError, ValueError):
        data = {}
    bars = data.get("kinds", {})
    return "\n".join(f"  error bar of {k.replace('_', ' ')} what-ifs: " + (
        f"median |error| {bar['median_abs_error']:.1%}, worst {bar['worst_abs_error']:.1%} over {bar['pairs']} "
        f"real A/B pairs ({data.get('source', '?')}, {data.get('machine', '?')})" if (bar := bars.get(k)) else
        "not measured") for k in kinds)
