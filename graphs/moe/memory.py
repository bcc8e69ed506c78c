"""Workspace memory of a graph from its buffer lifetimes, and what a run really allocated."""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate
from typing import Mapping

import torch

from megaloom.runtime.graph import TaskGraph


@dataclass(slots=True)
class MemoryEstimate:
    """Workspace of one graph (graph inputs are the caller's and not counted).

    ``allocated_bytes``: every non-input buffer, which is what the executors allocate for a
    run (they allocate all buffers up front). ``peak_bytes``: the most bytes live at once
    when tasks run in topological order and each buffer lives from its first access to its
    last (outputs to the end): what a lifetime-aware allocator needs. ``saved_bytes``: the
    output buffers (results and activations kept for the backward pass).
    """

    allocated_bytes: int
    peak_bytes: int
    saved_bytes: int
    buffers: dict[str, int] = field(default_factory=dict)


def estimate_memory(graph: TaskGraph) -> MemoryEstimate:
    """Peak and total workspace bytes of ``graph`` from the tasks that touch each buffer."""
    order, tasks = graph.topological_order(), graph.tasks
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for s, tid in enumerate(order):
        for r in (*tasks[tid].inputs, *tasks[tid].outputs):
            first.setdefault(r.buffer.name, s)
            last[r.buffer.name] = s
    work = {b.name: b.nbytes for b in graph.buffers.values() if not b.is_input}
    end = len(order)
    delta = [0] * (end + 1)
    for name, nbytes in work.items():
        if name not in first:  # never touched: allocated for the whole run
            first[name], last[name] = 0, end
        delta[first[name]] += nbytes
        stop = end if graph.buffers[name].is_output else last[name] + 1
        delta[stop] -= nbytes
    saved = sum(n for k, n in work.items() if graph.buffers[k].is_output)
    return MemoryEstimate(sum(work.values()), max(0, *accumulate(delta)), saved, work)


def measured_bytes(graph: TaskGraph, buffers: Mapping[str, torch.Tensor]) -> int:
    """Bytes of storage a run allocated for the non-input buffers (``RunResult.buffers``)."""
    stores = (buffers[b.name].untyped_storage() for b in graph.buffers.values() if not b.is_input and b.name in buffers)
    return sum({st.data_ptr(): st.nbytes() for st in stores}.values())  # views of one storage count once
