"""``TaskGraph.validate``: a table of rules, each naming the tasks and buffers it blames.

Rules run in table order; the first rule that finds problems raises one GraphError
listing all of them (up to ten), with ``tasks`` naming every offender. The rules read the
graph's columns: ops, engine kinds and the shapes of tasks without regions or attrs are
checked once per distinct value, regions task by task, so a graph built from arrays (no
regions) validates in a few passes over its columns.
"""
from __future__ import annotations

from itertools import chain
from typing import TYPE_CHECKING, Callable, Iterator

import numpy as np

from megaloom.runtime.access import Frontier
from megaloom.runtime.bulk import operand_facts, shape_problem
from megaloom.runtime.errors import GraphError
from megaloom.runtime.files import gc_paused
from megaloom.runtime.region import uncovered
from megaloom.runtime.registry import OPS, get_op

if TYPE_CHECKING:
    from megaloom.runtime.graph import TaskGraph

Problem = tuple[str, str]  # (task name or "", message)
BUDGET_PER_TASK = 64
"""Search steps per task and edge allowed to check a loaded graph's order of accesses."""


def _flagged(column, bad: set) -> Iterator[int]:
    """Ids of the tasks whose ``column`` entry is in ``bad``, in id order (nothing when none is)."""
    return (i for i, key in enumerate(column) if key in bad) if bad else iter(())


def _unknown_op(g: TaskGraph) -> Iterator[Problem]:
    bad = {code for code in set(g._op) if g._op_names[code] not in OPS}  # each op once, not each task
    for i in _flagged(g._op, bad):
        t = g.tasks[i]
        yield t.name, f"task {t.name!r}: unknown op {t.op!r}"


def _engine(g: TaskGraph) -> Iterator[Problem]:
    a, m = g.arrays(), len(g._eng_names)
    pairs = np.unique(a.op.astype(np.int64) * m + a.engine).tolist()  # each (op, engine) once
    bad = {(p // m, p % m) for p in pairs if g._eng_names[p % m] not in get_op(g._op_names[p // m]).engines}
    for i in _flagged(zip(g._op, g._eng), bad):
        t = g.tasks[i]
        yield t.name, f"task {t.name!r}: op {t.op!r} runs on {'/'.join(get_op(t.op).engines)}, not {t.engine!r}"


def _shapes(g: TaskGraph) -> Iterator[Problem]:
    # a task with no regions and no attrs is checked once per op; the others once per operands
    own = set(g._io).union(g._attrs)
    bare = set(g._op) if not own else {c for i, c in enumerate(g._op) if i not in own}
    bad = {c: why for c in bare if (why := shape_problem(g._op_names[c], (), (), {}))}
    found = g.cached("operand_facts", lambda: operand_facts(g))
    for i in (range(len(g)) if bad else sorted(own)):
        if why := found[i][0] if i in own else bad.get(g._op[i]):
            name = g.task_name(i)
            yield name, f"task {name!r}: {why}"


def _cycles(g: TaskGraph) -> Iterator[Problem]:
    """A cycle is one problem, raised at once: the error carries its path."""
    if not g.forward_only:
        try:
            g.topological_order()
        except GraphError as e:
            raise GraphError(f"graph {g.name!r} breaks rule 'cycle':\n  {e}", tasks=e.cycle[:1], cycle=e.cycle) from None
    return iter(())


def _ordered(g: TaskGraph):
    """``before(a, b)``: whether task ``a`` is ordered before task ``b`` by the graph's edges.

    A direct edge answers at once (a file megaloom wrote holds every derived edge, so almost
    every question is one). Otherwise the edges are searched backwards from ``b``, never past
    tasks placed before ``a`` in a topological order, remembering per ``a`` the tasks found to
    follow it (every task on a path found) and those found not to: a task is searched at most
    once per ``a``, so reads ordered through chains of other tasks stay linear. The search is
    bounded by a budget proportional to the graph's size (a file crafted so that each question
    needs a long search of its own is refused, never checked for minutes)."""
    pos = range(len(g)) if g.forward_only else {t: k for k, t in enumerate(g.topological_order())}
    follows: dict[int, set[int]] = {}
    not_after: dict[int, set[int]] = {}
    budget = [BUDGET_PER_TASK * (len(g) + g.edge_count()) + 100_000]

    def before(a: int, b: int) -> bool:
        if g.waits_for(b, a):
            return True
        yes, no, lo = follows.setdefault(a, set()), not_after.setdefault(a, set()), pos[a]
        stack = [(b, iter(g.preds_of(b)))]
        while stack:
            for p in stack[-1][1]:
                if p == a or p in yes:
                    yes.update(t for t, _ in stack)
                    return True
                if p not in no and pos[p] > lo:
                    budget[0] -= 1
                    if budget[0] < 0:
                        raise GraphError(f"graph {g.name!r}: the order of the accesses of task {g.task_name(b)!r} "
                                         f"could not be checked: too many are ordered only through long chains of "
                                         f"other tasks (more than {BUDGET_PER_TASK} steps per task and edge)",
                                         tasks=(g.task_name(b),))
                    stack.append((p, iter(g.preds_of(p))))
                    break
            else:
                no.add(stack.pop()[0])
        return False

    return before


def _unwritten_reads(g: TaskGraph) -> Iterator[Problem]:
    if not g.hazards_derived:
        yield from _sweep(g)[0]
        return
    for tid, r, gap in g._gaps:  # (recorded as the tasks were added)
        name = g.task_name(tid)
        yield name, (f"task {name!r} reads {r}, but no task ordered before it writes {r.buffer.region(gap)}, "
                     "and it is not a graph input")


def _sweep(g: TaskGraph) -> tuple[list[Problem], list[Problem]]:
    """Reads of unwritten regions, and accesses the edges leave unordered (the first ten of
    each), in a graph whose edges were set as a file states them: derivation replayed in a
    topological order, each access checked against the earlier ones it meets (RAW, WAR, WAW);
    the stored edges are asked whether they order them (:func:`_ordered`). Computed once per
    graph version."""
    def make() -> tuple[list[Problem], list[Problem]]:
        ids = sorted(g._io) if g.forward_only else [i for i in g.topological_order() if i in g._io]
        before = _ordered(g)
        frontiers = {b: Frontier() for b in g.buffers}
        gaps, races = [], []
        for tid in ids:
            name = g.task_name(tid)
            ins, outs = g._io[tid]
            for r in ins:
                found = frontiers[r.buffer.name].writes_over(r.box)
                racing = [g.task_name(w) for _, w in found if w != tid and not before(w, tid)]
                left = None if r.buffer.is_input else \
                    frontiers[r.buffer.name].gap(r.box, [(box, w) for box, w in found if before(w, tid)])
                if left is not None:
                    why = f" (task {racing[0]!r} writes it with no order between them)" if racing \
                        else ", and it is not a graph input"
                    gaps.append((name, f"task {name!r} reads {r}, but no task ordered before it writes "
                                       f"{r.buffer.region(left)}{why}"))
                elif racing:
                    races.append((name, f"task {name!r} reads {r} while task {racing[0]!r} writes it, "
                                        "with no order between them"))
            for r in outs:
                f = frontiers[r.buffer.name]
                for _, w in f.writes_over(r.box):
                    if w != tid and not before(w, tid):
                        ta, tb = (g.task_name(i) for i in sorted((w, tid)))
                        races.append((ta, f"tasks {ta!r} and {tb!r} both write buffer {r.buffer.name!r} "
                                          "with no order between them"))
                for _, rd in f.reads_over(r.box):
                    if rd != tid and not before(rd, tid):
                        races.append((name, f"task {name!r} writes {r} while task {g.task_name(rd)!r} "
                                            "reads it, with no order between them"))
            for r in ins:
                frontiers[r.buffer.name].read(r.box, tid)
            for r in outs:  # an access inside this write is ordered before it (checked above)
                frontiers[r.buffer.name].write(r.box, tid)
            if len(gaps) >= 10 and len(races) >= 10:
                break
        return gaps[:10], races[:10]

    return g.cached("access_sweep", make)


def _unwritten_outputs(g: TaskGraph) -> Iterator[Problem]:
    # outputs are allocated uninitialised (no zeroing), so every element must be written;
    # a scratch buffer needs no such rule: each read of it must be covered (the rule above)
    covers: dict[str, list] = {b.name: [] for b in g.outputs if not b.is_input}
    for r in chain.from_iterable(outs for _, outs in g._io.values()):
        if r.buffer.name in covers:
            covers[r.buffer.name].append(r.box)
    for name, boxes in covers.items():
        buf = g.buffers[name]
        boxes.sort(key=lambda box: tuple(a for a, _ in box))  # tiles in order leave few pieces
        if gaps := [gap for gap in uncovered(buf.full.box, boxes) if all(b > a for a, b in gap)]:
            yield "", (f"output {name!r}: no task writes {buf.region(gaps[0])}"
                       f"{f' (and {len(gaps) - 1} more regions)' if len(gaps) > 1 else ''}; "
                       "the run would return uninitialised memory there")


def _unordered_writes(g: TaskGraph) -> Iterator[Problem]:
    if not g.hazards_derived:  # derived edges order every access
        yield from _sweep(g)[1]


RULES: list[tuple[str, Callable[[TaskGraph], Iterator[Problem]]]] = [
    ("unknown op", _unknown_op),
    ("engine kind", _engine),
    ("cycle", _cycles),
    ("shape and dtype", _shapes),
    ("read of unwritten region", _unwritten_reads),
    ("unwritten output", _unwritten_outputs),
    ("unordered accesses", _unordered_writes),
]


def validate(g: TaskGraph) -> None:
    """Raise GraphError for the first rule of :data:`RULES` that the graph breaks."""
    for rule, check in RULES:
        problems = []
        with gc_paused():
            for p in check(g):
                problems.append(p)
                if len(problems) >= 10:
                    break
        if problems:
            names = tuple(dict.fromkeys(n for n, _ in problems if n))  # "": a buffer's problem, no task
            raise GraphError(f"graph {g.name!r} breaks rule '{rule}':\n  " + "\n  ".join(m for _, m in problems),
                             tasks=names)
