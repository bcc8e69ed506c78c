"""Recording and predicting one side of a pair: profile a step with torch.profiler, replay the
trace with and without a what-if, and time steps."""
from __future__ import annotations

import os
import tempfile
import time
from typing import Callable

import torch

from megaloom.scheduler.importers import load_traces
from megaloom.scheduler.profile import HardwareProfile
from megaloom.scheduler.replay import WhatIf, replay

TRACE_DIR = tempfile.mkdtemp(prefix="whatif-")
STEPS = 4
"""Steps per timed run and per recorded trace."""


def profile_steps(step: Callable[[], None], name: str, steps: int = STEPS, warmup: int = 2, tries: int = 3) -> str:
    """Run ``step`` ``warmup`` times, then record ``steps`` of it ``tries`` times and keep the
    least disturbed recording (the shortest: on a shared machine, the one others slowed least);
    the trace's path."""
    for _ in range(warmup):
        step()
    path, best = os.path.join(TRACE_DIR, f"{name}.json"), float("inf")
    for _ in range(tries):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
            t = time.perf_counter()
            for _ in range(steps):
                step()
            t = time.perf_counter() - t
        if t < best:
            prof.export_chrome_trace(path)
            best = t
    return path


def predicted_ratio(paths: list[str], whatif: WhatIf, profile: HardwareProfile | str | None = None) -> float:
    """The what-if's replayed span over the identity replay's, from the recorded traces alone."""
    trace, _ = load_traces(paths)
    base = replay(trace, recorded_profile=profile).trace
    changed = replay(trace, recorded_profile=profile, whatif=whatif).trace
    return changed.makespan / base.makespan


def timed(step: Callable[[], None], steps: int = STEPS) -> float:
    """CPU seconds of this process for ``steps`` steps: on one thread, the step's time without
    what other processes on a shared machine take from it (wall time would count that too)."""
    t = time.process_time()
    for _ in range(steps):
        step()
    return time.process_time() - t
