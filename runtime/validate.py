"""``TaskGraph.validate``: a table of rules, each naming the tasks and buffers it blames.

Rules run in table order; the first rule that finds problems raises one GraphError
listing all of them (up to ten), with ``tasks`` naming every offender.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterator

from megaloom.runtime.errors import GraphError
from megaloom.runtime.graph import Region
from megaloom.runtime.region import BoxIndex, uncovered
from megaloom.runtime.registry import TensorSpec, get_op
from megaloom.runtime.trace import gc_paused

if TYPE_CHECKING:
    from megaloom.runtime.graph import TaskGraph

Problem = tuple[str, str]  # (task name or "", message)


def _unknown_op(g: TaskGraph) -> Iterator[Problem]:
    for t in g.tasks:
        try:
            get_op(t.op)
        except GraphError:
            yield t.name, f"task {t.name!r}: unknown op {t.op!r}"


def _engine(g: TaskGraph) -> Iterator[Problem]:
    for t in g.tasks:
        engines = get_op(t.op).engines
        if t.engine not in engines:
            yield t.name, f"task {t.name!r}: op {t.op!r} runs on {'/'.join(engines)}, not {t.engine!r}"


def _shapes(g: TaskGraph) -> Iterator[Problem]:
    for t in g.tasks:
        ins = [TensorSpec(r.shape, r.dtype) for r in t.inputs]
        try:
            want = get_op(t.op).shape(ins, t.attrs)
        except Exception as e:  # a shape rule given operands it does not expect may raise anything
            why = str(e) if isinstance(e, GraphError) else f"shape rule of op {t.op!r} failed: {type(e).__name__}: {e}"
            yield t.name, f"task {t.name!r}: {why}"
            continue
        if len(want) != len(t.outputs):
            yield t.name, f"task {t.name!r}: op {t.op!r} makes {len(want)} outputs, task declares {len(t.outputs)}"
            continue
        for i, (w, r) in enumerate(zip(want, t.outputs)):
            if tuple(w.shape) != r.shape or w.dtype != r.dtype:
                yield t.name, (
                    f"task {t.name!r}: output {i} ({r}) is {r.shape} {r.dtype}, "
                    f"op {t.op!r} makes {tuple(w.shape)} {w.dtype}"
                )


def _cycles(g: TaskGraph) -> Iterator[Problem]:
    try:
        g.topological_order()
    except GraphError as e:
        for name in e.cycle[:1]:
            yield name, str(e)


class _Order:
    """Whether task ``a`` is ordered before task ``b`` by a graph's edges.

    A direct edge answers at once; a file megaloom wrote holds every derived edge, so
    almost every question is one. Otherwise a search goes backwards from ``b`` through
    tasks placed after ``a`` in the topological order only.
    """

    def __init__(self, g: TaskGraph, order: list[int]):
        self.pred = g.pred
        self.pos = [0] * len(order)
        for i, t in enumerate(order):
            self.pos[t] = i
        self.sets: dict[int, set[int]] = {}  # pred sets of tasks with many predecessors

    def before(self, a: int, b: int) -> bool:
        preds = self.pred[b]
        if len(preds) > 8:
            preds = self.sets.get(b) or self.sets.setdefault(b, set(preds))
        if a in preds:
            return True
        pos, lo = self.pos, self.pos[a]
        if lo >= pos[b]:
            return False
        seen, stack = {b}, [b]
        while stack:
            for p in self.pred[stack.pop()]:
                if p == a:
                    return True
                if p not in seen and pos[p] > lo:
                    seen.add(p)
                    stack.append(p)
        return False


def _gap_message(t, r: Region, gaps, racing: list[int], g: TaskGraph) -> str:
    msg = f"task {t.name!r} reads {r}, but no task ordered before it writes {Region(r.buffer, gaps[0])}"
    if racing:
        return msg + f" (task {g.tasks[racing[0]].name!r} writes it with no order between them)"
    return msg + ", and it is not a graph input"


def _unwritten_reads(g: TaskGraph) -> Iterator[Problem]:
    if not g._hazards_ordered:
        yield from _sweep(g)[0]
        return
    # With derived edges the writers ordered before a task are exactly the earlier ones (an
    # edge against insertion order would close a cycle with a derived one): sweep in order,
    # keeping an index of earlier writes (a write drops the ones it covers, as derivation does).
    writers: dict[str, BoxIndex] = {}
    for t in g.tasks:
        for r in t.inputs:
            if r.buffer.is_input:
                continue
            index = writers.get(r.buffer.name)
            covers = [box for box, _ in index.overlapping(r.box)] if index is not None else []
            gaps = [gap for gap in uncovered(r.box, covers) if all(b > a for a, b in gap)]
            if gaps:
                yield t.name, _gap_message(t, r, gaps, [], g)
        for r in t.outputs:
            index = writers.setdefault(r.buffer.name, BoxIndex())
            index.drop_inside(r.box, t.id)
            index.add(r.box, t.id)


def _sweep(g: TaskGraph) -> tuple[list[Problem], list[Problem]]:
    """Reads of unwritten regions, and accesses the edges leave unordered, of a graph whose
    edges came from elsewhere (a file): derivation replayed in a topological order of its
    edges, each access checked against the earlier ones it meets (RAW, WAR, WAW). Linear in
    tasks when the edges include the derived ones; computed once per graph version."""
    def make() -> tuple[list[Problem], list[Problem]]:
        order_ids = g.topological_order()
        order = _Order(g, order_ids)
        reads: dict[str, BoxIndex] = {}
        writes: dict[str, BoxIndex] = {}
        gaps_found: list[Problem] = []
        races: list[Problem] = []
        for tid in order_ids:
            t = g.tasks[tid]
            for r in t.inputs:
                found = writes.get(r.buffer.name)
                found = found.overlapping(r.box) if found is not None else []
                covers = [box for box, w in found if order.before(w, tid)]
                racing = [w for _, w in found if w != tid and not order.before(w, tid)]
                gaps = [] if r.buffer.is_input else \
                    [gap for gap in uncovered(r.box, covers) if all(b > a for a, b in gap)]
                if gaps and len(gaps_found) < 10:
                    gaps_found.append((t.name, _gap_message(t, r, gaps, racing, g)))
                elif racing and len(races) < 10:
                    races.append((t.name, f"task {t.name!r} reads {r} while task {g.tasks[racing[0]].name!r} "
                                          "writes it, with no order between them"))
            for r in t.outputs:
                index = writes.get(r.buffer.name)
                for _, w in index.overlapping(r.box) if index is not None else ():
                    if w != tid and not order.before(w, tid) and len(races) < 10:
                        a, b = sorted((w, tid))
                        ta, tb = g.tasks[a].name, g.tasks[b].name
                        races.append((ta, f"tasks {ta!r} and {tb!r} both write buffer {r.buffer.name!r} "
                                          "with no order between them"))
                index = reads.get(r.buffer.name)
                for _, rd in index.overlapping(r.box) if index is not None else ():
                    if rd != tid and not order.before(rd, tid) and len(races) < 10:
                        races.append((t.name, f"task {t.name!r} writes {r} while task {g.tasks[rd].name!r} "
                                              "reads it, with no order between them"))
            for r in t.inputs:
                reads.setdefault(r.buffer.name, BoxIndex()).add(r.box, tid)
            for r in t.outputs:
                reads.setdefault(r.buffer.name, BoxIndex())
            for r in t.outputs:  # an access inside this write is ordered before it (checked above)
                reads[r.buffer.name].drop_inside(r.box, tid)  # (this task's reads made the index, if none before)
                index = writes.setdefault(r.buffer.name, BoxIndex())
                index.drop_inside(r.box, tid)
                index.add(r.box, tid)
        return gaps_found, races

    return g._cached("access_sweep", make)


def _unwritten_outputs(g: TaskGraph) -> Iterator[Problem]:
    # outputs are allocated uninitialised (no zeroing), so every element must be written;
    # a scratch buffer needs no such rule: each read of it must be covered (the rule above)
    covers: dict[str, list] = {b.name: [] for b in g.outputs if not b.is_input}
    for t in g.tasks:
        for r in t.outputs:
            if r.buffer.name in covers:
                covers[r.buffer.name].append(r.box)
    for name, boxes in covers.items():
        buf = g.buffers[name]
        boxes.sort(key=lambda box: tuple(a for a, _ in box))  # tiles in order leave few pieces
        gaps = [gap for gap in uncovered(buf.full.box, boxes) if all(b > a for a, b in gap)]
        if gaps:
            yield "", (f"output {name!r}: no task writes {Region(buf, gaps[0])}"
                       f"{f' (and {len(gaps) - 1} more regions)' if len(gaps) > 1 else ''}; "
                       "the run would return uninitialised memory there")


def _unordered_writes(g: TaskGraph) -> Iterator[Problem]:
    if g._hazards_ordered:  # derived edges order every two overlapping accesses
        return
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
            msg = f"graph {g.name!r} breaks rule '{rule}':\n  " + "\n  ".join(m for _, m in problems)
            cyc = ()
            if rule == "cycle":
                try:
                    g.topological_order()
                except GraphError as e:
                    cyc = e.cycle
            raise GraphError(msg, tasks=names, cycle=cyc)
