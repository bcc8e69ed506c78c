"""Shared pieces of the reliability tests: a time bound that interrupts Python code, a small
megaloom trace, a small torch.profiler trace."""
from __future__ import annotations

import gzip
import json
import signal
from contextlib import contextmanager
from pathlib import Path

from megaloom.runtime.trace import Trace, TraceEvent


@contextmanager
def within(seconds: float):
    """Raise TimeoutError in the block once ``seconds`` have passed (SIGALRM: main thread only),
    so a case that would run on for minutes fails in bounded time."""
    def expire(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def small_trace(path: Path) -> Path:
    """A two-task megaloom trace saved at ``path``."""
    events = [TraceEvent(0, "mm", "matmul", "cube", 0, 0, 0.0, 1e-3, flops=1e6),
              TraceEvent(1, "act", "silu", "vector", 0, 0, 1e-3, 2e-3, deps=[0])]
    Trace(events, {"graph": "g", "units": {"cube": 1, "vector": 1}}).save(path)
    return path


def profiler_doc(events: list[dict]) -> dict:
    return {"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "NVIDIA A100-SXM4-40GB"}],
            "traceEvents": events}


def launch_and_kernel(corr: int = 1, ts: float = 0.0, **kernel_args) -> list[dict]:
    """A cudaLaunchKernel call on the host and the kernel it launched on stream 7."""
    return [{"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": ts, "dur": 2,
             "args": {"correlation": corr}},
            {"ph": "X", "cat": "kernel", "name": f"k{corr}", "pid": 0, "tid": 7, "ts": ts + 3, "dur": 4,
             "args": {"correlation": corr, "stream": 7, "device": 0, **kernel_args}}]


def write_profile_trace(path: Path, events: list[dict], gz: bool = False) -> Path:
    text = json.dumps(profiler_doc(events)).encode()
    path.write_bytes(gzip.compress(text) if gz else text)
    return path
