"""Import PyTorch profiler (Kineto) traces as replayable megaloom traces.

``import_torch_profiler(path)`` reads one file (``.json`` or ``.json.gz``, as
``tensorboard_trace_handler`` writes them) and returns a :class:`~megaloom.runtime.trace.Trace`
plus an :class:`ImportReport` that accounts for every event. ``import_ranks(paths)`` reads
one file per rank into one trace whose collectives replay together. The dependency model is
in :mod:`.host`, :mod:`.device` and :mod:`.waits` (shared records in :mod:`.model`) and
docs/replay.md; classes in :mod:`.classes`; work figures in :mod:`.work`. The format registers
itself with :mod:`megaloom.scheduler.importers`.

Events carry, in their tags: ``delay`` (seconds of untraced time between the moment their
dependencies were met and their recorded start, which replay keeps), ``cpu`` (the part of a
host call's delay spent inside CPU ops), ``class`` (the class table's label), ``stream`` or
``thread``, ``annotations`` (the annotations over them), ``inferred`` (the dependencies
inferred from timing), ``sync`` (what a call's waiting piece waited for), ``sources`` (the ops
and shapes their work figures come from), ``grad_bytes`` (a gradient accumulated), ``peer`` and
``tag`` (send / recv) and, for device ops, ``blocks`` (their grid) when the trace records it.
The trace's ``meta['t0_us']`` is its time origin on the file's clock.
"""
from __future__ import annotations

import os
import statistics
from pathlib import Path
from typing import Any, Iterable

from megaloom.runtime.errors import TraceFormatError
from megaloom.runtime.registry import COMM
from megaloom.runtime.trace import Trace, TraceEvent
from megaloom.scheduler.importers import Format, register
from megaloom.scheduler.importers.kineto import device, host, waits
from megaloom.scheduler.importers.kineto.classes import DEVICE_CATEGORIES, labels
from megaloom.scheduler.importers.kineto.model import Model, Task
from megaloom.scheduler.importers.kineto.read import RawTrace, read
from megaloom.scheduler.importers.kineto.work import Work, reshape
from megaloom.scheduler.importers.kineto.report import ImportReport
from megaloom.scheduler.profile import match_device
from megaloom.scheduler.simulator import gc_paused
from megaloom.scheduler.world import COLLECTIVE_OPS, heap_order

__all__ = ["ImportReport", "import_ranks", "import_torch_profiler"]

SOURCE = "torch.profiler"
_NO_WORK = Work()


def _int(v: Any) -> int | None:
    return v if type(v) is int and v >= 0 else None


def _device(raw: RawTrace, tasks: list[Task], report: ImportReport) -> str | None:
    """The profile of the device the trace's kernels ran on, from ``deviceProperties``."""
    props = raw.header.get("deviceProperties")
    props = [p for p in props if isinstance(p, dict)] if isinstance(props, list) else []
    dev = statistics.mode([t.track[0] for t in tasks if "stream" in t.tags] or [None])  # the device of most kernels
    entry = next((p for p in props if p.get("id") == dev), props[0] if props else None)
    prof = match_device(entry) if entry else None  # an empty entry names no device either
    if entry:
        report.device = f"{entry.get('name', '?')} -> {prof.name if prof else 'no profile'}"
    if prof is None:
        why = f"device {entry.get('name', '?')!r} matches no profile" if entry else "the trace has no deviceProperties"
        report.notes.append(f"{why}: pass --recorded-profile for cross-device what-ifs")
    return prof.name if prof else None


def _events(tasks: list[Task], t0: float, rank: int, report: ImportReport,
            inferred: dict[int, list[int]]) -> tuple[list[TraceEvent], dict[str, int]]:
    """The tasks as trace events in a topological order (ids renumbered), each on a unit of its
    engine per track, named uniquely, with its delay (seconds) after its dependencies were met.
    The order is by start time, each task after its dependencies (ties: zero-length producers first)."""
    order = heap_order([set(t.deps) for t in tasks], lambda i: (tasks[i].start, tasks[i].end))
    if len(order) != len(tasks):  # cannot happen: every edge points from an earlier end to a later start
        raise TraceFormatError("imported dependencies form a cycle")
    new = {i: k for k, i in enumerate(order)}
    for consumer, producers in inferred.items():
        tasks[consumer].tags["inferred"] = sorted({new[p] for p in producers})
    unit_of: dict[str, dict[tuple, int]] = {}  # engine -> a unit per track, numbered in order of appearance
    names: dict[str, int] = {}
    events = []
    for i in order:
        t = tasks[i]
        tracks = unit_of.setdefault(t.engine, {})
        unit = tracks.setdefault(t.track, len(tracks))
        n = names[t.name] = names.get(t.name, -1) + 1
        if t.start > (ready := max((tasks[d].end for d in t.deps), default=t0)):
            t.tags["delay"] = (t.start - ready) * 1e-6  # each task owns its tags
            report.delay_s += t.tags["delay"]
        w = t.work or _NO_WORK
        events.append(TraceEvent(new[i], f"{t.name}#{n}" if n else t.name, t.op, t.engine, unit, rank,
                                 (t.start - t0) * 1e-6, (t.end - t0) * 1e-6, w.flops, w.bytes, w.comm_bytes,
                                 sorted({new[d] for d in t.deps}), t.tags, w.precision))
        report.engines[t.engine] += 1
    report.tasks = len(events)
    return events, {e: len(tracks) for e, tracks in unit_of.items()}


def import_torch_profiler(path: str | os.PathLike) -> tuple[Trace, ImportReport]:
    """A replayable megaloom trace of a ``torch.profiler`` / Kineto trace file, and its report;
    its time origin is the file's first event."""
    with gc_paused():  # millions of parsed objects: collections would dominate the import
        return _import(read(path))


def _build(raw: RawTrace, report: ImportReport, world: int | None) -> Model:
    """The tasks and edges of one trace: the passes of :mod:`.model`, in order."""
    m = Model(raw, report, world)
    tracks: dict[tuple, list] = {}  # each track's slices in start order, enclosing ones first
    for s in sorted(raw.slices, key=lambda s: (s.start, -s.end, s.seq)):
        on_device = m.has_device and (s.cat in DEVICE_CATEGORIES or s.cat == "gpu_user_annotation")
        tracks.setdefault((on_device, s.pid, s.tid), []).append(s)
    for (on_device, *track), items in tracks.items():
        (device.sweep if on_device else host.sweep)(m, tuple(track), items)
    for step in (device.link_launches, waits.syncs, device.tasks, host.tasks, device.deps, Model.flows, waits.explain):
        step(m)
    return m


def _import(raw: RawTrace, t0: float | None = None) -> tuple[Trace, ImportReport]:
    """One file's trace and report; ``t0`` (microseconds on the file's clock): the time origin,
    default the file's first event (:func:`import_ranks` passes the earliest of all ranks)."""
    path = raw.path
    info = raw.header.get("distributedInfo") if isinstance(raw.header.get("distributedInfo"), dict) else {}
    rank = _int(info.get("rank")) or 0
    world = _int(info.get("world_size"))
    report = ImportReport(path=os.fspath(path), rank=rank, world_size=world or 1, skipped=raw.skipped)
    if isinstance(raw.header.get("otherData"), dict) and {"graph", "mode"} <= raw.header["otherData"].keys():
        raise TraceFormatError(f"{path}: megaloom's own Perfetto export (no dependencies between its tasks) cannot be "
                               "replayed: replay the megaloom trace it was written from (the .mlt or .trace file)")
    model = _build(raw, report, world)
    profile = _device(raw, model.tasks, report) if model.has_device else None
    origin = model.t0 if t0 is None else t0
    events, units = _events(model.tasks, origin, rank, report, model.inferred)
    meta = {"graph": os.path.basename(os.fspath(path)), "mode": "import", "source": SOURCE, "clock": "wall",
            "units": units, "world_size": world or 1, "rank": rank, "t0_us": origin,
            **({"profile": profile} if profile else {}), **({} if model.has_device else {"cpu_only": True})}
    return Trace(events, meta), report


def _align_clocks(traces: list[Trace], reports: list[ImportReport]) -> dict[str, float]:
    """Shift each rank's clock so its collectives end when the lowest rank's do (the median
    difference over the collectives they share: matched by process group and sequence number,
    else by order). A collective ends together on every rank; ranks on other hosts have other
    clocks. Returns the shift per rank in microseconds."""
    def ends(t: Trace) -> dict[tuple, float]:
        out, n = {}, 0
        for e in sorted(t.events, key=lambda e: e.task_id):
            if e.engine == COMM and e.op in COLLECTIVE_OPS:
                key = (e.tags["pg"], e.tags["seq"]) if "pg" in e.tags and "seq" in e.tags else ("", n)
                n += key[0] == ""
                out[key] = e.end
        return out

    order = sorted(range(len(traces)), key=lambda i: traces[i].meta["rank"])
    ref = ends(traces[order[0]])
    offsets: dict[str, float] = {}
    for i in order[1:]:
        mine = ends(traces[i])
        diffs = [mine[k] - ref[k] for k in mine.keys() & ref.keys()]
        if diffs and (off := statistics.median(diffs)):
            for e in traces[i].events:
                e.start, e.end = e.start - off, e.end - off
            offsets[str(traces[i].meta["rank"])] = off * 1e6
            reports[i].notes.append(f"clock shifted by {-off * 1e6:.3f} us so its {len(diffs)} collectives end with "
                                    f"rank {traces[order[0]].meta['rank']}'s (median difference)")
    return offsets


def import_ranks(paths: Iterable[str | os.PathLike]) -> tuple[Trace, list[ImportReport]]:
    """One trace of several ranks' files: ranks from ``distributedInfo`` (else file order), one
    time origin for all, clocks aligned on collective ends (:func:`_align_clocks`) unless every
    file names one ``host_name`` (one clock: ranks keep their skew), collectives tagged for
    matching (process group and sequence number where recorded)."""
    if not (paths := list(paths)):
        raise TraceFormatError("no trace files given")
    with gc_paused():
        raws = [read(p) for p in paths]
        t0 = min((s.start for r in raws for s in r.slices), default=0.0)
        traces, reports = (list(x) for x in zip(*(_import(raw, t0) for raw in raws)))
    if len({t.meta["rank"] for t in traces}) != len(traces):  # several files claim one rank: number them in file order
        for i, (t, rep) in enumerate(zip(traces, reports)):
            rep.notes.append(f"rank {t.meta['rank']} given by several files: numbered {i} by file order")
            for e in t.events:
                e.rank = i
            t.meta["rank"], rep.rank = i, i
    hosts = {r.header.get("host_name") for r in raws}
    one_host = len(hosts) == 1 and isinstance(hosts.pop(), str)  # one clock: nothing to align
    offsets = {} if one_host else _align_clocks(traces, reports)
    events = [e for t in traces for e in t.events]
    shift = min((e.start for e in events), default=0.0)
    for e in events:  # one origin again: the earliest event of any rank, aligned
        e.start, e.end = e.start - shift, e.end - shift
        if not e.deps:
            e.tags.pop("delay", None)
            if e.start > 0:
                e.tags["delay"] = e.start
    kinds = dict.fromkeys(k for t in traces for k in t.meta["units"])
    units = {k: max(t.meta["units"].get(k, 0) for t in traces) for k in kinds}
    profiles = {t.meta.get("profile") for t in traces}
    meta = {"graph": ",".join(os.path.basename(os.fspath(p)) for p in paths), "mode": "import", "source": SOURCE,
            "clock": "wall", "units": units, "world_size": len(traces), "graphs": [t.meta["graph"] for t in traces],
            "t0_us": t0 + shift * 1e6, "clock_offsets_us": offsets}
    if len(profiles) == 1 and None not in profiles:
        meta["profile"] = profiles.pop()
    return Trace(events, meta), reports


def _load(paths: list[Path]) -> tuple[Trace, list[ImportReport]]:
    if len(paths) == 1:
        trace, report = import_torch_profiler(paths[0])
        return trace, [report]
    return import_ranks(paths)


register(Format(SOURCE, lambda head: head[:2] == b"\x1f\x8b" or head.lstrip()[:1] in (b"{", b"["), _load,
                tuple(labels()), reshape))
