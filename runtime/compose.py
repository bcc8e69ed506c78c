"""Compose a sub-graph into a graph as one unit (Taskflow's ``composed_of``).

    block = TaskGraph("block")                    # built once, placed many times
    ...
    l0 = g.compose(block, prefix="l0.", bind={"x": x, "y": h})
    l1 = g.compose(block, prefix="l1.", bind={"x": h, "y": out})
    l0.precede(l1)                                # optional: dependencies already follow from h

Bound buffers of the sub-graph become the given regions of the host graph (same shape
and dtype); every other buffer is added to the host under ``prefix + name`` with the
same role (input, output, in-out or scratch). Tasks are added under ``prefix + name``
in the sub-graph's order, so data dependencies are derived against the host's earlier
tasks as for any task, and the sub-graph's own edges (control edges too) are kept.
:func:`compose` reaches both graphs through their public API.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

from megaloom.runtime.errors import GraphError

if TYPE_CHECKING:
    from megaloom.runtime.graph import Buffer, Region, Task, TaskGraph


@dataclass(slots=True)
class Composed:
    """A sub-graph placed in a graph: its tasks there, and its buffers as host regions."""

    tasks: list[Task]
    regions: dict[str, Region]

    def __getitem__(self, name: str) -> Region:
        """The host region standing for the sub-graph buffer ``name``."""
        try:
            return self.regions[name]
        except KeyError:
            raise GraphError(f"the composed sub-graph has no buffer {name!r}") from None

    def _ends(self, side: str) -> list[Task]:
        """The tasks none of whose ``side`` (predecessors or successors) is inside the unit."""
        mine = {t.id for t in self.tasks}
        return [t for t in self.tasks if not any(o.id in mine for o in getattr(t, side))]

    sources = property(lambda self: self._ends("predecessors"), doc="Tasks with no predecessor inside the unit.")
    sinks = property(lambda self: self._ends("successors"), doc="Tasks with no successor inside the unit.")

    def precede(self, *others: Task | Composed) -> Composed:
        """Make every task of ``others`` (or their sources) wait for this unit's sinks."""
        for o in others:
            for a in self.sinks:
                a.precede(*(o.sources if isinstance(o, Composed) else [o]))
        return self

    def succeed(self, *others: Task | Composed) -> Composed:
        """Make this unit's sources wait for every task of ``others`` (or their sinks)."""
        for o in others:
            (o if isinstance(o, Composed) else Composed([o], {})).precede(self)
        return self


def compose(g: TaskGraph, sub: TaskGraph, prefix: str = "", bind: Mapping[str | Buffer, Buffer | Region] | None = None,
            ) -> Composed:
    """Add every buffer and task of ``sub`` to ``g``; see the module docstring."""
    if sub is g:
        raise GraphError(f"graph {g.name!r} cannot be composed into itself")
    regions: dict[str, Region] = {}
    for key, target in (bind or {}).items():
        name = key if isinstance(key, str) else key.name
        buf = sub.buffers.get(name)
        if buf is None or (not isinstance(key, str) and key is not buf):
            raise GraphError(f"bind names buffer {name!r}, which sub-graph {sub.name!r} does not have")
        r = g.as_region(target)
        if g.buffers.get(r.buffer.name) is not r.buffer:
            raise GraphError(f"bind maps {name!r} to {r}, which is not a buffer of graph {g.name!r}")
        if r.shape != buf.shape or r.dtype != buf.dtype:
            raise GraphError(f"bind maps {name!r} ({buf.shape} {buf.dtype}) to {r}, which is {r.shape} {r.dtype}")
        regions[name] = r
    for name, buf in sub.buffers.items():
        if name not in regions:
            regions[name] = g.add_buffer(prefix + name, buf.shape, buf.dtype, is_input=buf.is_input,
                                         is_output=buf.is_output).full

    def place(r: Region) -> Region:
        host = regions[r.buffer.name]
        return host.buffer.region((h0 + a, h0 + b) for (h0, _), (a, b) in zip(host.box, r.box))

    added = [g.task(t.op, [place(r) for r in t.inputs], [place(r) for r in t.outputs], name=prefix + t.name,
                    engine=t.engine, attrs=dict(t.attrs), priority=t.priority, tags=dict(t.tags), cost=t.cost)
             for t in sub.tasks]
    for b, preds in enumerate(sub.pred):  # the sub-graph's own edges, control edges included
        for a in preds:
            g.edge(added[a], added[b])
    return Composed(added, regions)
