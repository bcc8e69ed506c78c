"""Host threads: chains of their outermost runtime calls (in a trace with no device activity,
of their outermost CPU ops, which were the device's work).

The untraced host time between two calls is the later call's delay, tagged ``cpu`` with the
part spent inside CPU ops. Annotations (``user_annotation``, ``nn.Module:`` Python frames) and
the CPU ops around a call are its context (tags), never tasks. A call is cut where a kernel
it launched started inside it, and where a sync it made returned (:mod:`.waits`): the time
before the return was waiting, not host work.

On the CPU, an op's work figures are the sum over the GEMM-like ops in its nest (each counted
once: the innermost ones), else over its outermost ops with recorded shapes (itself, or the
ops an autograd node ran); the ops and shapes are kept (tag ``sources``) for shape what-ifs; a
communication backend's annotation (``gloo:all_reduce`` on gloo's thread, ``gloo:send`` inside
``c10d::send``) makes a comm task with the bytes of its tensor; a ``c10d::`` op that only hands
a collective to a backend thread is host work.
"""
from __future__ import annotations

import re
from typing import Any

from megaloom.runtime.registry import COMM, HOST
from megaloom.scheduler.importers.kineto.classes import (
    CONTEXT_CATEGORIES, RUNTIME, RUNTIME_CATEGORIES, backend_op, cpu_class,
)
from megaloom.scheduler.importers.kineto.model import Call, Model, Task, corr
from megaloom.scheduler.importers.kineto.read import Slice
from megaloom.scheduler.importers.kineto.work import backend_work, has_formula, op_work, source, tensor_bytes, total

_P2P_ARGS = re.compile(r"^-?\d+$")
_BACKWARD = "autograd::engine::"


def sweep(m: Model, track: tuple, items: list[Slice]) -> None:
    """Outermost calls of one thread (``items`` in start order, enclosing ones first);
    annotations and CPU ops become their context."""
    rep, gpu, calls_all, corr_call = m.report, m.has_device, m.calls, m.corr_call
    calls = m.thread_calls.setdefault(track, [])
    busy = m.thread_busy.setdefault(track, [])
    marks = m.thread_marks.setdefault(track, [])
    stack: list[tuple[float, tuple, tuple, int]] = [(float("inf"), (), (), -1)]  # (end, annotations, ops, owning call)
    for s in items:
        start = s.start
        while stack[-1][0] <= start:
            stack.pop()
        end, anns, ops, owner = stack[-1]
        if s.end > end:  # overhangs its parent (clock rounding): clamp and count
            rep.overhangs += 1
            rep.max_overhang_us = max(rep.max_overhang_us, s.end - end)
            s.end = end
        marks += (start, s.end)
        cat = s.cat
        if cat in CONTEXT_CATEGORIES and (gpu or not backend_op(s.name)):
            rep.context[cat] += 1
            named = cat == "user_annotation" or s.name.startswith("nn.Module: ")
            stack.append((s.end, anns + (s.name.removeprefix("nn.Module: "),) if named else anns, ops, owner))
            continue
        runtime = cat in RUNTIME_CATEGORIES
        if not ops and owner < 0:
            if busy and start <= busy[-1][1]:
                busy[-1][1] = max(busy[-1][1], s.end)
            else:
                busy.append([start, s.end])
        if owner < 0 and (runtime or not gpu):
            owner = len(calls_all)
            calls_all.append(Call(s, anns, ops))
            calls.append(owner)
        else:
            if owner >= 0:
                calls_all[owner].nested.append(s)
            rep.context[cat or "uncategorised"] += 1
        if owner >= 0 and (c := corr(s)) is not None:
            corr_call.setdefault(c, owner)
        stack.append((s.end, anns, ops if runtime else ops + (s,), owner))
    marks.sort()


def tasks(m: Model) -> None:
    """Each call as one task, or as pieces cut at launch points and at its sync's return."""
    m.forward_of = {} if m.has_device else {o.args["Sequence number"]: chain for c in m.calls  # for _cpu_op
                    if not c.s.name.startswith(_BACKWARD) for o, chain in _chains(c) if "Sequence number" in o.args}
    for track, ids in m.thread_calls.items():
        prev, busy, k, at = None, m.thread_busy[track], 0, m.t0
        for ci in ids:
            for p in _pieces(m, track, m.calls[ci]):  # program order on the thread
                t = m.tasks[p]
                if prev is not None:
                    t.deps.insert(0, prev)
                if "sync" not in t.tags:  # the time before a sync's return was waiting
                    k = _cpu_time(t, busy, k, at)
                prev, at = p, t.end
        last = busy[-1][1] if busy else at
        if prev is not None and last > at:  # CPU work after the last call: the thread ends later
            t = Task("thread end", "thread end", HOST, track, last, last, [prev],
                     {"category": "end of thread", "class": RUNTIME.label, "thread": track[1]})
            _cpu_time(t, busy, k, at)
            m.new(t)
    m.report.host_calls = len(m.calls)


def _chains(call: Call) -> list[tuple[Slice, tuple[str, ...]]]:
    """Each op of a call's nest (in time order) with the names of the ops that contain it,
    outermost first, itself last."""
    out: list[tuple[Slice, tuple[str, ...]]] = []
    stack: list[tuple[Slice, tuple[str, ...]]] = []
    for o in (call.s, *call.nested):
        while stack and stack[-1][0].end <= o.start:
            stack.pop()
        stack.append((o, (stack[-1][1] if stack else ()) + (o.name,)))
        out.append(stack[-1])
    return out


def _cpu_time(t: Task, busy: list[list[float]], k: int, since: float) -> int:
    """Tag ``t`` with the seconds of ``[since, t.start)`` spent inside CPU ops (``cpu``); the
    rest of that gap the thread was idle. ``k``: first busy interval that may overlap."""
    while k < len(busy) and busy[k][1] <= since:
        k += 1
    covered, j = 0.0, k
    while j < len(busy) and busy[j][0] < t.start:
        covered += max(0.0, min(busy[j][1], t.start) - max(busy[j][0], since))
        j += 1
    if covered > 0:
        t.tags["cpu"] = covered * 1e-6
    return k


def _cpu_op(m: Model, call: Call, tags: dict) -> tuple[str, str, str, Any]:
    """Engine, class label, op and figures of a top-level CPU op of a trace with no device."""
    s, nest = call.s, [call.s, *call.nested]
    for o in nest:  # a backend's collective annotation in its nest: a comm task
        if kind := backend_op(o.name):
            if kind in ("send", "recv"):
                vals = s.args.get("Concrete Inputs") or []
                peer = [int(v) for v in vals[2:4] if isinstance(v, str) and _P2P_ARGS.match(v)]
                if len(peer) == 2:
                    tags.update(peer=peer[0], tag=peer[1])
            return COMM, "cpu_comm", kind, backend_work(kind, o.args, m.world_size)
    if grad := sum(tensor_bytes(o.args) for o in nest if o.name == "torch::autograd::AccumulateGrad"):
        tags["grad_bytes"] = grad  # what a data-parallel group would all-reduce
    if s.name.startswith(_BACKWARD) and (fwd := m.forward_of.get(s.args.get("Sequence number"))):
        tags["forward"] = list(fwd)  # the forward ops (outermost first) that recorded the node this runs
    elif call.nested:  # what a what-if aimed at an op inside this one takes out: [name, depth, seconds]
        tags["nested"] = [[o.name, len(chain) - 1, (o.end - o.start) * 1e-6] for o, chain in _chains(call)[1:]
                          if o.end - o.start >= 1.0]
    cls = cpu_class(s.name)
    shaped = [o for o in nest if "Input Dims" in o.args]
    gemms = [o for o in shaped if has_formula(o.name)]
    inner = [o for o in gemms if not any(g is not o and o.start <= g.start and g.end <= o.end for g in gemms)]
    srcs, end = inner, float("-inf")
    for o in shaped if not inner else ():  # no GEMM: the outermost ops with shapes (the op, or its node's)
        if o.start >= end:
            srcs, end = srcs + [o], o.end
    if srcs:
        tags["sources"] = [source(o.name, o.args) for o in srcs]
    if cls.engine == COMM:  # it only handed the collective to a backend thread
        return HOST, RUNTIME.label, s.name, None
    if inner and cls.label == "cpu_op":
        cls = cpu_class("aten::mm")
    return cls.engine, cls.label, s.name, total([op_work(o.name, o.args) for o in srcs])


def _pieces(m: Model, track: tuple, call: Call) -> list[int]:
    """The call's tasks: one, or pieces cut at launch points and at its sync's return (a
    zero-length host part, then the return after the waiting)."""
    s, rep = call.s, m.report
    tags: dict[str, Any] = {"category": s.cat or "uncategorised", "thread": s.tid}
    if m.has_device or s.cat in RUNTIME_CATEGORIES:
        engine, label, op, work = HOST, RUNTIME.label, s.name, None
    else:
        engine, label, op, work = _cpu_op(m, call, tags)
        if s.cat not in ("cpu_op", "") and not backend_op(s.name):
            rep.opaque += 1
            op = "opaque"
    tags["class"] = label
    waits = [w for w in (m.consistent(m.ops[i].task, s.end, "sync") for i in call.waits) if w is not None]
    ret = max([s.start, *(m.tasks[w].end for w in waits)])  # when the call's wait ended
    launches = {m.ops[i].s.start for i in call.launched if s.start < m.ops[i].s.start < s.end}  # its kernels' starts
    cuts = sorted((launches | {ret}) - {s.start})
    bounds = list(zip([s.start, *cuts], [*cuts, s.end]))
    wait_piece = cuts.index(ret) + 1 if ret > s.start else len(cuts)
    if ret > s.start:  # the call waited: the piece before its return lasts nothing (it was waiting)
        bounds[wait_piece - 1] = (bounds[wait_piece - 1][0],) * 2
    if call.anns:
        tags["annotations"] = list(call.anns)
    if call.ops:
        tags["op"] = call.ops[-1].name
    if s.truncated:
        tags["truncated"] = True
        rep.truncated += 1
    rep.split_calls += len(bounds) > 1
    for k, (a, b) in enumerate(bounds):
        piece_tags = dict(tags, piece=k) if len(bounds) > 1 else tags
        call.pieces.append(m.new(Task(s.name, op, engine, track, a, b, [], piece_tags, work)))
    if waits:
        piece = call.pieces[wait_piece]
        m.tasks[piece].deps.extend(waits)
        m.tasks[piece].tags = dict(m.tasks[piece].tags, sync=call.wait_kind)
        (rep.inferred if call.wait_inferred else rep.deps)[call.wait_kind] += 1
        if call.wait_inferred:
            m.inferred.setdefault(piece, []).extend(waits)
    return call.pieces
