"""Graph IR: buffers, regions of buffers, tasks, and the task graph builder.

Dependencies are derived from the regions each task reads and writes, in the order
tasks are added (sequential task flow, as StarPU's access modes): a read depends on
earlier overlapping writes (RAW), a write on earlier overlapping reads (WAR) and
writes (WAW). Explicit control edges can be added with ``precede``/``succeed``.

    g = TaskGraph("mlp")
    x, w = g.input("x", (128, 64)), g.input("w", (64, 32))
    y = g.output("y", (128, 32))
    h = g.buffer("h", (128, 32))
    g.task("matmul", [x, w], [h], engine="cube")
    g.task("silu", [h], [y])
"""
from __future__ import annotations

import operator
import os
import threading
from array import array
from collections import Counter
from dataclasses import dataclass
from graphlib import CycleError, TopologicalSorter
from itertools import accumulate, chain
from types import MappingProxyType
from typing import Any, Iterable, Mapping, Sequence

from megaloom.runtime.bulk import GraphArrays, from_arrays, graph_arrays, split_rows
from megaloom.runtime.compose import Composed, compose
from megaloom.runtime.dot import to_dot
from megaloom.runtime.dtypes import dtype_name, itemsize
from megaloom.runtime.errors import GraphError
from megaloom.runtime.files import gc_paused
from megaloom.runtime.region import Box, BoxIndex, box_shape, box_size, full_box, in_bounds
from megaloom.runtime.registry import Cost, TensorSpec, get_op
from megaloom.runtime.serialize import fill_graph, graph_to_dict, read_graph, save_graph
from megaloom.runtime.validate import validate


@dataclass(eq=False, slots=True)
class Buffer:
    """A named tensor slot. ``is_input``: the caller provides it; ``is_output``: returned."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    is_input: bool = False
    is_output: bool = False

    @property
    def full(self) -> Region:
        """The region covering the whole buffer."""
        return Region(self, full_box(self.shape))

    @property
    def nbytes(self) -> int:
        return box_size(full_box(self.shape)) * itemsize(self.dtype)

    def __getitem__(self, index: Any) -> Region:
        return self.full[index]

    def region(self, box: Box) -> Region:
        """The region of this buffer covering ``box`` (one (start, stop) pair per dim)."""
        return Region(self, tuple(tuple(b) for b in box))

    def split(self, dim: int, size: int) -> list[Region]:
        """Tiles of at most ``size`` elements along ``dim`` (the last may be shorter)."""
        return self.full.split(dim, size)

    def __repr__(self) -> str:
        return f"Buffer({self.name!r}, {self.shape}, {self.dtype})"


@dataclass(frozen=True, slots=True)
class Region:
    """A box of a buffer: one (start, stop) pair per dim."""

    buffer: Buffer
    box: Box

    @property
    def shape(self) -> tuple[int, ...]:
        return box_shape(self.box)

    @property
    def dtype(self) -> str:
        return self.buffer.dtype

    @property
    def nbytes(self) -> int:
        return box_size(self.box) * itemsize(self.buffer.dtype)

    def __getitem__(self, index: Any) -> Region:
        """Sub-region by integer-free basic slicing, e.g. ``buf[0:64, :]``."""
        if not isinstance(index, tuple):
            index = (index,)
        if len(index) > len(self.box):
            raise GraphError(f"too many indices for {self}")
        box = list(self.box)
        for d, ix in enumerate(index):
            if not isinstance(ix, slice) or ix.step not in (None, 1):
                raise GraphError(f"regions take unit-step slices only, got {ix!r} for {self}")
            lo, hi = box[d]
            try:
                start, stop, _ = ix.indices(hi - lo)
            except TypeError:
                raise GraphError(f"regions take integer slice bounds, got {ix!r} for {self}") from None
            box[d] = (lo + start, lo + max(start, stop))
        return Region(self.buffer, tuple(box))

    def split(self, dim: int, size: int) -> list[Region]:
        """Tiles of at most ``size`` elements along ``dim``."""
        dim, size = _integer(dim, f"split dim of {self}"), _integer(size, f"tile size of {self}")
        if not 0 <= dim < len(self.box):
            raise GraphError(f"cannot split {self} along dim {dim}: it has {len(self.box)} dims")
        if size <= 0:
            raise GraphError(f"tile size must be positive, got {size}")
        lo, hi = self.box[dim]
        out = []
        for a in range(lo, hi, size):
            box = list(self.box)
            box[dim] = (a, min(a + size, hi))
            out.append(Region(self.buffer, tuple(box)))
        return out

    def __repr__(self) -> str:
        if self.box == full_box(self.buffer.shape):
            return self.buffer.name
        return f"{self.buffer.name}[{', '.join(f'{a}:{b}' for a, b in self.box)}]"


RegionLike = "Buffer | Region"


class Task:
    """One node: an op run on one unit of one engine kind.

    A light view of row ``id`` of its graph's columns (op, engine, cost, edges; regions,
    attrs, tags and priority kept only for the tasks that have them); the graph makes one
    view per task, on first use, and hands out that same object every time. ``attrs`` and
    ``tags`` are the task's own dicts (an empty one is stored in the graph on its first change).
    Builder methods return the task, so calls chain: ``a.precede(b, c)``.
    """

    __slots__ = ("graph", "id", "op", "engine")

    def __init__(self, graph: TaskGraph, tid: int, op: str, engine: str):
        self.graph, self.id, self.op, self.engine = graph, tid, op, engine

    @property
    def name(self) -> str:
        names = self.graph._names
        name = names[self.id] if names is not None else None
        return name if name is not None else f"{self.op}#{self.id}"

    @property
    def inputs(self) -> tuple[Region, ...]:
        return self.graph._io.get(self.id, _NO_IO)[0]

    @property
    def outputs(self) -> tuple[Region, ...]:
        return self.graph._io.get(self.id, _NO_IO)[1]

    @property
    def attrs(self) -> dict[str, Any]:
        d = self.graph._attrs.get(self.id)
        return d if d is not None else _unstored(self.graph._attrs, self.id)

    @property
    def tags(self) -> dict[str, Any]:
        d = self.graph._tags.get(self.id)
        return d if d is not None else _unstored(self.graph._tags, self.id)

    @property
    def priority(self) -> int:
        return self.graph._prio.get(self.id, 0)

    @property
    def cost(self) -> Cost | None:
        """The cost given when the task was added (None: the op's cost function decides)."""
        return self.graph._cost[self.id]

    def precede(self, *tasks: Task) -> Task:
        """Make every task in ``tasks`` wait for this one."""
        for t in tasks:
            self.graph.edge(self, t)
        return self

    def succeed(self, *tasks: Task) -> Task:
        """Make this task wait for every task in ``tasks``."""
        for t in tasks:
            self.graph.edge(t, self)
        return self

    @property
    def successors(self) -> list[Task]:
        return [self.graph.tasks[i] for i in self.graph.succ[self.id]]

    @property
    def predecessors(self) -> list[Task]:
        return [self.graph.tasks[i] for i in self.graph.preds_of(self.id)]

    def __repr__(self) -> str:
        return f"Task({self.name!r}, op={self.op!r}, engine={self.engine!r})"


_NO_IO: tuple[tuple, tuple] = ((), ())
_MAKING = threading.RLock()  # making task views or edge lists on first use


class _Unstored(dict):
    """The empty attrs or tags of a task that has none: a dict that joins the graph's column
    on its first change, so reading them costs no memory."""

    __slots__ = ("column", "tid")


def _changes(method: str):
    def change(self: _Unstored, *args, **kw):
        stored = self.column.setdefault(self.tid, self)
        if stored is not self:  # another view of the same task's dict was stored first
            getattr(stored, method)(*args, **kw)
        return getattr(dict, method)(self, *args, **kw)
    return change


for _m in ("__setitem__", "__delitem__", "__ior__", "update", "setdefault", "pop", "popitem", "clear"):
    setattr(_Unstored, _m, _changes(_m))


def _unstored(column: dict[int, dict], tid: int) -> dict[str, Any]:
    d = _Unstored()
    d.column, d.tid = column, tid
    return d


def _integer(v: Any, what: str) -> int:
    """``v`` as an int (Python or NumPy integer); a float, string or bool raises GraphError."""
    if isinstance(v, bool) or not hasattr(type(v), "__index__"):
        raise GraphError(f"{what} must be an integer, got {v!r}")
    return operator.index(v)


class TaskGraph:
    """A DAG of tasks over buffers; the same graph runs on every executor.

    Per-task state is columns: op and engine as indices into name tables, the cost given
    (or None), and the edges as predecessor lists in CSR form, appended to as tasks are
    added; regions, attrs, tags, priorities and non-default names are kept only for the
    tasks that have them. ``tasks``, ``pred`` and ``succ`` are made from the columns on
    first use (:class:`Task` views, lists of ids) and kept up to date from then on; an
    edge into an earlier task turns the edges into those lists for good. :meth:`from_arrays`
    builds a large graph from arrays at once; :meth:`arrays` gives the columns back.
    """

    def __init__(self, name: str = "graph"):
        self.name = name
        self.buffers: dict[str, Buffer] = {}
        self._op_names: list[str] = []
        self._eng_names: list[str] = []
        self._codes: tuple[dict[str, int], dict[str, int]] = ({}, {})  # op, engine name -> index
        self._op, self._eng = array("I"), array("I")
        self._cost: list[Cost | None] = []
        self._io: dict[int, tuple[tuple[Region, ...], tuple[Region, ...]]] = {}  # tasks with regions
        self._attrs: dict[int, dict[str, Any]] = {}
        self._tags: dict[int, dict[str, Any]] = {}
        self._prio: dict[int, int] = {}
        self._names: list[str | None] | None = None  # given names (None: "op#id"); None until one is given
        self._by_name: dict[str, int] = {}  # given names only
        self._pptr: array | None = array("q", [0])  # CSR predecessors; None once the edges are lists
        self._pidx: array | None = array("i")
        self._pl: list[list[int]] | None = None  # predecessor and successor lists, made on first use
        self._sl: list[list[int]] | None = None
        self._views: list[Task] = []
        self._accesses: dict[str, tuple[BoxIndex, BoxIndex]] = {}  # buffer -> (reads, writes)
        self._forward_only = True
        self._hazards_ordered = True  # edges include the derived ones (not so for a loaded file)
        self._version = 0  # bumped by every change; keys the caches below
        self._cache: dict[str, tuple[int, object]] = {}

    def cached(self, key: str, make):
        """``make()``, computed once per graph version under ``key`` (any change to the graph
        recomputes it)."""
        hit = self._cache.get(key)
        if hit is not None and hit[0] == self._version:
            return hit[1]
        value = make()
        self._cache[key] = (self._version, value)
        return value

    @property
    def forward_only(self) -> bool:
        """True when every edge goes from a task to a later-added one (task ids are then a
        topological order)."""
        return self._forward_only

    @property
    def hazards_derived(self) -> bool:
        """True when the edges include every hazard derived from buffer accesses; False for a
        graph whose edges were set as a file states them (:meth:`set_edges`)."""
        return self._hazards_ordered

    @staticmethod
    def as_region(x: Buffer | Region) -> Region:
        """``x`` as a region: a buffer stands for all of it."""
        if isinstance(x, Region):
            return x
        if isinstance(x, Buffer):
            return x.full
        raise GraphError(f"expected a Buffer or Region, got {type(x).__name__}")

    # -- buffers ---------------------------------------------------------------------
    def add_buffer(self, name: str, shape: Sequence[int], dtype: Any = "float32", *,
                   is_input: bool = False, is_output: bool = False) -> Buffer:
        """A buffer of any role (:meth:`input`, :meth:`output`, :meth:`inout` and :meth:`buffer`
        name the four)."""
        inp, out = bool(is_input), bool(is_output)
        if not isinstance(name, str):
            raise GraphError(f"a buffer name must be a string, got {name!r}")
        if name in self.buffers:
            raise GraphError(f"buffer {name!r} already exists in graph {self.name!r}")
        if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
            raise GraphError(f"buffer {name!r}: shape must be a sequence of integers, got {shape!r}")
        shape = tuple(_integer(s, f"buffer {name!r}: dim {d}") for d, s in enumerate(shape))
        if any(s < 0 for s in shape):
            raise GraphError(f"buffer {name!r} has a negative dim: {shape}")
        buf = Buffer(name, shape, dtype_name(dtype), inp, out)
        self.buffers[name] = buf
        self._accesses[name] = (BoxIndex(), BoxIndex())
        self._version += 1
        return buf

    def input(self, name: str, shape: Sequence[int], dtype: Any = "float32") -> Buffer:
        """A buffer the caller provides."""
        return self.add_buffer(name, shape, dtype, is_input=True)

    def output(self, name: str, shape: Sequence[int], dtype: Any = "float32") -> Buffer:
        """A buffer the run returns."""
        return self.add_buffer(name, shape, dtype, is_output=True)

    def inout(self, name: str, shape: Sequence[int], dtype: Any = "float32") -> Buffer:
        """A buffer the caller provides and the run returns (updated in place)."""
        return self.add_buffer(name, shape, dtype, is_input=True, is_output=True)

    def buffer(self, name: str, shape: Sequence[int], dtype: Any = "float32") -> Buffer:
        """A scratch buffer internal to the graph."""
        return self.add_buffer(name, shape, dtype)

    @property
    def task_attrs(self) -> Mapping[int, dict[str, Any]]:
        """``{task id: attrs}`` for the tasks that have attrs (read-only). A loop over every task
        reads this rather than ``t.attrs``, which makes an empty dict for each task without."""
        return MappingProxyType(self._attrs)

    @property
    def task_tags(self) -> Mapping[int, dict[str, Any]]:
        """``{task id: tags}`` for the tasks that have tags (read-only), as :attr:`task_attrs`."""
        return MappingProxyType(self._tags)

    @property
    def inputs(self) -> list[Buffer]:
        return [b for b in self.buffers.values() if b.is_input]

    @property
    def outputs(self) -> list[Buffer]:
        return [b for b in self.buffers.values() if b.is_output]

    # -- tasks -----------------------------------------------------------------------
    def task(
        self,
        op: str,
        inputs: Iterable[Buffer | Region] = (),
        outputs: Iterable[Buffer | Region] = (),
        *,
        name: str | None = None,
        engine: str | None = None,
        attrs: dict[str, Any] | None = None,
        priority: int = 0,
        tags: dict[str, Any] | None = None,
        cost: Cost | None = None,
        after: Iterable[Task] = (),
    ) -> Task:
        """Add a task; its dependencies follow from the regions it reads and writes.

        ``engine`` defaults to the op's default engine kind; ``cost`` overrides the op's
        cost function; ``after`` adds control edges.
        """
        if not isinstance(op, str) or not isinstance(name, (str, type(None))) or not isinstance(engine, (str, type(None))):
            raise GraphError(f"task {name!r}: op, name and engine must be strings, got {op!r}, {name!r}, {engine!r}")
        priority = _integer(priority, f"task {name or op!r}: priority")
        if cost is not None and not (isinstance(cost, Cost) and cost.valid()):
            raise GraphError(f"task {name or op!r}: cost {cost!r} needs finite flops, bytes and comm bytes >= 0")
        ins = tuple(self.as_region(r) for r in inputs)
        outs = tuple(self.as_region(r) for r in outputs)
        tid = len(self._op)
        default = f"{op}#{tid}"
        if name is None:
            name = default
        if name in self._by_name or (name is not default and self.task_id(name) is not None):
            raise GraphError(f"task name {name!r} is used twice in graph {self.name!r}", tasks=(name,))
        for r in ins + outs:
            if self.buffers.get(r.buffer.name) is not r.buffer:
                raise GraphError(f"task {name!r} uses buffer {r.buffer.name!r} of another graph", tasks=(name,))
            if not in_bounds(r.box, r.buffer.shape):
                raise GraphError(f"task {name!r}: region {r} is outside buffer shape {r.buffer.shape}", tasks=(name,))
        waits = []
        for a in after:
            ta = self[a] if isinstance(a, str) else a
            if ta.graph is not self:
                raise GraphError(f"edge {ta.name!r} -> {name!r} joins tasks of different graphs")
            waits.append(ta.id)
        if engine is None:
            try:
                engine = get_op(op).engine
            except GraphError:
                engine = "vector"  # unknown ops are reported by validate()
        code = self._codes[0].get(op)
        self._op.append(code if code is not None else self._code(0, op))
        code = self._codes[1].get(engine)
        self._eng.append(code if code is not None else self._code(1, engine))
        self._cost.append(cost)
        if ins or outs:
            self._io[tid] = (ins, outs)
        if attrs:
            self._attrs[tid] = dict(attrs)
        if tags:
            self._tags[tid] = dict(tags)
        if priority:
            self._prio[tid] = priority
        if name != default or self._names is not None:
            self._name(tid, None if name == default else name)
        self._version += 1
        preds = self._derive(tid, ins, outs)
        self._add_row(list(dict.fromkeys(preds + waits)) if waits else preds)  # control edges after derived ones
        if len(self._views) == tid:
            self._views.append(Task(self, tid, op, engine))
        return self.tasks[tid]

    def _code(self, column: int, name: str) -> int:
        """The index of ``name`` in the op (0) or engine (1) name table, added if new."""
        codes = self._codes[column]
        code = codes.get(name)
        if code is None:
            code = codes[name] = len(codes)
            (self._op_names, self._eng_names)[column].append(name)
        return code

    def _name(self, tid: int, name: str | None) -> None:
        if self._names is None:
            self._names = [None] * tid
        self._names.append(name)
        if name is not None:
            self._by_name[name] = tid

    def _derive(self, tid: int, ins: tuple[Region, ...], outs: tuple[Region, ...]) -> list[int]:
        """The new task's predecessors by its accesses, in id order; records the accesses."""
        acc = self._accesses
        before: set[int] = set()
        for r in ins:
            before.update(o for _, o in acc[r.buffer.name][1].overlapping(r.box))  # RAW: after earlier writes
        for r in outs:
            reads, writes = acc[r.buffer.name]
            before.update(o for _, o in reads.overlapping(r.box))   # WAR: after earlier reads
            before.update(o for _, o in writes.overlapping(r.box))  # WAW: after earlier writes
        before.discard(tid)
        for r in ins:
            acc[r.buffer.name][0].add(r.box, tid)
        for r in outs:
            reads, writes = acc[r.buffer.name]
            # earlier accesses inside this write are ordered before it, so it stands for them
            reads.drop_inside(r.box, tid)
            writes.drop_inside(r.box, tid)
            writes.add(r.box, tid)
        return sorted(before)

    def _add_row(self, preds: list[int]) -> None:
        """The edges of the newest task (its predecessors, all earlier tasks)."""
        tid = len(self._op) - 1
        if self._pptr is not None:
            self._pidx.extend(preds)
            self._pptr.append(len(self._pidx))
        if self._pl is not None:
            self._pl.append(preds)
            self._sl.append([])
            for a in preds:
                self._sl[a].append(tid)
        if preds:
            self._version += 1

    def _link(self, a: int, b: int) -> None:
        if a in self.preds_of(b):
            return
        if a >= b:
            self._forward_only = False
        if self._pptr is not None and b != len(self._op) - 1:  # into an earlier task: the edges become lists
            self._lists()
            self._pptr = self._pidx = None
        if self._pptr is not None:  # into the newest task: its CSR row is the last
            self._pidx.append(a)
            self._pptr[-1] += 1
        if self._pl is not None:
            self._pl[b].append(a)
            self._sl[a].append(b)
        self._version += 1

    def edge(self, a: Task | str, b: Task | str) -> None:
        """Control edge: ``b`` waits for ``a``."""
        ta, tb = self[a] if isinstance(a, str) else a, self[b] if isinstance(b, str) else b
        if ta.graph is not self or tb.graph is not self:
            raise GraphError(f"edge {ta.name!r} -> {tb.name!r} joins tasks of different graphs")
        if ta.id == tb.id:
            raise GraphError(f"task {ta.name!r} cannot wait for itself", tasks=(ta.name,), cycle=(ta.name, ta.name))
        self._link(ta.id, tb.id)

    def task_id(self, name: str) -> int | None:
        """The id of the task called ``name``, or None (a task with no given name is ``op#id``)."""
        tid = self._by_name.get(name)
        if tid is None:
            op, _, k = name.rpartition("#")
            if k.isascii() and k.isdigit() and str(int(k)) == k and int(k) < len(self._op) \
                    and (self._names is None or self._names[int(k)] is None) and self._op_names[self._op[int(k)]] == op:
                return int(k)
        return tid

    def __getitem__(self, name: str) -> Task:
        tid = self.task_id(name) if isinstance(name, str) else None
        if tid is None:
            raise GraphError(f"graph {self.name!r} has no task {name!r}")
        return self.tasks[tid]

    def __len__(self) -> int:
        return len(self._op)

    def __iter__(self):
        return iter(self.tasks)

    @property
    def tasks(self) -> list[Task]:
        """Every task, by id: one :class:`Task` view each (made on first use, then kept)."""
        views = self._views
        if len(views) < len(self._op):
            with _MAKING:  # worker threads may ask at once: the views are made once, in order
                k, ops, engines = len(views), self._op_names, self._eng_names
                views.extend(Task(self, i, ops[o], engines[e]) for i, o, e in zip(range(k, len(self._op)),
                                                                                 self._op[k:], self._eng[k:]))
        return views

    # -- structure -------------------------------------------------------------------
    @property
    def pred(self) -> list[list[int]]:
        """``pred[b]``: the ids of the tasks task ``b`` waits for, in the order the edges came."""
        return self._lists()[0]

    @property
    def succ(self) -> list[list[int]]:
        """``succ[a]``: the ids of the tasks waiting for task ``a``, in the order the edges came."""
        return self._lists()[1]

    def preds_of(self, b: int) -> Sequence[int]:
        """``pred[b]`` without making every task's list."""
        if self._pl is not None:
            return self._pl[b]
        return self._pidx[self._pptr[b]:self._pptr[b + 1]]

    def _lists(self) -> tuple[list[list[int]], list[list[int]]]:
        if self._pl is None:
            with _MAKING:
                if self._pl is None:
                    a = self.arrays()
                    self._sl = split_rows(a.succ_ptr, a.succ_idx)
                    self._pl = split_rows(a.pred_ptr, a.pred_idx)  # last: it says both are there
        return self._pl, self._sl

    def arrays(self) -> GraphArrays:
        """The graph's columns as read-only NumPy arrays (see :class:`GraphArrays`), for code
        that walks every task: one call per graph version, the same object until a change."""
        return self.cached("arrays", lambda: graph_arrays(self))

    def topological_order(self) -> list[int]:
        """Task ids in an order that respects every edge; a cycle raises GraphError."""
        if self._forward_only:
            return list(range(len(self)))
        ts = TopologicalSorter({i: p for i, p in enumerate(self.pred)})
        try:
            return list(ts.static_order())
        except CycleError as e:
            cyc = tuple(self.tasks[i].name for i in e.args[1])
            raise GraphError(f"cycle in graph {self.name!r}: {' -> '.join(cyc)}", tasks=cyc, cycle=cyc) from None

    def engines(self) -> list[str]:
        """Engine kinds used by the graph, in first-use order."""
        return [self._eng_names[c] for c in dict.fromkeys(self._eng)]

    def reaches(self, a: int, b: int) -> bool:
        """True when task ``b`` transitively depends on task ``a``."""
        if a == b:
            return True
        seen, stack = {b}, [b]
        while stack:
            for p in self.preds_of(stack.pop()):
                if p == a:
                    return True
                if p not in seen and (not self._forward_only or p > a):
                    seen.add(p)
                    stack.append(p)
        return False

    def validate(self) -> TaskGraph:
        """Check every rule; raise GraphError naming the tasks of the first broken rule. A graph
        that passed is not checked again until it changes (see :attr:`validated`)."""
        self.cached("validated", lambda: validate(self) or True)
        return self

    @property
    def validated(self) -> bool:
        """True when :meth:`validate` passed on the graph as it is now."""
        return self._cache.get("validated", (None,))[0] == self._version

    def costs(self) -> list[Cost]:
        """Every task's cost, by task id (computed once per graph version; tasks of one op with
        no regions and no attrs share one Cost object)."""
        return self.cached("costs", self._compute_costs)

    def task_cost(self, t: Task) -> Cost:
        """The task's cost: its own override, else the op's cost function."""
        return self.costs()[t.id]

    def _compute_costs(self) -> list[Cost]:
        out, bare = list(self._cost), {}
        for i in [i for i, c in enumerate(out) if c is None]:
            op = self._op_names[self._op[i]]
            if i in self._io or i in self._attrs:
                ins, outs = self._io.get(i, _NO_IO)
                out[i] = get_op(op).cost([TensorSpec(r.shape, r.dtype) for r in ins],
                                         [TensorSpec(r.shape, r.dtype) for r in outs], self._attrs.get(i, {}))
            else:
                out[i] = bare.get(op) or bare.setdefault(op, get_op(op).cost([], [], {}))
        return out

    def summary(self) -> str:
        """A short text table: tasks per engine and op, buffers, edges."""
        by_engine = Counter(self._eng_names[c] for c in self._eng)
        by_op = Counter(self._op_names[c] for c in self._op)
        n_edges = len(self._pidx) if self._pidx is not None else sum(map(len, self._pl))
        lines = [f"graph {self.name!r}: {len(self)} tasks, {n_edges} edges, {len(self.buffers)} buffers"]
        lines += [f"  engine {k:<8} {v:>8} tasks" for k, v in sorted(by_engine.items())]
        lines += [f"  op     {k:<20} {v:>8}" for k, v in sorted(by_op.items())]
        return "\n".join(lines)

    def set_edges(self, pred: Sequence[Sequence[int]]) -> None:
        """Replace every edge: ``pred[b]`` lists the ids of the tasks task ``b`` waits for,
        as a saved file states them. The edges no longer come from buffer accesses, so
        :meth:`validate` then checks the reads and double writes against them."""
        n = len(self)
        if len(pred) != n or not all(isinstance(a, int) and 0 <= a < n for p in pred for a in p):
            raise GraphError(f"graph {self.name!r}: edges must list predecessors by task id (0..{n - 1}) for each "
                             f"of the {n} tasks")
        rows = [list(dict.fromkeys(p)) for p in pred]  # in one pass: linear however many edges a task has
        self._pptr = array("q", accumulate(map(len, rows), initial=0))
        self._pidx = array("i", chain.from_iterable(rows))
        self._pl = self._sl = None
        self._forward_only = all(a < b for b, preds in enumerate(rows) for a in preds)
        self._hazards_ordered = False
        self._version += 1

    @classmethod
    def from_arrays(cls, ops: Any, preds: Any, *, engines: Any = None, costs: Any = None, priorities: Any = None,
                    names: Any = None, name: str = "graph") -> TaskGraph:
        """A graph of tasks without buffers, built at once from per-task columns; the same graph
        as adding each task with ``task(op, engine=..., cost=..., priority=..., name=...,
        after=...)`` in id order (see :func:`megaloom.runtime.bulk.from_arrays`)."""
        return from_arrays(cls(name), ops, preds, engines=engines, costs=costs, priorities=priorities, names=names)

    def compose(self, sub: TaskGraph, prefix: str = "", bind: dict | None = None) -> Composed:
        """Add the sub-graph ``sub`` as one unit; ``bind`` maps its buffers (by name) to
        regions of this graph, the rest are added as ``prefix + name``. Returns a
        :class:`~megaloom.runtime.compose.Composed` (its tasks, ``precede``/``succeed``,
        and ``unit["buf"]``: the region standing for a sub-graph buffer)."""
        return compose(self, sub, prefix, bind)

    def to_dot(self) -> str:
        """The graph as Graphviz DOT: tasks labelled with name and op, filled by engine kind
        (see :mod:`megaloom.runtime.dot`)."""
        return to_dot(self)

    def to_dict(self) -> dict[str, Any]:
        """The graph as stored in a file (see :mod:`megaloom.runtime.serialize`)."""
        return graph_to_dict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "<graph>") -> TaskGraph:
        """Rebuild a graph from its stored form, checking every field (``where`` names it in errors)."""
        return fill_graph(cls(), d, where)

    def save(self, path: str | os.PathLike) -> None:
        """Write the graph atomically as versioned msgpack."""
        save_graph(self, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> TaskGraph:
        """Read a graph file; a corrupt or newer file raises TraceFormatError naming it."""
        with gc_paused():  # millions of small objects: collections would cost more than the reading
            return cls.from_dict(read_graph(path), os.fspath(path))

    def __repr__(self) -> str:
        return f"TaskGraph({self.name!r}, tasks={len(self)}, buffers={len(self.buffers)})"
