"""Device streams: each kernel, copy and fill is a task on its stream.

A device op waits for its launch (the piece of its launch call that ends where it was
launched: a kernel that starts before its call returns splits the call there) and for the
previous op on its stream. Its class (engine and library) comes from the class table; its
work figures from the CPU op that launched it (shared among that op's kernels by recorded
duration), from its own arguments (copies, collectives) or from the launching
``record_param_comms`` op (collectives). ``Stream Wait Event`` records join streams.
"""
from __future__ import annotations

import math
from typing import Any

from megaloom.runtime.registry import COMM, COPY
from megaloom.scheduler.importers.kineto.classes import collective, device_class
from megaloom.scheduler.importers.kineto.model import Call, Model, Op, Task, corr, index
from megaloom.scheduler.importers.kineto.read import Slice
from megaloom.scheduler.importers.kineto.work import Work, comm_work, copy_work, has_formula, op_work, source


def sweep(m: Model, track: tuple, items: list[Slice]) -> None:
    """Device ops of one stream (``items`` in start order, enclosing ones first), tagged with
    the GPU annotations over them."""
    stack: list[tuple[float, tuple]] = []
    mine = m.stream_ops.setdefault(track, [])
    for s in items:
        while stack and stack[-1][0] <= s.start:
            stack.pop()
        anns = stack[-1][1] if stack else ()
        if s.cat == "gpu_user_annotation":
            m.report.context[s.cat] += 1
            stack.append((s.end, anns + (s.name,)))
            continue
        mine.append(len(m.ops))
        m.ops.append(Op(s, anns, corr(s)))


def link_launches(m: Model) -> None:
    """Each op's launching call, by correlation id; index of ops by stream and correlation."""
    m.by_corr = {track: index((m.ops[i].corr, i) for i in ids if m.ops[i].corr is not None)
                 for track, ids in m.stream_ops.items()}
    for i, op in enumerate(m.ops):
        if (ci := m.corr_call.get(op.corr)) is None:
            m.report.deps["device op without a recorded launch (stream order only)"] += 1
            continue
        op.call = ci
        m.calls[ci].launched.append(i)


def tasks(m: Model) -> None:
    """A task per device op, with its class, tags and work figures."""
    shares: dict[int, tuple[Slice, list[int]]] = {}  # launching CPU op (by seq) -> it and its kernels
    for track, ids in m.stream_ops.items():
        for i in ids:
            op, s = m.ops[i], m.ops[i].s
            cls = device_class(s.name, s.cat)
            call = m.calls[op.call] if op.call >= 0 else None
            tags: dict[str, Any] = {"category": s.cat, "class": cls.label, "stream": s.tid}
            if anns := dict.fromkeys((*(call.anns if call else ()), *op.anns)):
                tags["annotations"] = list(anns)
            grid = s.args.get("grid")
            if isinstance(grid, list) and grid and all(type(g) is int and g > 0 for g in grid):
                tags["blocks"] = math.prod(grid)
            work, name = None, s.name
            if cls.engine == COPY:
                work = copy_work(s.name, s.args)
            elif cls.engine == COMM:
                work, name = _comm(m, s, call, tags)
            elif call is not None and (src := _launching_op(call)) is not None:
                shares.setdefault(src.seq, (src, []))[1].append(len(m.tasks))
                tags["sources"] = [source(src.name, src.args)]
            if work is not None and work.comm_bytes:
                tags["link"] = work.link
            if call is not None and call.ops:
                tags["launched_by"] = call.ops[-1].name
            op.task = m.new(Task(s.name, name, cls.engine, track, s.start, s.end, tags=tags, work=work))
    for src, tids in shares.values():  # an op's figures shared among its kernels by recorded duration
        if (w := op_work(src.name, src.args)) is None:
            continue
        whole = sum(m.tasks[t].end - m.tasks[t].start for t in tids)
        for t in tids:
            f = (m.tasks[t].end - m.tasks[t].start) / whole if whole > 0 else 1.0 / len(tids)
            m.tasks[t].work = Work(w.flops * f, w.bytes * f, 0.0, w.precision)
    works = [m.tasks[op.task].work for op in m.ops]
    m.report.with_work = sum(w is not None and bool(w.flops or w.bytes or w.comm_bytes) for w in works)
    m.report.device_ops, m.report.without_work = len(m.ops), len(m.ops) - m.report.with_work


def _launching_op(call: Call) -> Slice | None:
    """The CPU op whose shapes describe the call's kernels: the nearest one up the stack with
    its own formula (GEMM, convolution, attention), else the innermost one with recorded shapes."""
    shaped = [s for s in reversed(call.ops) if "Input Dims" in s.args]
    return next((s for s in shaped if has_formula(s.name)), shaped[0] if shaped else None)


def _comm(m: Model, s: Slice, call: Call | None, tags: dict) -> tuple[Work | None, str]:
    """Figures and op name of a comm kernel: its own arguments, else its launching op's."""
    nest = [s.args, *(o.args for o in reversed(call.ops if call else ()))]
    src = next((a for a in nest if "Collective name" in a or "In msg nelems" in a), {})
    kind = collective(str(src.get("Collective name", ""))) or collective(s.name)
    pg, seq = src.get("Process Group Name"), src.get("Seq", src.get("seq"))
    if pg is not None:
        tags["pg"] = str(pg)
    if type(seq) is int:
        tags["seq"] = seq
    return comm_work(kind, src, m.world_size), kind or s.name


def deps(m: Model) -> None:
    """Launch, stream order and recorded stream-wait edges of every device op."""
    for op in m.ops:
        if op.call >= 0:
            t, pieces = m.tasks[op.task], m.calls[op.call].pieces
            done = [p for p in pieces if m.tasks[p].end <= t.start]
            # a kernel starting before its launch call: the clocks disagree; the thread's last task done by then
            launch = done[-1] if done else m.consistent(pieces[0], t.start,
                                                         "launch (kernel starts before its launch call)")
            if launch is not None:
                t.deps.append(launch)
                m.report.deps["launch"] += 1
    order = [(p, q, "stream order") for ids in m.stream_ops.values() for p, q in zip(ids, ids[1:])]
    for p, q, kind in order + [(p, q, "event wait") for p, q in m.explicit_waits]:
        t = m.tasks[m.ops[q].task]
        if (d := m.consistent(m.ops[p].task, t.start, kind)) is not None:
            t.deps.append(d)
            m.report.deps[kind] += 1
