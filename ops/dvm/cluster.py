"""The fusion pass: cluster chains of fusible vector tasks into ``dvm.fused`` tasks.

    fused = fuse(graph)                      # a new TaskGraph; ``graph`` is left as it was

1. **Cluster.** Visit tasks in topological order; merge a fusible task with the cluster of
   each fusible producer it reads exactly (same region), unless the merge would close a
   cycle through a task outside the pair (checked by reachability over the contracted
   graph), break the region rules below, or mix shapes that do not broadcast together.
2. **Split.** A cluster over the :class:`Limits` is cut by :func:`split.split` (DP over the
   cluster's topological order).
3. **Rebuild.** Each segment of two or more ops becomes one ``dvm.fused`` task holding a
   :class:`Program`; other tasks are copied. Values read after the segment (outside the
   cluster, by a later segment, or graph outputs) become its outputs; intermediates used
   only inside vanish, with their buffers when nothing else touches them.

Region rules inside a cluster: member writes never overlap, a member reads a member-written
region only as exactly that region from its direct producer, and a task reading the
region it writes (in place) is not fused. Reductions, matmul, comm ops and unknown ops
are boundaries simply by not being fusible.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any

from megaloom.ops.dvm.primitives import PREFIX, PRIMITIVES, broadcast, infer, n_tensor_inputs
from megaloom.ops.dvm.program import Instr, Program
from megaloom.ops.dvm.split import Limits, SegNode, split
from megaloom.runtime.errors import GraphError
from megaloom.runtime.graph import Region, Task, TaskGraph
from megaloom.runtime.region import overlaps

ALIASES = {"add": "add", "mul": "mul"}  # built-in ops with the same semantics as a primitive
Key = tuple[str, tuple]  # (buffer name, box): one region


def primitive_of(task: Task) -> str | None:
    """The primitive a task computes when it can be fused, else None."""
    name = task.op[len(PREFIX):] if task.op.startswith(PREFIX) else ALIASES.get(task.op)
    if name not in PRIMITIVES or task.engine != "vector" or len(task.outputs) != 1:
        return None
    if len(task.inputs) != n_tensor_inputs(PRIMITIVES[name], task.attrs):
        return None
    out = task.outputs[0]
    if any(r.buffer is out.buffer and overlaps(r.box, out.box) for r in task.inputs):
        return None
    try:
        infer(name, [(r.shape, r.dtype) for r in task.inputs], task.attrs)
    except GraphError:
        return None
    return name


def _key(r: Region) -> Key:
    return r.buffer.name, r.box


@dataclass(slots=True)
class _State:
    """Union-find over tasks; per cluster root: members (topological order), writes, domain."""

    graph: TaskGraph
    pos: list[int]
    root: list[int]
    members: dict[int, list[int]]
    writes: dict[int, dict[str, list[tuple[tuple, int]]]]
    domain: dict[int, tuple[int, ...]]

    def find(self, t: int) -> int:
        r = t
        while self.root[r] != r:
            r = self.root[r]
        while self.root[t] != r:
            self.root[t], t = r, self.root[t]
        return r


def fuse(graph: TaskGraph, limits: Limits = Limits(), backend: str | None = None, min_ops: int = 2) -> TaskGraph:
    """A new graph in which clusters of fusible vector tasks are ``dvm.fused`` tasks.

    ``limits`` bound each fused node; ``backend`` ("tiled"/"inductor") is stored in the
    fused tasks' attrs (``None``: the process option at run time); segments of fewer than
    ``min_ops`` ops stay as they were.
    """
    graph.validate()
    clusters = find_clusters(graph)
    access = _accesses(graph)
    units: list[list[int]] = []
    fused_units: set[int] = set()
    in_cluster = {t for c in clusters for t in c}
    for c in clusters:
        for a, b in split(seg_nodes(graph, c, access), limits):
            seg = c[a:b]
            if len(seg) >= max(min_ops, 2):
                fused_units.add(len(units))
                units.append(seg)
            else:
                units.extend([t] for t in seg)
    units.extend([t] for t in range(len(graph.tasks)) if t not in in_cluster)
    return _rebuild(graph, units, fused_units, backend, access)


def find_clusters(graph: TaskGraph) -> list[list[int]]:
    """Clusters of two or more fusible tasks, each in topological order (greedy merging)."""
    order = graph.topological_order()
    pos = [0] * len(graph.tasks)
    for i, t in enumerate(order):
        pos[t] = i
    prim = {t.id: p for t in graph.tasks if (p := primitive_of(t)) is not None}
    st = _State(graph, pos, list(range(len(graph.tasks))), {t: [t] for t in prim},
                {t: {graph.tasks[t].outputs[0].buffer.name: [(graph.tasks[t].outputs[0].box, t)]} for t in prim},
                {t: broadcast([r.shape for r in (*graph.tasks[t].inputs, *graph.tasks[t].outputs)]) for t in prim})
    for v in order:
        if v not in prim:
            continue
        reads = {_key(r) for r in graph.tasks[v].inputs}
        for p in sorted(graph.pred[v], key=pos.__getitem__):
            if p not in prim or _key(graph.tasks[p].outputs[0]) not in reads:
                continue
            a, b = st.find(p), st.find(v)
            if a == b:
                continue
            dom = _compatible(st, a, b)
            if dom is not None and not _closes_cycle(st, a, b, pos[v]):
                st.root[b] = a
                st.members[a] = sorted(st.members[a] + st.members.pop(b), key=pos.__getitem__)
                for buf, ws in st.writes.pop(b).items():
                    st.writes[a].setdefault(buf, []).extend(ws)
                st.domain[a] = dom
                del st.domain[b]
    return sorted((m for m in st.members.values() if len(m) > 1), key=lambda m: pos[m[0]])


def _compatible(st: _State, a: int, b: int) -> tuple[int, ...] | None:
    """The merged domain when clusters ``a`` and ``b`` may merge by the region rules, else None.

    Each cluster already satisfies the rules alone, so only pairs across them are checked."""
    g = st.graph
    try:
        dom = broadcast([st.domain[a], st.domain[b]])
    except GraphError:
        return None
    for x, y in ((a, b), (b, a)):
        wy = st.writes[y]
        for buf, ws in st.writes[x].items():  # writes never overlap
            if any(overlaps(box, ybox) for box, _ in ws for ybox, _ in wy.get(buf, ())):
                return None
        for m in st.members[x]:  # reads of the other side's writes: exactly, from a direct producer
            for r in g.tasks[m].inputs:
                for box, w in wy.get(r.buffer.name, ()):
                    if overlaps(box, r.box) and (box != r.box or w not in g.pred[m]):
                        return None
    return dom


def _closes_cycle(st: _State, a: int, b: int, limit: int) -> bool:
    """True when merging clusters ``a`` and ``b`` would close a cycle through another task."""
    return _outside_path(st, a, b, limit) or _outside_path(st, b, a, limit)


def _outside_path(st: _State, src: int, dst: int, limit: int) -> bool:
    g, pos = st.graph, st.pos
    pair = {src, dst}
    stack = [s for m in st.members.get(src, [src]) for s in g.succ[m] if st.find(s) not in pair]
    seen: set[int] = set()
    while stack:
        n = stack.pop()
        c = st.find(n)
        if c in seen or pos[n] > limit:  # tasks past ``limit`` are unclustered: they only reach later ones
            continue
        seen.add(c)
        for m in st.members.get(c, [n]):
            for s in g.succ[m]:
                cs = st.find(s)
                if cs == dst:
                    return True
                if cs != src and cs not in seen:
                    stack.append(s)
    return False


Access = dict[str, list[tuple[int, tuple]]]  # buffer name -> (task id, box) of every access


def _accesses(graph: TaskGraph) -> Access:
    out: Access = {}
    for t in graph.tasks:
        for r in (*t.inputs, *t.outputs):
            out.setdefault(r.buffer.name, []).append((t.id, r.box))
    return out


def _needed_outside(graph: TaskGraph, members: set[int], access: Access) -> set[Key]:
    """Regions written by ``members`` that some other task touches or the graph returns."""
    out: set[Key] = set()
    for m in members:
        r = graph.tasks[m].outputs[0]
        if r.buffer.is_output or r.buffer.is_input or any(
                t not in members and overlaps(box, r.box) for t, box in access[r.buffer.name]):
            out.add(_key(r))
    return out


def seg_nodes(graph: TaskGraph, cluster: list[int], access: Access) -> list[SegNode]:
    """The cluster as split input: one node per task, in the cluster's order."""
    needed = _needed_outside(graph, set(cluster), access)
    nodes = []
    for m in cluster:
        t = graph.tasks[m]
        nodes.append(SegNode(PRIMITIVES[primitive_of(t)].icost, tuple(_key(r) for r in t.inputs),
                             _key(t.outputs[0]), _key(t.outputs[0]) in needed))
    return nodes


def program_for(graph: TaskGraph, seg: list[int], outputs: set[Key]) -> tuple[Program, list[Region], list[Region]]:
    """The fused program of tasks ``seg`` (in order) whose values in ``outputs`` leave it,
    with its input and output regions."""
    value: dict[Key, int] = {}
    in_regions: list[Region] = []
    for m in seg:
        for r in graph.tasks[m].inputs:
            k = _key(r)
            if k not in value and not any(_key(graph.tasks[w].outputs[0]) == k for w in seg):
                value[k] = len(in_regions)
                in_regions.append(r)
    n_in = len(in_regions)
    code, out_ids, out_regions = [], [], []
    for i, m in enumerate(seg):
        t = graph.tasks[m]
        attrs = tuple(sorted((k, v) for k, v in t.attrs.items() if k in ("scalar", "scalar_pos", "dtype")))
        code.append(Instr(primitive_of(t), tuple(value[_key(r)] for r in t.inputs), attrs))
        k = _key(t.outputs[0])
        value[k] = n_in + i
        if k in outputs:
            out_ids.append(n_in + i)
            out_regions.append(t.outputs[0])
    prog = Program(tuple((r.shape, r.dtype) for r in in_regions), tuple(code), tuple(out_ids))
    return prog, in_regions, out_regions


def _rebuild(graph: TaskGraph, units: list[list[int]], fused: set[int], backend: str | None,
             access: Access) -> TaskGraph:
    unit_of = [0] * len(graph.tasks)
    for u, ts in enumerate(units):
        for t in ts:
            unit_of[t] = u
    # unit outputs: what a later unit, another task or the caller needs
    specs: dict[int, tuple[Program, list[Region], list[Region]]] = {}
    for u in sorted(fused):
        seg = units[u]
        needed = _needed_outside(graph, set(seg), access)
        specs[u] = program_for(graph, seg, needed)
    succ: list[set[int]] = [set() for _ in units]
    indeg = [0] * len(units)
    for a in range(len(graph.tasks)):
        for b in graph.succ[a]:
            ua, ub = unit_of[a], unit_of[b]
            if ua != ub and ub not in succ[ua]:
                succ[ua].add(ub)
                indeg[ub] += 1
    first = [min(ts) for ts in units]
    ready = [(first[u], u) for u in range(len(units)) if indeg[u] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, u = heapq.heappop(ready)
        order.append(u)
        for s in succ[u]:
            indeg[s] -= 1
            if indeg[s] == 0:
                heapq.heappush(ready, (first[s], s))
    if len(order) != len(units):
        raise GraphError(f"DVM fusion of graph {graph.name!r} produced a cycle (a bug in the cluster pass)")

    regions_of: dict[int, tuple[list[Region], list[Region]]] = {}
    for u in order:
        if u in fused:
            _, ins, outs = specs[u]
            regions_of[u] = (ins, outs)
        else:
            t = graph.tasks[units[u][0]]
            regions_of[u] = (list(t.inputs), list(t.outputs))
    used = {r.buffer.name for ins, outs in regions_of.values() for r in (*ins, *outs)}
    new = TaskGraph(graph.name)
    for b in graph.buffers.values():
        if b.is_input or b.is_output or b.name in used:
            make = {(True, True): new.inout, (True, False): new.input, (False, True): new.output}.get(
                (b.is_input, b.is_output), new.buffer)
            make(b.name, b.shape, b.dtype)
    remap = lambda rs: [Region(new.buffers[r.buffer.name], r.box) for r in rs]  # noqa: E731
    made: dict[int, Task] = {}
    names = {t.name for t in graph.tasks}
    n_fused = 0
    for u in order:
        ins, outs = regions_of[u]
        if u in fused:
            tasks = [graph.tasks[t] for t in units[u]]
            attrs: dict[str, Any] = {"program": specs[u][0].to_attrs(), "members": [t.name for t in tasks]}
            if backend is not None:
                attrs["backend"] = backend
            name = f"dvm.fused#{n_fused}"
            while name in names:
                name += "'"
            n_fused += 1
            made[u] = new.task("dvm.fused", remap(ins), remap(outs), name=name, engine="vector", attrs=attrs,
                               priority=max(t.priority for t in tasks), tags=_common_tags(tasks))
        else:
            t = graph.tasks[units[u][0]]
            made[u] = new.task(t.op, remap(ins), remap(outs), name=t.name, engine=t.engine, attrs=t.attrs,
                               priority=t.priority, tags=t.tags, cost=t.cost)
        for p in {unit_of[p] for t in units[u] for p in graph.pred[t]} - {u}:
            new.edge(made[p], made[u])  # keeps control edges; data edges are re-derived anyway
    return new


def _common_tags(tasks: list[Task]) -> dict[str, Any]:
    tags = dict(tasks[0].tags)
    for t in tasks[1:]:
        tags = {k: v for k, v in tags.items() if t.tags.get(k, object()) == v}
    return tags
