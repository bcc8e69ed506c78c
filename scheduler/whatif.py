"""What-ifs: a recorded run changed into the run a question asks about, then replayed.

:meth:`WhatIf.apply` rewrites the recording's events: each task's duration (and the untraced
delay before it) scaled, re-costed from other work figures, or zeroed, and tasks added where
the asked-for run has more (the gradient all-reduces of a data-parallel group). Replay then
re-simulates the events, so whatever waits on a changed task moves with it.

Aim: ``speedup`` and ``remove`` patterns match a task's engine kind, class label, op, name,
launching CPU op (``launched_by``), CPU op (``op``) or, for a backward node, the forward ops that
recorded it (``forward``: the outermost one and those nested in it down to the recording op), as
case-blind globs (``attn*``, ``aten::mm``, ``flash``). On a CPU trace a pattern that matches only
ops nested in a task (``aten::dropout`` inside attention's math path) takes their recorded time
out of it, or that time's share of the speed-up. ``scope`` limits them (and ``dims``,
``cuda_graphs``, the expert work of ``ep``) to tasks under matching annotations or modules
(``experts`` means ``*experts*``).
A pattern or scope that matches no task is an error naming what the trace has.

Re-costing: a task whose work changes (``dims``, ``hot_experts``, ``ep``) takes its measured
duration times the cost model's ratio of new to old figures on the recorded device; a comm
task whose bytes change (``comm_bytes``, ``dp``, ``ep``) keeps the profile's alpha and scales
the rest of its measured duration by its bytes on the wire.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from fnmatch import fnmatchcase

from megaloom.runtime.errors import ConfigError
from megaloom.runtime.registry import COMM, CUBE, HOST, Cost
from megaloom.runtime.trace import Trace, TraceEvent
from megaloom.scheduler.cost import CostModel
from megaloom.scheduler.importers import labels, reshaped
from megaloom.scheduler.importers.kineto.classes import collective
from megaloom.scheduler.importers.kineto.work import WIRE, dtype_name, has_formula, itemsize
from megaloom.scheduler.profile import HardwareProfile

KIND_OF = {"speedup": "op_speed", "remove": "op_speed", "fuse": "op_speed", "cuda_graphs": "op_speed", "dims": "shape", "layers": "shape",
           "hot_experts": "moe", "comm_speedup": "comm", "link_bandwidth": "comm", "comm_bytes": "comm",
           "dp": "parallelism", "ep": "parallelism", "host_ranks": "parallelism"}
"""The fidelity kind (benchmarks/whatif_fidelity.py) of each knob: its error bar is printed beside it."""
BUCKET_BYTES, FIRST_BUCKET_BYTES = 25 * 2**20, 2**20
"""DistributedDataParallel's gradient buckets: the first of 1 MiB, the others of 25 MiB."""
_NAME_TAGS = ("class", "launched_by", "op")


def event_width(e: TraceEvent, profile: HardwareProfile, whole_chip: bool) -> float:
    """Units an event spans on ``profile``: its grid's blocks (at most every unit), the whole
    engine for an imported op without a grid, else one unit (a megaloom tile)."""
    n = profile.units.get(e.engine, 1)
    blocks = e.tags.get("blocks")
    if e.engine != COMM and isinstance(blocks, int) and not isinstance(blocks, bool) and blocks > 0:
        return min(blocks, n)
    return n if whole_chip else 1


def recost(model: CostModel, e: TraceEvent, whole_chip: bool, flops: float = 1.0, nbytes: float = 1.0,
           link: tuple[float, float] | None = None, on: CostModel | None = None) -> float:
    """The cost model's ratio of ``e`` with its flops and bytes scaled (on another link, or
    ``on`` another device's model) to ``e`` as recorded; 1 where a profile has no figures."""
    on = on or model
    if not (e.flops or e.bytes or e.comm_bytes):
        return 1.0
    ln = str(e.tags.get("link", "intra"))
    try:
        was = model.duration(Cost(e.flops, e.bytes, e.comm_bytes, e.precision), e.engine, ln, op=e.op,
                             width=event_width(e, model.profile, whole_chip))
        now = on.duration(Cost(e.flops * flops, e.bytes * nbytes, e.comm_bytes, e.precision), e.engine, ln, op=e.op,
                          width=event_width(e, on.profile, whole_chip), link_override=link)
    except ConfigError:  # an engine or link the profile has no figures for (host work)
        return 1.0
    return now / was if was > 0 else 1.0


def _glob(p: str) -> str:
    p = p.lower()
    return p if any(c in p for c in "*?[") else f"*{p}*"


@dataclass(slots=True)
class WhatIf:
    """Changes to replay under (see the module docstring); every default changes nothing.

    ``comm_speedup``: comm tasks that many times faster; ``link_bandwidth`` (B/s): comm tasks
    with recorded message sizes at that bandwidth; ``speedup``: tasks matching a pattern that
    many times faster; ``remove``: tasks matching a pattern gone (with their delays);
    ``fuse``: tasks (on a CPU trace, nested ops too) matching a pattern run as one fused kernel
    that keeps their intermediates on chip: only their GEMM-like work stays (``*attention_math*``:
    attention's math path as a flash kernel); ``cuda_graphs``: host work lasts nothing (the
    graph's launches replace it); ``dims``: tensor dimensions renamed (``{1024: 512}``;
    flattened products follow), tasks re-costed;
    ``layers``: (annotation glob, count) the recorded layers removed or repeated to that count;
    ``hot_experts``: (annotation glob, factor) the first expert gets that many times the mean
    tokens, the others share the rest; ``comm_bytes``: messages that many times larger;
    ``dp`` / ``ep``: the data- / expert-parallel degree (gradient all-reduces re-costed, or
    added to a single-rank CPU trace; all-to-alls and the expert work in ``scope`` re-costed);
    ``host_ranks``: ranks that share one host's cores in the asked-for run (a single-rank trace
    replayed under the profile's ``contention``: see :func:`megaloom.scheduler.replay.replay`).
    """

    comm_speedup: float = 1.0
    link_bandwidth: float | None = None
    speedup: dict[str, float] = field(default_factory=dict)
    scope: tuple[str, ...] = ()
    remove: tuple[str, ...] = ()
    cuda_graphs: bool = False
    dims: dict[int, int] = field(default_factory=dict)
    layers: tuple[str, int] | None = None
    hot_experts: tuple[str, float] | None = None
    comm_bytes: float = 1.0
    dp: int | None = None
    ep: int | None = None
    host_ranks: int | None = None
    fuse: tuple[str, ...] = ()

    def check(self) -> None:
        """Every figure a positive finite number, counts and dimensions whole: before a long import."""
        hot, layers = self.hot_experts and self.hot_experts[1], self.layers and self.layers[1]
        for name, x, whole in [("comm speedup", self.comm_speedup, False), ("link bandwidth", self.link_bandwidth, False),
                               ("comm bytes", self.comm_bytes, False), ("hot experts", hot, False), ("dp", self.dp, True),
                               ("ep", self.ep, True), ("host ranks", self.host_ranks, True), ("layers", layers, True),
                               *((f"speedup of {k!r}", v, False) for k, v in self.speedup.items()),
                               *((f"dimension {k} -> {v}", x, True) for k, v in self.dims.items() for x in (k, v))]:
            if x is not None and (isinstance(x, bool) or not isinstance(x, int if whole else (int, float))
                                  or not math.isfinite(x) or x <= 0):
                raise ConfigError(f"{name} must be a positive {'whole' if whole else 'finite'} number, got {x!r}")

    def empty(self) -> bool:
        return self == WhatIf()

    def kinds(self) -> list[str]:
        """The fidelity kinds of the knobs this what-if sets."""
        return list(dict.fromkeys(KIND_OF[f.name] for f in fields(self) if f.name in KIND_OF
                                  and getattr(self, f.name) != getattr(WhatIf(), f.name)))

    def apply(self, trace: Trace, profile: HardwareProfile, whole_chip: bool) -> Trace:
        """The events of the run this what-if asks about (``profile``: the recorded device)."""
        self.check()
        ev = trace.events
        model = CostModel(profile)
        matched = {p: 0 for p in (*self.speedup, *self.remove, *self.fuse, *self.scope)}
        scoped = [self._in_scope(e, matched) for e in ev]
        layers = _groups(ev, self.layers[0]) if self.layers else {}
        hot = _groups(ev, self.hot_experts[0]) if self.hot_experts else {}
        dims = _closure(self.dims, ev) if self.dims else {}
        world = int(trace.meta.get("world_size") or 1)
        out = []
        for e, inside in zip(ev, scoped):
            f, g = self._factors(e, inside, matched, model, whole_chip, dims, trace.meta.get("source"), world)
            if layers or hot:
                f, g = self._blocks(e, f, g, layers, hot, model, whole_chip)
            tags = e.tags if g == 1.0 else {**e.tags, "delay": float(e.tags.get("delay", 0.0)) * g}
            out.append(replace(e, end=e.start + (e.end - e.start) * f, tags=tags) if (f, g) != (1.0, 1.0) else e)
        missing = [p for p, n in matched.items() if n == 0]
        if missing:
            known = sorted({str(x) for e in ev for x in (e.engine, e.tags.get("class")) if x} | set(labels()))
            raise ConfigError(f"{', '.join(map(repr, missing))} match(es) no task of this trace (not a class, engine, "
                              f"op, task or annotation in it); classes and engines: {', '.join(known)}")
        if self.dp and self.dp > 1 and world == 1 and not any(e.op == "all_reduce" for e in ev):
            out += _gradient_all_reduces(out, model, self.dp)
        if self.ep and self.ep > 1 and self.scope and not any(e.op == "all_to_all" for e in ev):
            out += _all_to_alls(out, scoped, model, self.ep)
        return Trace(out, trace.meta)

    def _in_scope(self, e: TraceEvent, matched: dict) -> bool:
        if not self.scope:
            return True
        anns = [a.lower() for a in e.tags.get("annotations", ())]
        hits = [s for s in self.scope if any(fnmatchcase(a, _glob(s)) for a in anns)]
        for s in hits:
            matched[s] += 1
        return bool(hits)

    def _factors(self, e: TraceEvent, inside: bool, matched: dict, model: CostModel, whole: bool,
                 dims: dict, source: str | None, world: int) -> tuple[float, float]:
        """Factors on the duration and on the delay of one event."""
        f = g = 1.0
        if inside:
            names = [x.lower() for x in (e.engine, e.op, e.task, *(e.tags.get(k) for k in _NAME_TAGS),
                                         *e.tags.get("forward", ())) if isinstance(x, str)]
            rules = [(p.lower(), p, 1.0 / self.speedup[p] if p in self.speedup else 0.0, p in self.fuse)
                     for p in (*self.remove, *self.speedup, *self.fuse)]
            hits = [r for r in rules if any(fnmatchcase(n, r[0]) for n in names)]
            for _, p, keep, fused in hits:
                matched[p] += 1
                if not fused:
                    f, g = f * keep, g * (1.0 if p in self.speedup else keep)
            fused = any(r[3] for r in hits)
            if fused and "nested" not in e.tags and e.engine != CUBE:  # no GEMM: its work stays on chip
                f = g = 0.0
            cut = _cut(e, [] if hits else rules, matched, fused)
            if cut and e.end > e.start:
                f *= max(0.0, 1.0 - cut / (e.end - e.start))
            if self.ep and self.scope and world <= self.ep and collective(e.op) == "all_reduce":
                return 0.0, 0.0  # the experts' gradients stay on their rank: no all-reduce, nor the call issuing it
            if self.cuda_graphs and e.engine == HOST:
                f = g = 0.0
            ratio = reshaped(source, e.tags["sources"], dims) if dims and e.tags.get("sources") else None
            if ratio is not None:
                f *= recost(model, e, whole, *ratio)
        if e.engine == COMM:
            f /= self.comm_speedup
            if self.link_bandwidth is not None and e.comm_bytes > 0:
                f *= recost(model, e, whole, link=(model.profile.link(str(e.tags.get("link", "intra")))[0],
                                                   self.link_bandwidth))
            wire = self.comm_bytes
            n = {"all_reduce": self.dp, "all_to_all": self.ep}.get(e.op)  # the group it re-sizes
            if e.op == "all_reduce" and self.ep and self.scope and inside:  # the experts' data-parallel group
                n = world // self.ep
            if n and world > 1:
                wire *= WIRE[e.op](n) / WIRE[e.op](world)
            if wire != 1.0:
                alpha = model.profile.link(str(e.tags.get("link", "intra")))[0]
                d = e.end - e.start
                f *= (min(d, alpha) + max(d - alpha, 0.0) * wire) / d if d > 0 else 1.0
        return f, g

    def _blocks(self, e: TraceEvent, f: float, g: float, layers: dict, hot: dict, model: CostModel,
                whole: bool) -> tuple[float, float]:
        """Layers removed or repeated; hot experts' work re-costed."""
        for name in e.tags.get("annotations", ()):
            if name in layers:
                keep, n = self.layers[1], len(layers)
                k = (0.0 if layers[name] >= keep else 1.0) if keep <= n else keep / n
                f, g = f * k, g * k
            if name in hot:
                n, hotness = len(hot), self.hot_experts[1]
                w = hotness if hot[name] == 0 else (n - hotness) / (n - 1)
                f *= recost(model, e, whole, max(w, 0.0), max(w, 0.0))
        return f, g


def _cut(e: TraceEvent, rules: list, matched: dict, fused: bool) -> float:
    """Seconds that ``rules`` (glob, pattern, kept share, fuses) aimed at the ops nested in ``e``
    take out of it (CPU traces): the outermost matching op counts; a fused one (or ``e`` itself
    when ``fused``) keeps only the GEMM-like ops nested in it."""
    nested = e.tags.get("nested", ())
    cut, stack = (e.end - e.start, [(-1, True)]) if fused and nested else (0.0, [])
    for name, depth, seconds in nested:
        while stack and stack[-1][0] >= depth:
            stack.pop()
        if stack:
            if stack[-1][1] and has_formula(name):  # a GEMM inside a fused op stays, whatever it nests
                cut -= seconds
                stack.append((depth, False))
        elif rule := next((r for r in rules if fnmatchcase(name.lower(), r[0])), None):
            matched[rule[1]] += 1
            cut += seconds * (1.0 - rule[2])
            stack.append((depth, rule[3]))
    return cut


def _groups(events: list[TraceEvent], glob: str) -> dict[str, int]:
    """Annotations matching ``glob``, numbered in order of first appearance (layers, experts)."""
    out: dict[str, int] = {}
    for e in events:
        for a in e.tags.get("annotations", ()):
            if a not in out and fnmatchcase(a.lower(), _glob(glob)):
                out[a] = len(out)
    if not out:
        raise ConfigError(f"no annotation of this trace matches {glob!r}: record the blocks with "
                          "torch.profiler.record_function (or with_modules=True)")
    return out


def _closure(dims: dict[int, int], events: list[TraceEvent]) -> dict[int, int]:
    """``dims`` and the flattened products they imply: ``{8: 16}`` with tensors ``[8, 64, d]``
    recorded also renames 512 (the 8 x 64 rows a GEMM sees) to 1024."""
    out = dict(dims)
    for e in events:
        for _, shapes, _, _ in e.tags.get("sources", ()):
            for d in shapes if isinstance(shapes, list) else ():
                if isinstance(d, list) and len(d) >= 3 and all(type(x) is int for x in d) and any(x in dims for x in d):
                    for j in range(2, len(d)):
                        out.setdefault(math.prod(d[:j]), math.prod(dims.get(x, x) for x in d[:j]))
    return out


def _threads(events: list[TraceEvent], key=lambda e: (e.rank, e.engine, e.unit)) -> list[list[int]]:
    """Indices of the events of each thread (``key`` and its ``thread`` tag), in start order."""
    threads: dict[tuple, list[int]] = {}
    for i, e in enumerate(events):
        threads.setdefault((*key(e), e.tags.get("thread")), []).append(i)
    return [sorted(ids, key=lambda i: events[i].start) for ids in threads.values()]


def _all_to_alls(events: list[TraceEvent], scoped: list[bool], model: CostModel, n: int) -> list[TraceEvent]:
    """The all-to-alls an expert-parallel group of ``n`` adds to a trace with none: on each host
    thread, one before and one after each run of its tasks in scope (the experts' forward, then
    their backward: gradient accumulation does not end a run), each sending the tokens (the
    first input of the first forward GEMM in scope) to the ranks of their experts; the run's
    first task and the task after it wait for them. Matched across ranks by their order."""
    gemm = next((e.tags["sources"][0] for e, inside in zip(events, scoped) if inside and e.tags.get("sources")
                 and e.tags["class"] == "cpu_gemm" and not e.op.startswith("autograd::")), [0, None, None])
    if not (gemm[1] and gemm[2]):
        raise ConfigError("no GEMM with shapes in the experts' scope: profile with record_shapes=True to add all-to-alls")
    wire = math.prod(gemm[1][0]) * itemsize(dtype_name(gemm[2][0]) or "float") * WIRE["all_to_all"](n)
    unit, ids, out = 1 + max((e.unit for e in events if e.engine == COMM), default=-1), {}, []
    for e in events:
        ids[e.rank] = max(ids.get(e.rank, 0), e.task_id + 1)
    seq = dict.fromkeys(ids, 0)
    for thread in _threads(events, key=lambda e: (e.rank,)):  # a host thread's ops, whatever their engine
        run: list[int] = []
        for i in [*thread, None]:
            if i is not None and (run and "grad_bytes" in events[i].tags or scoped[i] and events[i].engine != COMM
                                  and not collective(events[i].op)):
                run.append(i)
                continue
            if not run:
                continue
            first, last, r = events[run[0]], events[run[-1]], events[run[0]].rank
            for start, deps, waits in [(first.start, first.deps, run[0]), (last.end, [last.task_id], i)]:
                ids[r], seq[r] = ids[r] + 1, seq[r] + 1  # the tokens out to the experts' ranks, or back
                out.append(TraceEvent(ids[r] - 1, f"expert all_to_all #{seq[r]}", "all_to_all", COMM, unit, r, start,
                                      start + model.duration(Cost(0.0, 0.0, wire), COMM, "intra"), 0.0, 0.0, wire,
                                      list(deps), {"class": "added", "link": "intra", "pg": "experts", "seq": seq[r]}))
                if waits is not None:
                    events[waits] = replace(events[waits], deps=[*events[waits].deps, ids[r] - 1])
            run = []
    return out


def _gradient_all_reduces(events: list[TraceEvent], model: CostModel, n: int) -> list[TraceEvent]:
    """The all-reduces a data-parallel group of ``n`` adds to one rank's steps: in each backward
    pass (a run of autograd-engine tasks on a thread), the gradients in buckets as they are
    accumulated, each bucket's all-reduce on a comm thread after its last gradient; the
    thread's first task after the pass waits for them all."""
    if not any(e.tags.get("grad_bytes") for e in events):
        raise ConfigError("the trace records no gradient accumulation (torch::autograd::AccumulateGrad with shapes): "
                          "profile with record_shapes=True to add data-parallel all-reduces")
    out: list[TraceEvent] = []
    next_id = max(e.task_id for e in events) + 1
    unit = 1 + max((e.unit for e in events if e.engine == COMM), default=-1)
    for ids in _threads(events):
        size, cap, prev, mine, last = 0.0, FIRST_BUCKET_BYTES, None, [], None
        for i in [*ids, None]:  # None: the thread's end closes its last pass
            e = events[i] if i is not None else None
            backward = e is not None and e.op.startswith("autograd::engine::")
            if backward:
                size, last = size + float(e.tags.get("grad_bytes", 0.0)), e
                if size < cap:
                    continue
            if size:  # a full bucket, or the last one of the pass
                wire = size * WIRE["all_reduce"](n)
                start = max(last.end, prev.end if prev else 0.0)
                prev = TraceEvent(next_id + len(out), f"gradient all_reduce #{len(out)}", "all_reduce", COMM, unit,
                                  last.rank, start, start + model.duration(Cost(0.0, 0.0, wire), COMM, "intra"),
                                  0.0, 0.0, wire, [last.task_id, *([prev.task_id] if prev else [])],
                                  {"class": "added", "link": "intra"})
                out.append(prev)
                mine.append(prev.task_id)
                size, cap = 0.0, BUCKET_BYTES
            if not backward and mine and e is not None:  # the pass is over: this task waits (a copy)
                events[i] = replace(e, deps=[*e.deps, *mine])
            if not backward:
                mine, cap = [], FIRST_BUCKET_BYTES
    return out
