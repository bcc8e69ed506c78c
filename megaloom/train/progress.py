"""Progress bar and metrics for training: one line per logged step on stderr, JSONL on disk."""
from __future__ import annotations

import json
import os
import sys
from typing import Any, TextIO

import torch


def memory_mib() -> float:
    """Peak accelerator memory when on CUDA, else this process's resident set size, in MiB."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2**20
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0


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
                f"loss {rec['loss']:.4f} lr {rec['lr']:.2e} tok/s {rec['tokens_per_s']:.0f} mem {rec['mem_mib']:.0f} MiB")
        self.stream.write(("\r" + line) if self.tty else line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


class MetricsLog:
    """Appends one JSON object per logged step (``fresh=True`` truncates the file first)."""

    def __init__(self, path: str, fresh: bool):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        if fresh:
            open(path, "w").close()

    def write(self, rec: dict[str, Any]) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")

