"""A PNG Gantt chart of a trace: one row per engine unit (per rank), one bar per task.

Several traces (a mapping of panel titles to traces) are drawn as panels on one time
axis, so schedules of the same work compare at a glance. matplotlib is an optional
extra (``pip install megaloom[plot]``); without it, :func:`plot_gantt` raises ConfigError
saying so.
"""
from __future__ import annotations

import io
import os
from typing import Mapping

from megaloom.runtime.dot import engine_colours
from megaloom.runtime.errors import ConfigError
from megaloom.runtime.files import atomic_write
from megaloom.runtime.metrics import time_unit
from megaloom.runtime.perfetto import _ENGINE_ORDER
from megaloom.runtime.trace import Trace


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("plotting needs matplotlib: pip install megaloom[plot]") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _rows(trace: Trace) -> list[tuple[int, str, int]]:
    """The (rank, engine, unit) rows of ``trace``, ranks first, engines in track order."""
    return sorted({(e.rank, e.engine, e.unit) for e in trace.events},
                  key=lambda r: (r[0], _ENGINE_ORDER.get(r[1], len(_ENGINE_ORDER)), r[1], r[2]))


def _panel(ax, trace: Trace, title: str, scale: float, colours: dict[str, str]) -> None:
    """Draw ``trace`` on ``ax`` (times from its first start, divided by ``scale``), bars coloured by engine kind."""
    rows = _rows(trace)
    row_of = {r: i for i, r in enumerate(rows)}
    t0 = min((e.start for e in trace.events), default=0.0)
    bars: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for e in trace.events:
        bars.setdefault((e.engine, row_of[e.rank, e.engine, e.unit]), []).append(
            ((e.start - t0) / scale, e.duration / scale))
    for (engine, row), spans in bars.items():
        ax.broken_barh(spans, (row - 0.4, 0.8), facecolors=colours[engine], edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(len(rows)))
    multi_rank = len({r for r, _, _ in rows}) > 1
    ax.set_yticklabels([f"{'r%d ' % r if multi_rank else ''}{e}.{u}" for r, e, u in rows], fontsize="small")
    ax.set_ylim(len(rows) - 0.5, -0.5)  # first row on top
    ax.set_title(title)


def plot_gantt(trace: Trace | Mapping[str, Trace], path: str | os.PathLike, title: str | None = None,
               dpi: int = 120) -> None:
    """Write a Gantt chart of ``trace`` to ``path`` (PNG), atomically.

    ``trace`` may be a mapping ``{panel title: trace}``: one panel each, on one time axis
    as long as the longest trace (``title`` then heads the figure).
    """
    plt = _pyplot()
    if isinstance(trace, Trace):
        meta = trace.meta
        panels = {title or f"{meta.get('graph', 'trace')} ({meta.get('mode', '?')}, {len(trace.events)} tasks)": trace}
        title = None
    else:
        panels = dict(trace)
    if not panels:
        raise ConfigError("plot_gantt needs at least one trace")
    span = max(max(t.makespan for t in panels.values()), 1e-12)
    scale, unit = time_unit(span)
    heights = [max(1, len(_rows(t))) for t in panels.values()]
    fig, axes = plt.subplots(len(panels), 1, sharex=True, squeeze=False, height_ratios=heights,
                             figsize=(12, 0.8 + 0.6 * len(panels) + 0.22 * sum(heights)))
    colours = engine_colours(sorted({e.engine for t in panels.values() for e in t.events}))  # as in DOT files
    for ax, (name, t) in zip(axes[:, 0], panels.items()):
        _panel(ax, t, name, scale, colours)
    axes[-1, 0].set_xlabel(f"time ({unit})")
    axes[-1, 0].set_xlim(0, span / scale)
    for engine, colour in colours.items():
        axes[0, 0].plot([], [], color=colour, linewidth=6, label=engine)
    if colours:
        axes[0, 0].legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, metadata={"Software": "megaloom"})
    plt.close(fig)
    atomic_write(path, buf.getvalue())
