"""Task costs in bulk: each op's cost function asked once per distinct operands and attrs.

A task's cost is the one it was given, else its op's cost function of the shapes and dtypes
of its regions and of its attrs. Tasks alike in those share one Cost object, so a graph of
many tiles of one shape asks the cost function once per shape, not once per tile; the
shape-and-dtype rule of validation is asked the same way (:func:`operand_key`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Hashable

import numpy as np

from megaloom.runtime.registry import Cost, TensorSpec, get_op
from megaloom.runtime.task import NO_IO

if TYPE_CHECKING:
    from megaloom.runtime.buffers import Region
    from megaloom.runtime.graph import TaskGraph


def specs(regions: tuple[Region, ...]) -> list[TensorSpec]:
    return [TensorSpec(r.shape, r.dtype) for r in regions]


def operand_key(g: TaskGraph, tid: int) -> Hashable:
    """What decides task ``tid``'s shape rule and cost: its op, the shape and dtype of each
    region, its attrs; the task id itself when its attrs cannot be hashed."""
    ins, outs = g._io.get(tid, NO_IO)
    attrs = g._attrs.get(tid)
    key = (g._op[tid], tuple((r.shape, r.dtype) for r in ins), tuple((r.shape, r.dtype) for r in outs),
           tuple(attrs.items()) if attrs else ())
    try:
        hash(key)
    except TypeError:
        return tid
    return key


def cost_columns(g: TaskGraph) -> tuple[list[Cost], np.ndarray]:
    """``(table, codes)``: task ``i`` costs ``table[codes[i]]``. The table holds the costs given
    (each object once), then one cost per op for the tasks with neither regions nor attrs, then
    one per distinct :func:`operand_key` of the others. (Use ``g.cost_columns()``, cached.)"""
    table = list(g._cost_table)
    table[0] = Cost()  # code 0 (no cost given) is resolved below: no task keeps it
    codes = np.array(g._cost, dtype=np.int64)
    unset = codes == 0
    if not unset.any():
        return table, codes
    own = np.zeros(len(codes), dtype=bool)
    own[list(set(g._io).union(g._attrs))] = True
    ops = np.array(g._op, dtype=np.int64)
    bare = unset & ~own
    by_op = np.zeros(len(g._op_names), dtype=np.int64)
    for op in np.unique(ops[bare]).tolist():
        by_op[op] = len(table)
        table.append(get_op(g._op_names[op]).cost([], [], {}))
    codes[bare] = by_op[ops[bare]]
    memo: dict[Hashable, int] = {}
    for tid in np.flatnonzero(unset & own).tolist():
        key = operand_key(g, tid)
        code = memo.get(key)
        if code is None:
            ins, outs = g._io.get(tid, NO_IO)
            code = memo[key] = len(table)
            table.append(get_op(g._op_names[g._op[tid]]).cost(specs(ins), specs(outs), g._attrs.get(tid, {})))
        codes[tid] = code
    return table, codes
