"""The task graph: tasks over buffers, with dependencies derived from what they access.

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

Buffers and regions live in :mod:`megaloom.runtime.buffers`, the task view in
:mod:`megaloom.runtime.task`, access tracking in :mod:`megaloom.runtime.access`, the edges
in :mod:`megaloom.runtime.dag`.
"""
from __future__ import annotations

import os
from collections import Counter
from types import MappingProxyType
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from megaloom.runtime.access import Frontier, Gap, derive
from megaloom.runtime.buffers import Buffer, Region, integer
from megaloom.runtime.bulk import GraphArrays, cost_columns, default_engine, from_arrays, graph_arrays
from megaloom.runtime.compose import Composed, compose
from megaloom.runtime.dot import to_dot
from megaloom.runtime.dtypes import dtype_name
from megaloom.runtime.dag import DAG, MAKING
from megaloom.runtime.errors import GraphError
from megaloom.runtime.files import gc_paused
from megaloom.runtime.region import in_bounds
from megaloom.runtime.registry import Cost
from megaloom.runtime.serialize import fill_graph, graph_to_dict, read_graph, save_graph
from megaloom.runtime.task import Task
from megaloom.runtime.validate import validate

__all__ = ["Buffer", "Region", "Task", "TaskGraph"]


class TaskGraph(DAG):
    """A DAG of tasks over buffers; the same graph runs on every executor.

    Per-task state is columns: op, engine and cost as indices into tables (cost 0: none
    given, the op's cost function decides), and the edges (:class:`~megaloom.runtime.dag.DAG`);
    regions, attrs, tags, priorities and non-default names are kept only for the tasks that
    have them. ``tasks`` holds a :class:`Task` view per task, made on first use.
    :meth:`from_arrays` builds a large graph from arrays at once; :meth:`arrays` gives the
    columns back.
    """

    def __init__(self, name: str = "graph"):
        super().__init__()
        self.name = name  # (the edge columns, ``_op``, ``_eng`` and ``_cost`` come from DAG)
        self.buffers: dict[str, Buffer] = {}
        self._op_names: list[str] = []
        self._eng_names: list[str] = []
        self._op_codes: dict[str, int] = {}  # op name -> index
        self._eng_codes: dict[str, int] = {}  # engine name -> index
        self._cost_table: list[Cost | None] = [None]
        self._cost_codes: dict[int, int] = {}  # id of a Cost in the table -> its index
        self._io: dict[int, tuple[tuple[Region, ...], tuple[Region, ...]]] = {}  # tasks with regions
        self._attrs: dict[int, dict[str, Any]] = {}
        self._tags: dict[int, dict[str, Any]] = {}
        self._prio: dict[int, int] = {}
        self._names: list[str | None] | None = None  # given names (None: "op#id"); None until one is given
        self._by_name: dict[str, int] = {}  # given names only
        self._views: list[Task] = []
        self._default_engine: dict[str, str] = {}  # op -> its default engine kind, as asked
        self._frontiers: dict[str, Frontier] = {}
        self._gaps: list[Gap] = []  # reads of data no earlier task writes (the first ten)
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
        if not isinstance(name, str):
            raise GraphError(f"a buffer name must be a string, got {name!r}")
        if name in self.buffers:
            raise GraphError(f"buffer {name!r} already exists in graph {self.name!r}")
        if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
            raise GraphError(f"buffer {name!r}: shape must be a sequence of integers, got {shape!r}")
        shape = tuple(integer(s, f"buffer {name!r}: dim {d}") for d, s in enumerate(shape))
        if any(s < 0 for s in shape):
            raise GraphError(f"buffer {name!r} has a negative dim: {shape}")
        buf = self.buffers[name] = Buffer(name, shape, dtype_name(dtype), bool(is_input), bool(is_output))
        self._frontiers[name] = Frontier()
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
        after: Sequence[Task | str] = (),
    ) -> Task:
        """Add a task; its dependencies follow from the regions it reads and writes.

        ``engine`` defaults to the op's default engine kind; ``cost`` overrides the op's
        cost function; ``after`` adds control edges.
        """
        tid = len(self._op)
        # (type() is: cheaper than isinstance; a name is formatted only for an error)
        if type(op) is str and name is None and (engine is None or type(engine) is str):
            op_code, eng_code = self._op_codes.get(op), self._eng_codes.get(
                engine if engine is not None else self._default_engine.get(op))
        else:
            op_code = None
        if op_code is None or eng_code is None:
            op_code, eng_code = self._head(op, name, engine, tid)
        if priority:
            priority = integer(priority, f"task {name or op!r}: priority")
        ins = self._regions(inputs, op, name, tid) if inputs else ()
        outs = self._regions(outputs, op, name, tid) if outputs else ()
        waits = []  # (loops, not comprehensions: a closure would slow every local of this method)
        for a in after:
            waits.append((a if type(a) is Task and a.graph is self else self._own(a, name or f"{op}#{tid}")).id)
        cost_code = 0 if cost is None else self._cost_codes.get(id(cost)) or self._cost_code(cost)  # (may raise)
        self._op.append(op_code)
        self._eng.append(eng_code)
        self._cost.append(cost_code)
        if attrs:
            self._attrs[tid] = dict(attrs)
        if tags:
            self._tags[tid] = dict(tags)
        if priority:
            self._prio[tid] = priority
        if self._names is not None:
            self._names.append(None if name is None or name == f"{op}#{tid}" else name)
            if self._names[tid] is not None:
                self._by_name[name] = tid
        self._version += 1
        if ins or outs:
            self._io[tid] = (ins, outs)
            preds = derive(self._frontiers, tid, ins, outs, self._gaps)
            if waits:
                preds = list(dict.fromkeys(preds + waits))  # control edges after derived ones
        else:
            preds = waits if len(waits) < 2 else list(dict.fromkeys(waits))
        self._add_row(preds)
        view = Task(self, tid, op, self._eng_names[eng_code])
        if len(self._views) == tid:  # views were asked for: keep them complete
            self._views.append(view)
        return view

    def _head(self, op: str, name: str | None, engine: str | None, tid: int) -> tuple[int, int]:
        """The op and engine codes of a new task (``op``, ``name`` and ``engine`` checked; new
        names added to the tables); a name given makes the graph keep a name column."""
        if not (isinstance(op, str) and all(isinstance(s, (str, type(None))) for s in (name, engine))):
            raise GraphError(f"task {name!r}: op, name and engine must be strings, got {op!r}, {name!r}, {engine!r}")
        if name is not None and name != f"{op}#{tid}":
            if name in self._by_name or self.task_id(name) is not None:
                raise GraphError(f"task name {name!r} is used twice in graph {self.name!r}", tasks=(name,))
            if self._names is None:
                self._names = [None] * tid
        if engine is None:
            engine = self._default_engine.get(op) or self._default_engine.setdefault(op, default_engine(op))
        return self._code(0, op), self._code(1, engine)

    def _regions(self, xs: Iterable[Buffer | Region], op: str, name: str | None, tid: int) -> tuple[Region, ...]:
        """``xs`` as regions, each checked to be of a buffer of this graph and inside it (``op``,
        ``name`` and ``tid`` name the task in errors)."""
        regions = []
        for x in xs:
            r = x if type(x) is Region else self.as_region(x)
            if self.buffers.get(r.buffer.name) is not r.buffer:
                task = name or f"{op}#{tid}"
                raise GraphError(f"task {task!r} uses buffer {r.buffer.name!r} of another graph", tasks=(task,))
            # (a tile of the buffer was checked when first used)
            if r.box not in self._frontiers[r.buffer.name].slots and not in_bounds(r.box, r.buffer.shape):
                task = name or f"{op}#{tid}"
                raise GraphError(f"task {task!r}: region {r} is outside buffer shape {r.buffer.shape}", tasks=(task,))
            regions.append(r)
        return tuple(regions)

    def _own(self, t: Task | str, then: str) -> Task:
        """``t`` (a task or its name), checked to be a task of this graph (``then``: the task
        that is to wait for it, for the error)."""
        t = self[t] if isinstance(t, str) else t
        if getattr(t, "graph", None) is not self:
            raise GraphError(f"edge {getattr(t, 'name', t)!r} -> {then!r} joins tasks of different graphs")
        return t

    def _code(self, column: int, name: str) -> int:
        """The index of ``name`` in the op (0) or engine (1) name table, added if new."""
        codes = (self._op_codes, self._eng_codes)[column]
        code = codes.get(name)
        if code is None:
            code = codes[name] = len(codes)
            (self._op_names, self._eng_names)[column].append(name)
        return code

    def _cost_code(self, cost: Cost) -> int:
        """The index of ``cost`` (this object) in the cost table, added if new."""
        code = self._cost_codes.get(id(cost))
        if code is None:
            if not (isinstance(cost, Cost) and cost.valid()):
                raise GraphError(f"a task's cost must be a Cost with finite flops, bytes and comm bytes >= 0, "
                                 f"got {cost!r:.80}")
            code = self._cost_codes[id(cost)] = len(self._cost_table)
            self._cost_table.append(cost)  # kept, so its id stays its own
        return code

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

    def task_name(self, tid: int) -> str:
        """The name of task ``tid`` (given, or ``op#id``)."""
        name = self._names[tid] if self._names is not None else None
        return name if name is not None else f"{self._op_names[self._op[tid]]}#{tid}"

    def __getitem__(self, name: str) -> Task:
        tid = self.task_id(name) if isinstance(name, str) else None
        if tid is None:
            raise GraphError(f"graph {self.name!r} has no task {name!r}")
        return self.tasks[tid]

    def __iter__(self):
        return iter(self.tasks)

    @property
    def tasks(self) -> list[Task]:
        """Every task, by id: one :class:`Task` view each (made on first use, then kept; views
        of one task compare equal)."""
        views = self._views
        if len(views) < len(self._op):
            with MAKING:  # worker threads may ask at once: the views are made once, in order
                k, ops, engines = len(views), self._op_names, self._eng_names
                views.extend(Task(self, i, ops[o], engines[e]) for i, o, e in zip(range(k, len(self._op)),
                                                                                 self._op[k:], self._eng[k:]))
        return views

    # -- columns ---------------------------------------------------------------------
    def arrays(self) -> GraphArrays:
        """The graph's columns as read-only NumPy arrays (see :class:`GraphArrays`), for code
        that walks every task: one call per graph version, the same object until a change."""
        return self.cached("arrays", lambda: graph_arrays(self))

    def engines(self) -> list[str]:
        """Engine kinds used by the graph, in first-use order."""
        return [self._eng_names[c] for c in dict.fromkeys(self._eng)]

    def validate(self) -> TaskGraph:
        """Check every rule; raise GraphError naming the tasks of the first broken rule. A graph
        that passed is not checked again until it changes (see :attr:`validated`)."""
        self.cached("validated", lambda: validate(self) or True)
        return self

    @property
    def validated(self) -> bool:
        """True when :meth:`validate` passed on the graph as it is now."""
        return self._cache.get("validated", (None,))[0] == self._version

    def cost_columns(self) -> tuple[list[Cost], np.ndarray]:
        """Every task's cost as ``(table, codes)``: task ``i`` costs ``table[codes[i]]`` (see
        :func:`megaloom.runtime.bulk.cost_columns`; computed once per graph version)."""
        return self.cached("cost_columns", lambda: cost_columns(self))

    def costs(self) -> list[Cost]:
        """Every task's cost, by task id (tasks of equal work share one Cost object; the list is
        kept until the graph changes)."""
        table, codes = self.cost_columns()
        return self.cached("costs", lambda: list(map(table.__getitem__, codes.tolist())))

    def task_cost(self, t: Task) -> Cost:
        """The task's cost: its own override, else the op's cost function."""
        table, codes = self.cost_columns()
        return table[codes[t.id]]

    def summary(self) -> str:
        """A short text table: tasks per engine and op, buffers, edges."""
        by_engine = Counter(self._eng_names[c] for c in self._eng)
        by_op = Counter(self._op_names[c] for c in self._op)
        lines = [f"graph {self.name!r}: {len(self)} tasks, {self.edge_count()} edges, {len(self.buffers)} buffers"]
        lines += [f"  engine {k:<8} {v:>8} tasks" for k, v in sorted(by_engine.items())]
        lines += [f"  op     {k:<20} {v:>8}" for k, v in sorted(by_op.items())]
        return "\n".join(lines)

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

