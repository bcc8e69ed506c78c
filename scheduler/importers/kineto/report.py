"""The import report: every event of the file accounted for, every dependency by kind."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass(slots=True)
class ImportReport:
    """What an import made of a file: tasks by engine, dependencies by kind (``explicit`` from
    the trace's own records, ``inferred`` from timing), what was adjusted or dropped and why."""

    path: str = ""
    device: str = ""
    """The recorded device's name and the profile it matched (``"A100 -> a100"``)."""
    rank: int = 0
    world_size: int = 1
    tasks: int = 0
    engines: Counter[str] = field(default_factory=Counter)
    device_ops: int = 0
    host_calls: int = 0
    split_calls: int = 0
    """Host calls cut where a kernel started inside them or where a sync returned."""
    context: Counter[str] = field(default_factory=Counter)
    """Events kept as tags or as context of the tasks beneath them (annotations, CPU ops)."""
    deps: Counter[str] = field(default_factory=Counter)
    inferred: Counter[str] = field(default_factory=Counter)
    retargeted: Counter[str] = field(default_factory=Counter)
    """Dependencies whose producer ended after the consumer started (clock rounding or overlap),
    moved to the latest earlier task on the producer's track that had ended."""
    dropped: Counter[str] = field(default_factory=Counter)
    overhangs: int = 0
    max_overhang_us: float = 0.0
    truncated: int = 0
    opaque: int = 0
    with_work: int = 0
    without_work: int = 0
    """Device ops with / without work figures (those without keep their duration in what-ifs)."""
    delay_s: float = 0.0
    """Untraced time kept as delays before tasks (host time between calls, launch latency)."""
    skipped: Counter[str] = field(default_factory=Counter)
    notes: list[str] = field(default_factory=list)

    def text(self) -> str:
        """The report as the CLI prints it."""
        def kv(d: dict[str, int]) -> str:
            return ", ".join(f"{k} {v}" for k, v in sorted(d.items(), key=lambda x: (-x[1], x[0]))) or "none"

        rows = [("tasks", f"{self.tasks} ({kv(self.engines)})"),
                ("device ops", f"{self.device_ops} ({self.with_work} with work figures, {self.without_work} keep their "
                               "recorded duration in what-ifs)"),
                ("host calls", f"{self.host_calls} ({self.split_calls} split where a kernel started or a sync returned)"),
                *((k, kv(getattr(self, k))) for k in ("deps", "inferred", "retargeted", "dropped")),
                ("overhanging", f"{self.overhangs} children clamped to their parent (largest overhang "
                                f"{self.max_overhang_us:.3f} us)"),
                ("untraced time", f"{self.delay_s * 1e6:.1f} us kept as delays"),
                ("context (tags)", kv(self.context)), ("not used", kv(self.skipped))]
        lines = [f"import of {self.path}: rank {self.rank} of {self.world_size}, device {self.device or 'unknown'}",
                 *(f"  {k.replace('deps', 'dependencies'):<20}{v}" for k, v in rows)]
        if self.truncated or self.opaque:
            lines.append(f"  truncated {self.truncated}, unknown categories {self.opaque}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)
