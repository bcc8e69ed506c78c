"""Progress bar and metrics for training: one line per logged step on stderr, JSONL on disk."""
from __future__ import annotations

import json
import os
import sys
from typing import Any, TextIO

import torch


def reset_peak_memory() -> None:
    """Start a new peak-memory window (CUDA allocator peak; on Linux CPU, the resident-set high-water mark)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:  # "5" resets VmHWM (Linux >= 4.0)
            f.write("5")
    except OSError:
        pass  # then the peak is the process's lifetime peak


def peak_memory_mib() -> float:
    """Peak memory since :func:`reset_peak_memory`, in MiB: CUDA's allocated peak, else the peak resident set."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2**20
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
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
                + (f" MFU {rec['mfu']:.1%}" if rec.get("mfu") is not None else ""))
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

