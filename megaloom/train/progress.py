"""Progress bar and metrics for training: one line per logged step on stderr, JSONL and TensorBoard events on disk."""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
import sys
from typing import Any, TextIO

import torch

from megaloom.runtime.errors import ConfigError
from megaloom.runtime.files import atomic_write


def reset_peak_memory() -> None:
    """Start a new peak-memory window (CUDA allocator peak; on Linux CPU, the resident-set high-water mark)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()
        return
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:  # no such file: the lifetime peak
        f.write("5")  # resets VmHWM (Linux >= 4.0)


def peak_memory_mib() -> float:
    """Peak memory since :func:`reset_peak_memory`, in MiB: CUDA's allocated peak, else the peak resident set."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2**20
    with contextlib.suppress(OSError, AttributeError), open("/proc/self/status") as f:  # no VmHWM line: None.group
        return int(re.search(r"^VmHWM:\s+(\d+) kB", f.read(), re.M).group(1)) / 1024
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Progress:
    """``[#####.....] step 5/10 loss 4.1234 tok/s 5120 mem 312 MiB``; redrawn in place on a TTY."""

    def __init__(self, total: int, enabled: bool = True, stream: TextIO | None = None, width: int = 24):
        self.total, self.enabled, self.width = total, enabled, width
        self.stream = stream or sys.stderr
        self.tty = self.enabled and self.stream.isatty()

    def update(self, rec: dict[str, Any]) -> None:
        if not self.enabled:
            return
        done = int(self.width * rec["step"] / max(self.total, 1))
        line = (f"[{'#' * done}{'.' * (self.width - done)}] step {rec['step']}/{self.total} "
                f"loss {rec['loss']:.4f} lr {rec['lr']:.2e} tok/s {rec['tokens_per_s']:.0f} "
                f"peak mem {rec['peak_mem_mib']:.0f} MiB comm {rec['comm_s'] * 1e3:.0f} ms"
                + (f" MFU {rec['mfu']:.1%}" if rec.get("mfu") is not None else "")
                + (f" eval loss {rec['eval_loss']:.4f} ppl {rec['eval_ppl']:.2f}" if "eval_loss" in rec else ""))
        self.stream.write(("\r" + line) if self.tty else line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


class MetricsLog:
    """Appends one JSON object per logged step to ``<out_dir>/metrics.jsonl`` and, with ``tensorboard``, its
    numbers as scalars to TensorBoard event files in ``out_dir``. Records of steps after ``start`` (the step
    the run starts from) are dropped first, from both: a resumed run writes them again."""

    def __init__(self, out_dir: str, start: int, tensorboard: bool):
        self.path = os.path.join(out_dir, "metrics.jsonl")
        kept = []
        if os.path.exists(self.path):
            with open(self.path, encoding="utf-8", errors="replace") as f:
                kept = [line for line in f if _step(line) <= start]
        atomic_write(self.path, "".join(kept).encode())
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ConfigError("run.tensorboard: needs the 'tensorboard' package (pip install 'megaloom[train]'), "
                                  "or set run.tensorboard=false") from None
            self.tb = SummaryWriter(out_dir, purge_step=start + 1)

    def write(self, rec: dict[str, Any]) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")
        if self.tb is not None:
            for key, value in rec.items():
                if isinstance(value, (int, float)) and key != "step":
                    self.tb.add_scalar(key.replace("eval_", "eval/"), value, rec["step"])
            self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def _step(line: str) -> float:
    """The step of a metrics line (inf for a line that is not a record: dropped)."""
    try:
        return float(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return math.inf
