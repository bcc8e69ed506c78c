"""``TaskGraph.validate``: a table of rules, each naming the tasks and buffers it blames.

Rules run in table order; the first rule that finds problems raises one GraphError
listing all of them (up to ten), with ``tasks`` naming every offender. The rules read the
graph's columns: ops, engine kinds and the shapes of tasks without regions or attrs are
checked once per distinct value, regions task by task, so a graph built from arrays (no
regions) validates in a few passes over its columns.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterator

from megaloom.runtime.errors import GraphError
from megaloom.runtime.region import BoxIndex, uncovered
from megaloom.runtime.registry import TensorSpec, get_op
from megaloom.runtime.files import gc_paused

if TYPE_CHECKING:
    from megaloom.runtime.graph import Region, TaskGraph

Problem = tuple[str, str]  # (task name or "", message)


def _flagged(g: TaskGraph, column, bad: set) -> Iterator[int]:
    """Ids of the tasks whose ``column`` entry is in ``bad``, in id order (nothing when none is)."""
    return (i for i, key in enumerate(column) if key in bad) if bad else iter(())


def _unknown_op(g: TaskGraph) -> Iterator[Problem]:
    bad = set()
    for code in set(g._op):  # each op once, not each task
        try:
            get_op(g._op_names[code])
        except GraphError:
            bad.add(code)
    for i in _flagged(g, g._op, bad):
        t = g.tasks[i]
        yield t.name, f"task {t.name!r}: unknown op {t.op!r}"


def _engine(g: TaskGraph) -> Iterator[Problem]:
    bad = {(o, e) for o, e in set(zip(g._op, g._eng)) if g._eng_names[e] not in get_op(g._op_names[o]).engines}
    for i in _flagged(g, zip(g._op, g._eng), bad):
        t = g.tasks[i]
        engines = get_op(t.op).engines
        yield t.name, f"task {t.name!r}: op {t.op!r} runs on {'/'.join(engines)}, not {t.engine!r}"


def _shape_problem(op: str, ins: tuple[Region, ...], outs: tuple[Region, ...], attrs: dict) -> str | None:
    try:
        want = get_op(op).shape([TensorSpec(r.shape, r.dtype) for r in ins], attrs)
    except Exception as e:  # a shape rule given operands it does not expect may raise anything
        return str(e) if isinstance(e, GraphError) else f"shape rule of op {op!r} failed: {type(e).__name__}: {e}"
    if len(want) != len(outs):
        return f"op {op!r} makes {len(want)} outputs, task declares {len(outs)}"
    for i, (w, r) in enumerate(zip(want, outs)):
        if tuple(w.shape) != r.shape or w.dtype != r.dtype:
            return f"output {i} ({r}) is {r.shape} {r.dtype}, op {op!r} makes {tuple(w.shape)} {w.dtype}"
    return None


def _shapes(g: TaskGraph) -> Iterator[Problem]:
    # a task with no regions and no attrs is checked once per op; the others one by one
    own = set(g._io).union(g._attrs)
    bare = set(g._op) if not own else {c for i, c in enumerate(g._op) if i not in own}
    bad = {c: why for c in bare if (why := _shape_problem(g._op_names[c], (), (), {}))}
    for i in (range(len(g)) if bad else sorted(own)):
        if i in own:
            ins, outs = g._io.get(i, ((), ()))
            why = _shape_problem(g._op_names[g._op[i]], ins, outs, g._attrs.get(i, {}))
        else:
            why = bad.get(g._op[i])
        if why:
            name = g.tasks[i].name
            yield name, f"task {name!r}: {why}"


def _cycles(g: TaskGraph) -> Iterator[Problem]:
    try:
        g.topological_order()
    except GraphError as e:
        for name in e.cycle[:1]:
            yield name, str(e)


def _ordered(g: TaskGraph):
    """``before(a, b)``: whether task ``a`` is ordered before task ``b`` by the graph's edges.
    A direct edge answers at once (a file megaloom wrote holds every derived edge, so almost
    every question is one); otherwise the edges are searched backwards from ``b``."""
    sets: dict[int, set[int]] = {}  # predecessor sets of tasks with many predecessors

    def before(a: int, b: int) -> bool:
        preds = g.preds_of(b)
        if len(preds) > 8:
            preds = sets.get(b) or sets.setdefault(b, set(preds))
        return a in preds or g.reaches(a, b)

    return before


def _unwritten_reads(g: TaskGraph) -> Iterator[Problem]:
    yield from _sweep(g)[0]


def _sweep(g: TaskGraph) -> tuple[list[Problem], list[Problem]]:
    """Reads of unwritten regions, and accesses the edges leave unordered (the first ten of
    each): derivation replayed in a topological order, an index of the earlier reads and
    writes per buffer (a write drops the accesses it covers, as derivation does), each access
    checked against the earlier ones it meets (RAW, WAR, WAW). With derived edges every one
    of those is ordered before it (an edge against insertion order would close a cycle), so
    only coverage is checked; a loaded graph's stored edges are asked. Linear in tasks when
    the edges include the derived ones; computed once per graph version."""
    def make() -> tuple[list[Problem], list[Problem]]:
        ids = g._io if g.forward_only else [i for i in g.topological_order() if i in g._io]  # tasks with regions
        trusted = g.hazards_derived
        before = (lambda a, b: True) if trusted else _ordered(g)
        reads: dict[str, BoxIndex] = {b: BoxIndex() for b in g.buffers}
        writes: dict[str, BoxIndex] = {b: BoxIndex() for b in g.buffers}
        gaps, races = [], []
        for tid in ids:
            t = g.tasks[tid]
            ins, outs = g._io[tid]
            for r in ins:
                found = writes[r.buffer.name].overlapping(r.box)
                racing = [g.tasks[w].name for _, w in found if w != tid and not before(w, tid)]
                left = [] if r.buffer.is_input else [gap for gap in uncovered(
                    r.box, [box for box, w in found if before(w, tid)]) if all(b > a for a, b in gap)]
                if left:
                    why = f" (task {racing[0]!r} writes it with no order between them)" if racing \
                        else ", and it is not a graph input"
                    gaps.append((t.name, f"task {t.name!r} reads {r}, but no task ordered before it writes "
                                         f"{r.buffer.region(left[0])}{why}"))
                elif racing:
                    races.append((t.name, f"task {t.name!r} reads {r} while task {racing[0]!r} writes it, "
                                          "with no order between them"))
            for r in outs if not trusted else ():
                for _, w in writes[r.buffer.name].overlapping(r.box):
                    if w != tid and not before(w, tid):
                        ta, tb = (g.tasks[i].name for i in sorted((w, tid)))
                        races.append((ta, f"tasks {ta!r} and {tb!r} both write buffer {r.buffer.name!r} "
                                          "with no order between them"))
                for _, rd in reads[r.buffer.name].overlapping(r.box):
                    if rd != tid and not before(rd, tid):
                        races.append((t.name, f"task {t.name!r} writes {r} while task {g.tasks[rd].name!r} "
                                              "reads it, with no order between them"))
            for r in ins:
                reads[r.buffer.name].add(r.box, tid)
            for r in outs:  # an access inside this write is ordered before it (checked above)
                reads[r.buffer.name].drop_inside(r.box, tid)
                writes[r.buffer.name].drop_inside(r.box, tid)
                writes[r.buffer.name].add(r.box, tid)
            if len(gaps) >= 10 and (trusted or len(races) >= 10):
                break
        return gaps[:10], races[:10]

    return g.cached("access_sweep", make)


def _unwritten_outputs(g: TaskGraph) -> Iterator[Problem]:
    # outputs are allocated uninitialised (no zeroing), so every element must be written;
    # a scratch buffer needs no such rule: each read of it must be covered (the rule above)
    covers: dict[str, list] = {b.name: [] for b in g.outputs if not b.is_input}
    for _, outs in g._io.values():
        for r in outs:
            if r.buffer.name in covers:
                covers[r.buffer.name].append(r.box)
    for name, boxes in covers.items():
        buf = g.buffers[name]
        boxes.sort(key=lambda box: tuple(a for a, _ in box))  # tiles in order leave few pieces
        gaps = [gap for gap in uncovered(buf.full.box, boxes) if all(b > a for a, b in gap)]
        if gaps:
            yield "", (f"output {name!r}: no task writes {buf.region(gaps[0])}"
                       f"{f' (and {len(gaps) - 1} more regions)' if len(gaps) > 1 else ''}; "
                       "the run would return uninitialised memory there")


def _unordered_writes(g: TaskGraph) -> Iterator[Problem]:
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
