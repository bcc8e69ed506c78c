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
from collections import Counter
from dataclasses import dataclass, field
from graphlib import CycleError, TopologicalSorter
from typing import Any, Iterable, Sequence

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


@dataclass(eq=False, slots=True)
class Task:
    """One node: an op run on one unit of one engine kind.

    Builder methods return the task, so calls chain: ``a.precede(b, c)``.
    """

    id: int
    name: str
    op: str
    engine: str
    inputs: tuple[Region, ...]
    outputs: tuple[Region, ...]
    attrs: dict[str, Any]
    priority: int
    tags: dict[str, Any]
    cost: Cost | None
    graph: TaskGraph = field(repr=False)

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
        return [self.graph.tasks[i] for i in self.graph.pred[self.id]]

    def __repr__(self) -> str:
        return f"Task({self.name!r}, op={self.op!r}, engine={self.engine!r})"


def _integer(v: Any, what: str) -> int:
    """``v`` as an int (Python or NumPy integer); a float, string or bool raises GraphError."""
    if isinstance(v, bool) or not hasattr(type(v), "__index__"):
        raise GraphError(f"{what} must be an integer, got {v!r}")
    return operator.index(v)


class TaskGraph:
    """A DAG of tasks over buffers; the same graph runs on every executor."""

    def __init__(self, name: str = "graph"):
        self.name = name
        self.buffers: dict[str, Buffer] = {}
        self.tasks: list[Task] = []
        self.succ: list[list[int]] = []
        self.pred: list[list[int]] = []
        self._by_name: dict[str, Task] = {}
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
        ins = tuple(self.as_region(r) for r in inputs)
        outs = tuple(self.as_region(r) for r in outputs)
        tid = len(self.tasks)
        name = name if name is not None else f"{op}#{tid}"
        if name in self._by_name:
            raise GraphError(f"task name {name!r} is used twice in graph {self.name!r}", tasks=(name,))
        for r in ins + outs:
            if self.buffers.get(r.buffer.name) is not r.buffer:
                raise GraphError(f"task {name!r} uses buffer {r.buffer.name!r} of another graph", tasks=(name,))
            if not in_bounds(r.box, r.buffer.shape):
                raise GraphError(f"task {name!r}: region {r} is outside buffer shape {r.buffer.shape}", tasks=(name,))
        if engine is None:
            try:
                engine = get_op(op).engine
            except GraphError:
                engine = "vector"  # unknown ops are reported by validate()
        t = Task(tid, name, op, engine, ins, outs, dict(attrs or {}), priority, dict(tags or {}), cost, self)
        self.tasks.append(t)
        self.succ.append([])
        self.pred.append([])
        self._by_name[name] = t
        self._version += 1
        self._derive(t)
        for a in after:
            self.edge(a, t)
        return t

    def _derive(self, t: Task) -> None:
        acc = self._accesses
        before: set[int] = set()
        for r in t.inputs:
            before.update(o for _, o in acc[r.buffer.name][1].overlapping(r.box))  # RAW: after earlier writes
        for r in t.outputs:
            reads, writes = acc[r.buffer.name]
            before.update(o for _, o in reads.overlapping(r.box))   # WAR: after earlier reads
            before.update(o for _, o in writes.overlapping(r.box))  # WAW: after earlier writes
        before.discard(t.id)
        if before:  # the task is new: no edge of it exists yet
            self.pred[t.id] = sorted(before)
            for a in self.pred[t.id]:
                self.succ[a].append(t.id)
            self._version += 1
        for r in t.inputs:
            acc[r.buffer.name][0].add(r.box, t.id)
        for r in t.outputs:
            reads, writes = acc[r.buffer.name]
            # earlier accesses inside this write are ordered before it, so it stands for them
            reads.drop_inside(r.box, t.id)
            writes.drop_inside(r.box, t.id)
            writes.add(r.box, t.id)

    def _link(self, a: int, b: int) -> None:
        if a not in self.pred[b]:
            self._version += 1
            self.pred[b].append(a)
            self.succ[a].append(b)
            if a >= b:
                self._forward_only = False

    def edge(self, a: Task | str, b: Task | str) -> None:
        """Control edge: ``b`` waits for ``a``."""
        ta, tb = self[a] if isinstance(a, str) else a, self[b] if isinstance(b, str) else b
        if ta.graph is not self or tb.graph is not self:
            raise GraphError(f"edge {ta.name!r} -> {tb.name!r} joins tasks of different graphs")
        if ta.id == tb.id:
            raise GraphError(f"task {ta.name!r} cannot wait for itself", tasks=(ta.name,), cycle=(ta.name, ta.name))
        self._link(ta.id, tb.id)

    def __getitem__(self, name: str) -> Task:
        try:
            return self._by_name[name]
        except KeyError:
            raise GraphError(f"graph {self.name!r} has no task {name!r}") from None

    def __len__(self) -> int:
        return len(self.tasks)

    def __iter__(self):
        return iter(self.tasks)

    # -- structure -------------------------------------------------------------------
    def topological_order(self) -> list[int]:
        """Task ids in an order that respects every edge; a cycle raises GraphError."""
        if self._forward_only:
            return list(range(len(self.tasks)))
        ts = TopologicalSorter({i: p for i, p in enumerate(self.pred)})
        try:
            return list(ts.static_order())
        except CycleError as e:
            cyc = tuple(self.tasks[i].name for i in e.args[1])
            raise GraphError(f"cycle in graph {self.name!r}: {' -> '.join(cyc)}", tasks=cyc, cycle=cyc) from None

    def engines(self) -> list[str]:
        """Engine kinds used by the graph, in first-use order."""
        return list(dict.fromkeys(t.engine for t in self.tasks))

    def reaches(self, a: int, b: int) -> bool:
        """True when task ``b`` transitively depends on task ``a``."""
        if a == b:
            return True
        seen, stack = {b}, [b]
        while stack:
            for p in self.pred[stack.pop()]:
                if p == a:
                    return True
                if p not in seen and (not self._forward_only or p > a):
                    seen.add(p)
                    stack.append(p)
        return False

    def validate(self) -> TaskGraph:
        """Check every rule; raise GraphError naming the tasks of the first broken rule."""
        self.cached("validated", lambda: validate(self) or True)
        return self

    def costs(self) -> list[Cost]:
        """Every task's cost, by task id (computed once per graph version)."""
        return self.cached("costs", lambda: [self._compute_cost(t) for t in self.tasks])

    def task_cost(self, t: Task) -> Cost:
        """The task's cost: its own override, else the op's cost function."""
        return self.costs()[t.id]

    def _compute_cost(self, t: Task) -> Cost:
        if t.cost is not None:
            return t.cost
        ins = [TensorSpec(r.shape, r.dtype) for r in t.inputs]
        outs = [TensorSpec(r.shape, r.dtype) for r in t.outputs]
        return get_op(t.op).cost(ins, outs, t.attrs)

    def summary(self) -> str:
        """A short text table: tasks per engine and op, buffers, edges."""
        by_engine = Counter(t.engine for t in self.tasks)
        by_op = Counter(t.op for t in self.tasks)
        n_edges = sum(len(s) for s in self.succ)
        lines = [f"graph {self.name!r}: {len(self.tasks)} tasks, {n_edges} edges, {len(self.buffers)} buffers"]
        lines += [f"  engine {k:<8} {v:>8} tasks" for k, v in sorted(by_engine.items())]
        lines += [f"  op     {k:<20} {v:>8}" for k, v in sorted(by_op.items())]
        return "\n".join(lines)

    def set_edges(self, pred: Sequence[Sequence[int]]) -> None:
        """Replace every edge: ``pred[b]`` lists the ids of the tasks task ``b`` waits for,
        as a saved file states them. The edges no longer come from buffer accesses, so
        :meth:`validate` then checks the reads and double writes against them."""
        n = len(self.tasks)
        if len(pred) != n or not all(isinstance(a, int) and 0 <= a < n for p in pred for a in p):
            raise GraphError(f"graph {self.name!r}: edges must list predecessors by task id (0..{n - 1}) for each "
                             f"of the {n} tasks")
        self.pred = [list(dict.fromkeys(p)) for p in pred]  # in one pass: linear however many edges a task has
        self.succ = [[] for _ in range(n)]
        for b, preds in enumerate(self.pred):
            for a in preds:
                self.succ[a].append(b)
        self._forward_only = all(a < b for b, preds in enumerate(self.pred) for a in preds)
        self._hazards_ordered = False
        self._version += 1

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
        return f"TaskGraph({self.name!r}, tasks={len(self.tasks)}, buffers={len(self.buffers)})"
