"""``megaloom train --plot``: a PNG of a run's loss and throughput per step, from its ``metrics.jsonl``."""
from __future__ import annotations

import io
import json
import os

from megaloom.runtime.errors import ConfigError
from megaloom.runtime.files import atomic_write
from megaloom.runtime.plot import _pyplot


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The records of a ``metrics.jsonl`` (ConfigError naming the file and line when one is not JSON)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = [(i, line) for i, line in enumerate(f, 1) if line.strip()]  # numbered as in the file
    except OSError as e:
        raise ConfigError(f"cannot read metrics {path}: {e.strerror}") from None
    out = []
    for i, line in lines:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{i}: not a JSON record ({e.msg})") from None
        if not isinstance(rec, dict) or not {"step", "loss", "tokens_per_s"} <= rec.keys():
            raise ConfigError(f"{path}:{i}: a metrics record needs step, loss and tokens_per_s")
        out.append(rec)
    return out


def plot_metrics(metrics: str | os.PathLike, png: str | os.PathLike, title: str = "", dpi: int = 120) -> None:
    """Write loss (top) and tokens/s (bottom) against the step to ``png``, atomically."""
    recs = read_metrics(metrics)
    plt = _pyplot()
    steps = [r["step"] for r in recs]
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(8, 6))
    top.plot(steps, [r["loss"] for r in recs], marker=".", color="#1f77b4")
    top.set_ylabel("loss")
    top.set_title(title or f"{os.path.basename(os.path.dirname(os.path.abspath(metrics))) or 'run'}: {len(recs)} steps")
    bottom.plot(steps, [r["tokens_per_s"] for r in recs], marker=".", color="#2ca02c")
    bottom.set_ylabel("tokens / s")
    bottom.set_xlabel("step")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    plt.close(fig)
    atomic_write(png, buf.getvalue())
