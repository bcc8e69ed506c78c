"""``TaskGraph.validate``: a table of rules, each naming the tasks and buffers it blames.

Rules run in table order; the first rule that finds problems raises one GraphError
listing all of them (up to ten), with ``tasks`` naming every offender.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterator

from megaloom.runtime.errors import GraphError
from megaloom.runtime.region import BoxIndex, uncovered
from megaloom.runtime.registry import TensorSpec, get_op

if TYPE_CHECKING:
    from megaloom.runtime.graph import TaskGraph

Problem = tuple[str, str]  # (task name, message)


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


def _writers(g: TaskGraph) -> dict[str, BoxIndex]:
    out: dict[str, BoxIndex] = {}
    for t in g.tasks:
        for r in t.outputs:
            out.setdefault(r.buffer.name, BoxIndex()).add(r.box, t.id)
    return out


class _Order:
    """Whether task ``a`` is ordered before task ``b``; each task's ancestors are found once."""

    def __init__(self, g: TaskGraph):
        self.pred = g.pred
        self.ancestors: dict[int, set[int]] = {}

    def before(self, a: int, b: int) -> bool:
        if a in self.pred[b]:
            return True
        anc = self.ancestors.get(b)
        if anc is None:
            anc, stack = set(), list(self.pred[b])
            while stack:
                p = stack.pop()
                if p not in anc:
                    anc.add(p)
                    stack.extend(self.pred[p])
            self.ancestors[b] = anc
        return a in anc


def _unwritten_reads(g: TaskGraph) -> Iterator[Problem]:
    # With derived edges and no edge against insertion order, the writers ordered before a
    # task are exactly the earlier ones: sweep in order, keeping an index of earlier writes
    # (a write drops the ones it covers, as derivation does). Otherwise ask the edges.
    sweep = g.hazards_derived and g.forward_only
    writers = {} if sweep else _writers(g)
    order = _Order(g)
    for t in g.tasks:
        for r in t.inputs:
            if r.buffer.is_input:
                continue
            index = writers.get(r.buffer.name)
            found = index.overlapping(r.box) if index is not None else []
            covers = [box for box, w in found if sweep or (w != t.id and order.before(w, t.id))]
            gaps = [gap for gap in uncovered(r.box, covers) if all(b > a for a, b in gap)]
            if gaps:
                gap = r.buffer.region(gaps[0])
                yield t.name, (f"task {t.name!r} reads {r}, but no task ordered before it writes {gap}, "
                               "and it is not a graph input")
        if sweep:
            for r in t.outputs:
                index = writers.setdefault(r.buffer.name, BoxIndex())
                index.drop_inside(r.box, t.id)
                index.add(r.box, t.id)


def _unordered_writes(g: TaskGraph) -> Iterator[Problem]:
    if g.hazards_derived:  # derived edges order every two overlapping writes (WAW)
        return
    order = _Order(g)
    for name, index in _writers(g).items():
        for abox, a in list(index.entries):
            for _, b in index.overlapping(abox):
                if a < b and not (order.before(a, b) or order.before(b, a)):
                    ta, tb = g.tasks[a].name, g.tasks[b].name
                    yield ta, f"tasks {ta!r} and {tb!r} both write buffer {name!r} with no order between them"


RULES: list[tuple[str, Callable[[TaskGraph], Iterator[Problem]]]] = [
    ("unknown op", _unknown_op),
    ("engine kind", _engine),
    ("cycle", _cycles),
    ("shape and dtype", _shapes),
    ("read of unwritten region", _unwritten_reads),
    ("unordered writes", _unordered_writes),
]


def validate(g: TaskGraph) -> None:
    """Raise GraphError for the first rule of :data:`RULES` that the graph breaks."""
    for rule, check in RULES:
        problems = []
        for p in check(g):
            problems.append(p)
            if len(problems) >= 10:
                break
        if problems:
            names = tuple(dict.fromkeys(n for n, _ in problems))
            msg = f"graph {g.name!r} breaks rule '{rule}':\n  " + "\n  ".join(m for _, m in problems)
            cyc = ()
            if rule == "cycle":
                try:
                    g.topological_order()
                except GraphError as e:
                    cyc = e.cycle
            raise GraphError(msg, tasks=names, cycle=cyc)
