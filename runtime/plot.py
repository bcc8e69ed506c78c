"""A PNG Gantt chart of a trace: one row per engine unit (per rank), one bar per task.

matplotlib is an optional extra (``pip install megaloom[plot]``); without it,
:func:`plot_gantt` raises ConfigError saying so.
"""
from __future__ import annotations

import io
import os

from megaloom.runtime.errors import ConfigError
from megaloom.runtime.perfetto import _ENGINE_ORDER
from megaloom.runtime.files import atomic_write
from megaloom.runtime.trace import Trace

COLOURS = {"cube": "#1f77b4", "vector": "#2ca02c", "comm": "#d62728"}
OTHER = "#7f7f7f"


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("plotting needs matplotlib: pip install megaloom[plot]") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def plot_gantt(trace: Trace, path: str | os.PathLike, title: str | None = None, dpi: int = 120) -> None:
    """Write a Gantt chart of ``trace`` to ``path`` (PNG), atomically."""
    plt = _pyplot()
    rows = sorted({(e.rank, e.engine, e.unit) for e in trace.events},
                  key=lambda r: (r[0], _ENGINE_ORDER.get(r[1], len(_ENGINE_ORDER)), r[1], r[2]))
    row_of = {r: i for i, r in enumerate(rows)}
    t0 = min((e.start for e in trace.events), default=0.0)
    span = max(trace.makespan, 1e-12)
    scale, unit = next(((f, u) for f, u in ((1.0, "s"), (1e-3, "ms"), (1e-6, "us")) if span >= f), (1e-9, "ns"))
    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.3 * max(1, len(rows))))
    bars: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for e in trace.events:
        bars.setdefault((e.engine, row_of[e.rank, e.engine, e.unit]), []).append(
            ((e.start - t0) / scale, e.duration / scale))
    for (engine, row), spans in bars.items():
        ax.broken_barh(spans, (row - 0.4, 0.8), facecolors=COLOURS.get(engine, OTHER), edgecolor="white",
                       linewidth=0.3)
    engines = sorted({engine for engine, _ in bars})
    for engine in engines:
        ax.plot([], [], color=COLOURS.get(engine, OTHER), linewidth=6, label=engine)
    ax.set_yticks(range(len(rows)))
    multi_rank = len({r for r, _, _ in rows}) > 1
    ax.set_yticklabels([f"{'r%d ' % r if multi_rank else ''}{e}.{u}" for r, e, u in rows])
    ax.invert_yaxis()
    ax.set_xlabel(f"time ({unit})")
    ax.set_xlim(0, span / scale)
    meta = trace.meta
    ax.set_title(title or f"{meta.get('graph', 'trace')} ({meta.get('mode', '?')}, {len(trace.events)} tasks)")
    if engines:
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    plt.close(fig)
    atomic_write(path, buf.getvalue())
