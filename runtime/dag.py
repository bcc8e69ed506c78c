"""The edges of a task graph: tasks as ids ``0..n-1``, each with the tasks it waits for.

Predecessors are kept in CSR form (an offset per task, then the ids), appended to as tasks are
added; ``pred`` and ``succ`` (lists of ids per task) are made from them on first use and kept
up to date from then on. An edge into an earlier task (not the newest) turns the edges into
those lists for good. :class:`~megaloom.runtime.graph.TaskGraph` builds on this with tasks,
buffers and what they access.
"""
from __future__ import annotations

import threading
from array import array
from graphlib import CycleError, TopologicalSorter
from itertools import accumulate, chain
from typing import Sequence

from megaloom.runtime.bulk import split_rows
from megaloom.runtime.errors import GraphError
from megaloom.runtime.files import gc_paused

MAKING = threading.RLock()  # making task views or edge lists on first use
_FEW = 16  # a predecessor row longer than this is searched through a set


class DAG:
    """The edge columns of a graph (see the module docstring). Subclasses keep one entry per
    task in ``_op`` and name tasks by :meth:`task_name`."""

    def __init__(self) -> None:
        self._op, self._eng = array("I"), array("I")  # op and engine codes per task
        self._cost = array("I")  # cost codes per task
        self._pptr: array | None = array("q", [0])  # CSR predecessors; None once the edges are lists
        self._pidx: array | None = array("i")
        self._pl: list[list[int]] | None = None  # predecessor and successor lists, made on first use
        self._sl: list[list[int]] | None = None
        self._psets: dict[int, set[int]] = {}  # long predecessor rows as sets
        self._forward_only = True
        self._hazards_ordered = True  # edges include the derived ones (not so for a loaded file)
        self._version = 0

    def __len__(self) -> int:
        return len(self._op)

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

    def waits_for(self, b: int, a: int) -> bool:
        """True when task ``b`` has a direct edge from task ``a`` (a set lookup for long rows)."""
        preds = self.preds_of(b)
        if len(preds) <= _FEW:
            return a in preds
        s = self._psets.get(b)
        if s is None or len(s) != len(preds):  # rows only grow, without repeats
            s = self._psets[b] = set(preds)
        return a in s

    def edge_count(self) -> int:
        return len(self._pidx) if self._pidx is not None else sum(map(len, self._pl))

    def _lists(self) -> tuple[list[list[int]], list[list[int]]]:
        if self._pl is None:
            with MAKING, gc_paused():  # a list per task, no cycles: collections would cost more
                if self._pl is None:
                    a = self.arrays()
                    self._sl = split_rows(a.succ_ptr, a.succ_idx)
                    self._pl = split_rows(a.pred_ptr, a.pred_idx)  # last: it says both are there
        return self._pl, self._sl

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
        if self.waits_for(b, a):
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
        if b in self._psets:
            self._psets[b].add(a)
        self._version += 1

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
        self._psets = {}
        self._forward_only = all(a < b for b, preds in enumerate(rows) for a in preds)
        self._hazards_ordered = False
        self._version += 1

    def topological_order(self) -> list[int]:
        """Task ids in an order that respects every edge; a cycle raises GraphError."""
        if self._forward_only:
            return list(range(len(self)))
        ts = TopologicalSorter({i: p for i, p in enumerate(self.pred)})
        try:
            return list(ts.static_order())
        except CycleError as e:
            cyc = tuple(map(self.task_name, e.args[1]))
            raise GraphError(f"cycle in graph {self.name!r}: {' -> '.join(cyc)}", tasks=cyc, cycle=cyc) from None

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
