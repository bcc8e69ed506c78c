"""msgpack save/load of task graphs with a schema version.

Every edge is stored (derived and control alike), so a loaded graph is the graph that
was saved even where it was built from explicit edges only. Loading checks every field
and raises TraceFormatError (bad file) or GraphError (bad graph), never a raw KeyError.
The functions here reach the graph through its public API; ``TaskGraph.save``,
``TaskGraph.load``, ``to_dict`` and ``from_dict`` call them.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import msgpack

from megaloom.runtime.errors import GraphError, TraceFormatError
from megaloom.runtime.files import atomic_write, gc_paused, read_msgpack
from megaloom.runtime.registry import Cost

if TYPE_CHECKING:
    from megaloom.runtime.graph import Region, TaskGraph

GRAPH_FORMAT = "megaloom-graph"
GRAPH_VERSION = 1
_TASK_FIELDS = {"name": str, "op": str, "engine": str, "in": list, "out": list, "attrs": dict, "tags": dict,
                "priority": int}  # the type of each field of a stored task


def _region(r: Region) -> list[Any]:
    return [r.buffer.name, [list(b) for b in r.box]]


def graph_to_dict(g: TaskGraph) -> dict[str, Any]:
    """The stored form of ``g``: its buffers, its tasks (regions, attrs, tags, cost) and every edge."""
    tasks = [{"name": t.name, "op": t.op, "engine": t.engine, "in": [_region(r) for r in t.inputs],
              "out": [_region(r) for r in t.outputs], "attrs": g.task_attrs.get(t.id, {}),
              "priority": t.priority, "tags": g.task_tags.get(t.id, {}),
              "cost": None if t.cost is None else [t.cost.flops, t.cost.bytes, t.cost.comm_bytes, t.cost.precision]}
             for t in g.tasks]
    buffers = [[b.name, list(b.shape), b.dtype, b.is_input, b.is_output] for b in g.buffers.values()]
    return {"format": GRAPH_FORMAT, "version": GRAPH_VERSION, "name": g.name, "buffers": buffers, "tasks": tasks,
            "pred": g.pred}


def save_graph(g: TaskGraph, path: str | os.PathLike) -> None:
    """Write ``g`` atomically; attrs and tags must be msgpack-encodable."""
    try:
        with gc_paused():
            data = msgpack.packb(graph_to_dict(g), use_bin_type=True)
    except (TypeError, ValueError) as e:  # ValueError: UnicodeEncodeError of a lone surrogate
        raise GraphError(f"graph {g.name!r}: attrs or tags are not msgpack-encodable: {e}") from e
    atomic_write(path, data)


def read_graph(path: str | os.PathLike) -> dict[str, Any]:
    """The stored form of a graph file (checked by :func:`fill_graph`)."""
    return read_msgpack(path, GRAPH_FORMAT, GRAPH_VERSION, TraceFormatError)


def _want(cond: bool, where: str, what: str) -> None:
    if not cond:
        raise TraceFormatError(f"{where}: {what}")


def fill_graph(g: TaskGraph, d: dict[str, Any], where: str = "<graph>") -> TaskGraph:
    """Rebuild the graph stored as ``d`` in the empty graph ``g``, checking every field."""
    _want(isinstance(d.get("name"), str), where, "missing graph name")
    _want(all(isinstance(d.get(k), list) for k in ("buffers", "tasks", "pred")), where, "missing buffers/tasks/pred")
    g.name = d["name"]
    for i, b in enumerate(d["buffers"]):
        ok = isinstance(b, list) and len(b) == 5 and all(map(isinstance, b, (str, list, str, bool, bool)))
        _want(ok and all(isinstance(x, int) for x in b[1]), where, f"buffer {i} is malformed: {b!r:.80}")
        g.add_buffer(b[0], b[1], b[2], is_input=b[3], is_output=b[4])
    n = len(d["tasks"])
    for i, t in enumerate(d["tasks"]):
        _want(isinstance(t, dict) and all(isinstance(t.get(k), kind) for k, kind in _TASK_FIELDS.items()), where,
              f"task {i} is malformed")
        regions = []
        for r in t["in"] + t["out"]:
            _want(isinstance(r, list) and len(r) == 2 and isinstance(r[0], str) and r[0] in g.buffers
                  and isinstance(r[1], list)
                  and all(isinstance(p, list) and len(p) == 2 and all(isinstance(v, int) for v in p) for p in r[1]),
                  where, f"task {t['name']!r} has a malformed region {r!r:.80}")
            regions.append(g.buffers[r[0]].region(r[1]))
        c = t.get("cost")
        cost = Cost(*c) if isinstance(c, list) and len(c) == 4 else c
        _want(cost is None or (isinstance(cost, Cost) and cost.valid()), where,
              f"task {t['name']!r} has a malformed cost (finite non-negative flops, bytes, comm bytes)")
        g.task(t["op"], regions[: len(t["in"])], regions[len(t["in"]):], name=t["name"], engine=t["engine"],
               attrs=t["attrs"], priority=t["priority"], tags=t["tags"], cost=cost)
    _want(len(d["pred"]) == n and all(isinstance(p, list) and all(isinstance(v, int) and 0 <= v < n for v in p)
                                      for p in d["pred"]), where, "an edge names a task that does not exist")
    g.set_edges(d["pred"])  # stored edges replace derived ones: the loaded graph is exactly the saved one
    return g
