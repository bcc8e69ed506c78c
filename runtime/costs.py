"""Task costs in bulk: each op's cost function asked once per distinct operands and attrs.

A task's cost is the one it was given, else its op's cost function of the shapes and dtypes
of its regions and of its attrs. Tasks alike in those share one Cost object, so a graph of
many tiles of one shape asks the cost function once per shape, not once per tile; the
shape-and-dtype rule of validation is asked the same way (:func:`per_operands`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Hashable, Iterable

import numpy as np

from megaloom.runtime.registry import Cost, TensorSpec, get_op
from megaloom.runtime.task import NO_IO

if TYPE_CHECKING:
    from megaloom.runtime.buffers import Region
    from megaloom.runtime.graph import TaskGraph


def specs(regions: tuple[Region, ...]) -> list[TensorSpec]:
    return [TensorSpec(r.shape, r.dtype) for r in regions]


def per_operands(g: TaskGraph, tids: Iterable[int], fn: Callable[[str, tuple, tuple, dict], Any]) -> dict[int, Any]:
    """``{tid: fn(op, inputs, outputs, attrs)}`` for tasks ``tids``, asked once per distinct op,
    regions and attrs (tiles alike share a key), and again only for distinct shapes and dtypes."""
    by_regions: dict[Hashable, Any] = {}
    by_specs: dict[Hashable, Any] = {}
    out = {}
    for tid in tids:
        ins, outs = g._io.get(tid, NO_IO)
        attrs = g._attrs.get(tid, {})
        key = (g._op[tid], ins, outs, tuple(attrs.items()))
        try:
            value = by_regions[key]
        except KeyError:
            spec = (key[0], *(tuple((r.shape, r.dtype) for r in rs) for rs in (ins, outs)), key[3])
            value = by_regions[key] = by_specs[spec] if spec in by_specs else \
                by_specs.setdefault(spec, fn(g._op_names[key[0]], ins, outs, attrs))
        except TypeError:  # attrs that cannot be hashed: asked for this task alone
            value = fn(g._op_names[g._op[tid]], ins, outs, attrs)
        out[tid] = value
    return out


def cost_columns(g: TaskGraph) -> tuple[list[Cost], np.ndarray]:
    """``(table, codes)``: task ``i`` costs ``table[codes[i]]``. The table holds the costs given
    (each object once), then one cost per op for the tasks with neither regions nor attrs, then
    the costs of the others (:func:`per_operands`). (Use ``g.cost_columns()``, cached.)"""
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
    code_of: dict[int, int] = {}
    found = per_operands(g, np.flatnonzero(unset & own).tolist(),
                         lambda op, ins, outs, attrs: get_op(op).cost(specs(ins), specs(outs), attrs))
    for tid, cost in found.items():
        code = code_of.get(id(cost))
        if code is None:
            code = code_of[id(cost)] = len(table)
            table.append(cost)
        codes[tid] = code
    return table, codes
