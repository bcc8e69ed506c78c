"""How well a replay reproduces its recording, and the side-by-side table the CLI prints.

Every what-if is shown beside the identity replay's error (the recording replayed on its own
device): if the identity replay is off by 5%, no what-if is better than that.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from megaloom.runtime.metrics import HOST_ENGINES, Metrics, metrics
from megaloom.runtime.trace import Trace

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
              "exposed_comm": _rel(a.exposed_comm, b.exposed_comm, 0.1 * a.device_span)}
    for k in sorted(set(a.busy) | set(b.busy)):
        errors[f"busy {k}"] = _rel(a.busy.get(k, 0.0), b.busy.get(k, 0.0))
    return Fidelity(a, b, sum(d <= tol for d in diffs) / len(diffs) if diffs else 1.0, max(diffs, default=0.0), errors)


def _us(x: float) -> str:
    return f"{x * 1e6:14.1f}"


def _pct(x: float) -> str:
    return f"{x * 100:+7.2f}%"


def table(identity: Fidelity, whatif: Metrics | None = None, label: str = "what-if") -> str:
    """Recorded figures, the identity replay with its error, and a what-if with its ratio to the recording."""
    a, b = identity.recorded, identity.replayed
    head = f"  {'(microseconds)':<22}{'recorded':>14}{'identity replay':>16}{'error':>9}"
    if whatif is not None:
        head += f"{label:>16}{'vs recorded':>13}"

    def row(name: str, x: float, y: float, err: float, z: float | None) -> str:
        line = f"  {name:<22}{_us(x)}{_us(y):>16}{_pct(err):>9}"
        if whatif is not None and z is not None:
            line += f"{_us(z):>16}{(f'{z / x:12.3f}x' if x > 0 else '           -')}"
        return line

    w = whatif
    lines = [head, row("makespan", a.makespan, b.makespan, _rel(a.makespan, b.makespan), w.makespan if w else None),
             row("device span", a.device_span, b.device_span, identity.errors["span"], w.device_span if w else None)]
    for k in sorted(set(a.busy) | set(b.busy)):
        lines.append(row(f"busy {k}", a.busy.get(k, 0.0), b.busy.get(k, 0.0), identity.errors[f"busy {k}"],
                         w.busy.get(k, 0.0) if w else None))
    lines.append(row("exposed comm", a.exposed_comm, b.exposed_comm, identity.errors["exposed_comm"],
                     w.exposed_comm if w else None))
    lines.append(row("critical path", a.critical_path, b.critical_path, _rel(a.critical_path, b.critical_path),
                     w.critical_path if w else None))
    lines.append(f"  device ops starting within {START_TOLERANCE:.0%} of the span of their recorded start: "
                 f"{identity.on_time * 100:.1f}% (largest difference {identity.worst_start * 1e6:.1f} us)")
    return "\n".join(lines)
