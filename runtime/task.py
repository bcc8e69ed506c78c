"""Tasks: the view of one row of a graph's columns that the builder hands out."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megaloom.runtime.buffers import Region
    from megaloom.runtime.graph import TaskGraph
    from megaloom.runtime.registry import Cost


class Task:
    """One node: an op run on one unit of one engine kind.

    A light view of row ``id`` of its graph's columns (op, engine, cost, edges; regions,
    attrs, tags and priority kept only for the tasks that have them). Views of one task
    compare equal (``graph.tasks`` keeps one per task once asked for; ``graph.task`` hands out
    a new one). ``attrs`` and ``tags`` are the task's own dicts (an empty one is stored in the
    graph on its first change).
    Builder methods return the task, so calls chain: ``a.precede(b, c)``.
    """

    __slots__ = ("graph", "id", "op", "engine")

    def __init__(self, graph: TaskGraph, tid: int, op: str, engine: str):
        self.graph, self.id, self.op, self.engine = graph, tid, op, engine

    @property
    def name(self) -> str:
        return self.graph.task_name(self.id)

    @property
    def inputs(self) -> tuple[Region, ...]:
        return self.graph._io.get(self.id, NO_IO)[0]

    @property
    def outputs(self) -> tuple[Region, ...]:
        return self.graph._io.get(self.id, NO_IO)[1]

    @property
    def attrs(self) -> dict[str, Any]:
        return self.graph._attrs.get(self.id) or _Unstored(self.graph._attrs, self.id)

    @property
    def tags(self) -> dict[str, Any]:
        return self.graph._tags.get(self.id) or _Unstored(self.graph._tags, self.id)

    @property
    def priority(self) -> int:
        return self.graph._prio.get(self.id, 0)

    @property
    def cost(self) -> Cost | None:
        """The cost given when the task was added (None: the op's cost function decides)."""
        return self.graph._cost_table[self.graph._cost[self.id]]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Task) and other.id == self.id and other.graph is self.graph

    def __hash__(self) -> int:
        return hash((id(self.graph), self.id))

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


NO_IO: tuple[tuple, tuple] = ((), ())


class _Unstored(dict):
    """The empty attrs or tags of a task that has none: a dict that joins the graph's column
    on its first change, so reading them costs no memory."""

    __slots__ = ("column", "tid")

    def __init__(self, column: dict[int, dict], tid: int) -> None:
        self.column, self.tid = column, tid


def _changes(method: str):
    def change(self: _Unstored, *args, **kw):
        stored = self.column.setdefault(self.tid, self)
        if stored is not self:  # another view of the same task's dict was stored first
            getattr(stored, method)(*args, **kw)
        return getattr(dict, method)(self, *args, **kw)
    return change


for _m in ("__setitem__", "__delitem__", "__ior__", "update", "setdefault", "pop", "popitem", "clear"):
    setattr(_Unstored, _m, _changes(_m))
