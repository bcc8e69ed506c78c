"""Graphs as arrays: :meth:`TaskGraph.from_arrays` builds a large generated graph at once,
:meth:`TaskGraph.arrays` gives any graph's columns back for code that walks every task.

    g = TaskGraph.from_arrays((["noop"], np.zeros(n, np.int32)),        # (table, codes)
                              (indptr, indices),                        # CSR predecessors
                              engines=(["cube", "vector"], engine_codes),
                              costs=(cost_table, cost_codes))

Each column (``ops``, ``engines``, ``costs``) is one value for every task, a list or array
with one value per task, or a tuple ``(table, codes)``: an integer array indexing a table,
the compact form a generator makes. The checks are vectorised (NumPy) and name the task at
fault: a code outside its table, a predecessor that does not exist, a task waiting for itself;
an edge to a later task makes the build look for a cycle, which is named in full.

Costs in bulk (:func:`cost_columns`): a task's cost is the one it was given, else its op's
cost function of the shapes and dtypes of its regions and of its attrs. Tasks alike in those
share one Cost object, so a graph of many tiles of one shape asks the cost function once per
shape, not once per tile, and asks the shape rule for validation in the same pass (:func:`operand_facts`).
"""
from __future__ import annotations

from array import array
from collections import Counter
from dataclasses import dataclass
from itertools import accumulate, chain
from typing import TYPE_CHECKING, Any, Callable, Hashable

import numpy as np

from megaloom.runtime.errors import GraphError
from megaloom.runtime.registry import VECTOR, Cost, TensorSpec, get_op
from megaloom.runtime.task import NO_IO

if TYPE_CHECKING:
    from megaloom.runtime.buffers import Region
    from megaloom.runtime.graph import TaskGraph


@dataclass(frozen=True, slots=True)
class GraphArrays:
    """A graph's tasks as read-only NumPy columns. ``op[i]`` indexes ``op_names`` and
    ``engine[i]`` indexes ``engine_names``; task ``b`` waits for
    ``pred_idx[pred_ptr[b]:pred_ptr[b + 1]]`` and is waited for by
    ``succ_idx[succ_ptr[b]:succ_ptr[b + 1]]``, in the order of ``graph.pred`` and
    ``graph.succ``. The rest: ``graph.costs()`` (tasks sharing a cost share the object),
    ``graph.task_attrs`` and ``graph.task_tags`` (only the tasks that have them)."""

    op_names: tuple[str, ...]
    op: np.ndarray
    engine_names: tuple[str, ...]
    engine: np.ndarray
    pred_ptr: np.ndarray
    pred_idx: np.ndarray
    succ_ptr: np.ndarray
    succ_idx: np.ndarray


def _frozen(*arrays: np.ndarray) -> list[np.ndarray]:
    for a in arrays:
        a.flags.writeable = False
    return list(arrays)


def _csr_of(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    ptr = np.fromiter(accumulate(map(len, rows), initial=0), np.int64, len(rows) + 1)
    return ptr, np.fromiter(chain.from_iterable(rows), np.int32, int(ptr[-1]))


def graph_arrays(g: TaskGraph) -> GraphArrays:
    """The columns of ``g`` (use ``g.arrays()``, which keeps them until the graph changes)."""
    n = len(g)
    if g._pptr is not None:
        ptr, idx = np.array(g._pptr), np.array(g._pidx)
        order = np.argsort(idx, kind="stable")  # the edges came in task order: by successor, stably
        sptr = np.concatenate(([0], np.cumsum(np.bincount(idx, minlength=n))))
        sidx = np.repeat(np.arange(n, dtype=np.int32), np.diff(ptr))[order]
    else:
        (ptr, idx), (sptr, sidx) = _csr_of(g._pl), _csr_of(g._sl)
    return GraphArrays(tuple(g._op_names), *_frozen(np.array(g._op)), tuple(g._eng_names),
                       *_frozen(np.array(g._eng), ptr, idx, sptr, sidx))


def split_rows(ptr: np.ndarray, idx: np.ndarray) -> list[list[int]]:
    """CSR rows as lists of ints."""
    p, v = ptr.tolist(), idx.tolist()
    return [v[p[i]:p[i + 1]] for i in range(len(p) - 1)]


def _column(value: Any, n: int, what: str, key: Callable[[Any], Hashable] | None = None) -> tuple[list, np.ndarray]:
    """(table, codes) of a column given as ``(table, codes)``, one value or one per task (values
    alike by ``key``, default their own equality, share a table entry)."""
    if isinstance(value, tuple):
        if len(value) != 2:
            raise GraphError(f"from_arrays {what}: a tuple is (table, codes), got {len(value)} items")
        table, codes = list(value[0]), np.asarray(value[1])
        if codes.shape != (n,) or (n and codes.dtype.kind not in "iu"):
            raise GraphError(f"from_arrays {what}: codes must be {n} integers (one per task), got shape "
                             f"{codes.shape} of {codes.dtype}")
        if len(bad := np.flatnonzero((codes < 0) | (codes >= len(table)))):
            raise GraphError(f"from_arrays {what}: task {bad[0]} has code {codes[bad[0]]}, outside the table of "
                             f"{len(table)}")
        return table, codes.astype(np.int64, copy=False)
    if isinstance(value, str):
        return [value], np.zeros(n, np.int64)
    values = value.tolist() if isinstance(value, np.ndarray) else list(value)
    if len(values) != n:
        raise GraphError(f"from_arrays {what}: {len(values)} values for {n} tasks")
    keys = values if key is None else list(map(key, values))
    try:
        distinct = dict(zip(keys, values))
    except TypeError:
        raise GraphError(f"from_arrays {what}: one name per task expected, got {values[:3]!r:.80}") from None
    index = {k: i for i, k in enumerate(distinct)}
    return list(distinct.values()), np.fromiter(map(index.__getitem__, keys), np.int64, n)


def _costs(g: TaskGraph, costs: Any, n: int) -> np.ndarray:
    """The graph's cost code per task (0: none given), the distinct costs added to its table."""
    if costs is None or isinstance(costs, Cost):
        table, codes = [costs], np.zeros(n, np.int64)
    else:  # Cost objects are not hashable: alike by identity
        table, codes = _column(costs, n, "costs", key=id)
    if (bad := next((c for c in table if c is not None and not (isinstance(c, Cost) and c.valid())), None)) is not None:
        raise GraphError(f"from_arrays costs: {bad!r} is not a Cost with finite figures >= 0 (or None)")
    remap = np.array([0 if c is None else g._cost_code(c) for c in table] or [0], np.uint32)
    return remap[codes]


def _intern(g: TaskGraph, column: int, table: list, codes: np.ndarray, what: str) -> np.ndarray:
    """Graph codes (uint32) of a (table, codes) column of names, new names added in first-use order."""
    remap = np.zeros(max(len(table), 1), np.uint32)
    used, first = np.unique(codes, return_index=True)
    for c in used[np.argsort(first)].tolist():
        if not isinstance(table[c], str):
            task = int(np.argmax(codes == c))
            raise GraphError(f"from_arrays {what}: task {task} has {table[c]!r}, not a name")
        remap[c] = g._code(column, table[c])
    return remap[codes]


def default_engine(op: str) -> str:
    """The op's default engine kind ("vector" for an unknown op, which validate() reports)."""
    try:
        return get_op(op).engine
    except GraphError:
        return VECTOR  # unknown ops are reported by validate(), as for TaskGraph.task


def _preds(preds: Any) -> tuple[np.ndarray, np.ndarray]:
    if isinstance(preds, tuple) and len(preds) == 2:
        ptr, idx = np.asarray(preds[0]), np.asarray(preds[1])
    elif isinstance(preds, list):
        try:
            ptr = np.fromiter(accumulate(map(len, preds), initial=0), np.int64, len(preds) + 1)
        except TypeError:
            raise GraphError("from_arrays preds: a list of preds holds one sequence of task ids per task") from None
        idx = np.array(list(chain.from_iterable(preds)) or np.zeros(0, np.int64))  # its dtype is checked below
    else:
        raise GraphError("from_arrays preds: give (indptr, indices) as a tuple, or a list of per-task lists")
    if ptr.ndim != 1 or idx.ndim != 1 or len(ptr) == 0 or (ptr.size and ptr.dtype.kind not in "iu") \
            or (idx.size and idx.dtype.kind not in "iu"):
        raise GraphError("from_arrays preds: indptr and indices must be 1-d integer arrays, indptr of n + 1 entries")
    steps = np.diff(ptr)
    if ptr[0] != 0 or ptr[-1] != len(idx) or (steps < 0).any():
        raise GraphError(f"from_arrays preds: indptr must start at 0, never decrease and end at len(indices) = "
                         f"{len(idx)}" + (f" (it decreases after task {np.argmax(steps < 0)})" if (steps < 0).any()
                                          else ""))
    if len(ptr) - 1 >= 2**31:
        raise GraphError(f"from_arrays: {len(ptr) - 1} tasks; at most 2**31 - 1")
    return ptr.astype(np.int64, copy=False), idx.astype(np.int64, copy=False)


def _fill(code: str, values: np.ndarray) -> array:
    return array(code, np.asarray(values, dtype=np.dtype(code)).tobytes())


def from_arrays(g: TaskGraph, ops: Any, preds: Any, *, engines: Any = None, costs: Any = None,
                priorities: Any = None, names: Any = None) -> TaskGraph:
    """Fill the empty graph ``g`` with tasks ``0..n-1`` (see the module docstring).

    ``preds`` is ``(indptr, indices)`` (task ``b`` waits for ``indices[indptr[b]:indptr[b + 1]]``)
    or a list of per-task lists; a task listed twice counts once. ``engines`` (None: each op's
    own engine kind) and ``costs`` (None: the op's cost function) are columns like ``ops``;
    ``priorities`` are integers, ``names`` strings (default ``op#id``), one per task.
    """
    if len(g):
        raise GraphError(f"graph {g.name!r} already has tasks; from_arrays builds a new graph")
    ptr, idx = _preds(preds)
    n = len(ptr) - 1
    op = _intern(g, 0, *_column(ops, n, "ops"), "ops")
    if engines is None:
        eng = _intern(g, 1, [default_engine(o) for o in g._op_names], op.astype(np.int64), "engines")
    else:
        eng = _intern(g, 1, *_column(engines, n, "engines"), "engines")
    cost = _costs(g, costs, n)
    given = _names(names, n)

    def name(i: int) -> str:
        return given[i] if given is not None else f"{g._op_names[op[i]]}#{i}"

    rows = np.repeat(np.arange(n, dtype=np.int64), np.diff(ptr))
    if len(bad := np.flatnonzero((idx < 0) | (idx >= n) | (idx == rows))):
        b, a = int(rows[bad[0]]), int(idx[bad[0]])
        why = "cannot wait for itself" if a == b else f"waits for task id {a}, but the graph has {n} tasks (0..{n - 1})"
        raise GraphError(f"graph {g.name!r}: task {name(b)!r} {why}", tasks=(name(b),))
    if ((rows[1:] == rows[:-1]) & (idx[1:] <= idx[:-1])).any():  # a row out of order may list a task twice
        ptr, idx = _csr_of([list(dict.fromkeys(r)) for r in split_rows(ptr, idx)])
        rows = np.repeat(np.arange(n, dtype=np.int64), np.diff(ptr))
    if priorities is not None:
        prio = np.asarray(priorities)
        if prio.shape != (n,) or (n and prio.dtype.kind not in "iu"):
            raise GraphError(f"from_arrays priorities: {n} integers expected (one per task)")
        nz = np.flatnonzero(prio)
        g._prio = dict(zip(nz.tolist(), prio[nz].tolist()))
    g._op, g._eng, g._cost = _fill("I", op), _fill("I", eng), _fill("I", cost)
    g._pptr, g._pidx = _fill("q", ptr), _fill("i", idx)
    if given is not None:
        g._names = [None if s == f"{g._op_names[c]}#{i}" else s for i, (s, c) in enumerate(zip(given, g._op))]
        g._by_name = {s: i for i, s in enumerate(g._names) if s is not None}
    g._forward_only = bool((idx < rows).all())
    g._version += 1
    if not g._forward_only:
        g.topological_order()  # a cycle raises GraphError naming its tasks
    return g


def _names(names: Any, n: int) -> list[str] | None:
    if names is None:
        return None
    given = list(names)
    if len(given) != n or not all(isinstance(s, str) for s in given):
        raise GraphError(f"from_arrays names: {n} strings expected (one per task)")
    if len(set(given)) != n:
        dup = next(s for s, k in Counter(given).items() if k > 1)
        raise GraphError(f"task name {dup!r} is used twice", tasks=(dup,))
    return given


def specs(regions: tuple[Region, ...]) -> list[TensorSpec]:
    return [TensorSpec(r.shape, r.dtype) for r in regions]


def shape_problem(op: str, ins: tuple[Region, ...], outs: tuple[Region, ...], attrs: dict) -> str | None:
    """Why the op's shape rule refuses these operands (None: the outputs are what it makes)."""
    try:
        want = get_op(op).shape(specs(ins), attrs)
    except Exception as e:  # a shape rule given operands it does not expect may raise anything
        return str(e) if isinstance(e, GraphError) else f"shape rule of op {op!r} failed: {type(e).__name__}: {e}"
    if len(want) != len(outs):
        return f"op {op!r} makes {len(want)} outputs, task declares {len(outs)}"
    for i, (w, r) in enumerate(zip(want, outs)):
        if tuple(w.shape) != r.shape or w.dtype != r.dtype:
            return f"output {i} ({r}) is {r.shape} {r.dtype}, op {op!r} makes {tuple(w.shape)} {w.dtype}"
    return None


def _facts(op: str, ins: tuple[Region, ...], outs: tuple[Region, ...], attrs: dict) -> tuple[str | None, Cost | None]:
    why = shape_problem(op, ins, outs, attrs)
    return why, None if why else get_op(op).cost(specs(ins), specs(outs), attrs)


def operand_facts(g: TaskGraph) -> dict[int, tuple[str | None, Cost | None]]:
    """``{tid: (shape problem, cost)}`` for the tasks with regions or attrs (the cost of operands
    the shape rule accepts, else None), asked once per distinct op, regions and attrs (tiles alike
    share a key), and again only for distinct shapes and dtypes: validation and costs read it
    (cached on the graph as ``"operand_facts"``)."""
    by_regions: dict[Hashable, Any] = {}
    by_specs: dict[Hashable, Any] = {}
    out = {}
    for tid in sorted(set(g._io).union(g._attrs)):
        ins, outs = g._io.get(tid, NO_IO)
        attrs = g._attrs.get(tid, {})
        key = (g._op[tid], ins, outs, tuple(attrs.items()))
        try:
            value = by_regions[key]
        except KeyError:
            spec = (key[0], *(tuple((r.shape, r.dtype) for r in rs) for rs in (ins, outs)), key[3])
            value = by_regions[key] = by_specs[spec] if spec in by_specs else \
                by_specs.setdefault(spec, _facts(g._op_names[key[0]], ins, outs, attrs))
        except TypeError:  # attrs that cannot be hashed: asked for this task alone
            value = _facts(g._op_names[g._op[tid]], ins, outs, attrs)
        out[tid] = value
    return out


def cost_columns(g: TaskGraph) -> tuple[list[Cost], np.ndarray]:
    """``(table, codes)``: task ``i`` costs ``table[codes[i]]``. The table holds the costs given
    (each object once), then one cost per op for the tasks with neither regions nor attrs, then
    the costs of the others (:func:`operand_facts`). (Use ``g.cost_columns()``, cached.)"""
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
    facts, found = g.cached("operand_facts", lambda: operand_facts(g)), {}
    for tid in np.flatnonzero(unset & own).tolist():  # a task the shape rule refuses: its cost asked alone
        ins, outs = g._io.get(tid, NO_IO)
        found[tid] = facts[tid][1] or get_op(g._op_names[g._op[tid]]).cost(specs(ins), specs(outs),
                                                                            g._attrs.get(tid, {}))
    distinct = {id(c): c for c in found.values()}  # each Cost object once
    code_of = {k: len(table) + i for i, k in enumerate(distinct)}
    table += distinct.values()
    codes[list(found)] = [code_of[id(c)] for c in found.values()]
    return table, codes
