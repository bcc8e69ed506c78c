"""Kernels for fused programs: the tiled in-cache backend, options, and the signature cache.

The tiled backend runs a program over tiles of its domain sized so that a tile of every
value it keeps live fits in one core's L2 cache. Tiles are spread over worker threads
(contiguous runs of tiles per worker) that run torch single-threaded, and a tile stays
below torch's parallel grain (32768 elements), so each torch call on a tile runs serially
on its worker, with no OpenMP fork/join per call per tile (which stalls badly on a
shared machine). Per tile, external inputs and outputs
are views of the caller's tensors; intermediates go to small scratch tiles, reused as
soon as a value dies (in place when possible), written with torch's ``out=`` calls.
Only the external inputs and outputs touch main memory. Values that do not vary along
the tiled dims (a row vector when tiling rows) are computed once before the tile loop.

Compiling is register allocation over a straight-line program, done once per
structural signature and cached (:func:`compile_program`); a kernel works for any sizes
that match its signature's broadcast pattern.
"""
from __future__ import annotations

import os
import re
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Sequence

import torch

from megaloom.ops import native
from megaloom.ops.dvm.native import native_kernel
from megaloom.ops.dvm.primitives import bind, broadcast
from megaloom.ops.dvm.program import Program, pattern
from megaloom.runtime.dtypes import itemsize, torch_dtype
from megaloom.runtime.errors import ConfigError, ExecutionError

BACKENDS = ("native", "tiled", "inductor")
_DEFAULT_L2 = 1 << 20
GRAIN = 32768  # at::internal::GRAIN_SIZE: torch runs ops on fewer elements than this serially


@dataclass(frozen=True, slots=True)
class Options:
    """Backend settings. ``l2_bytes``/``tile_bytes`` ``None``: derived from the detected L2.

    ``tile_bytes`` sets one value's tile (the native backend: one register block of float32);
    ``threads`` workers share the tiles, each with its own scratch (``None``: torch's
    intra-op thread count); ``backend`` is ``"native"`` (the compiled kernels, falling back
    to ``"tiled"`` for programs or builds they do not cover), ``"tiled"`` (torch calls per
    tile) or ``"inductor"``.
    """

    backend: str = "native"
    l2_bytes: int | None = None
    tile_bytes: int | None = None
    threads: int | None = None


_options = Options()


def options() -> Options:
    """The current process-wide options."""
    return _options


def configure(**changes: Any) -> Options:
    """Change process-wide options (unknown names or bad values raise ConfigError)."""
    global _options
    known = {f.name for f in fields(Options)}
    bad = sorted(set(changes) - known)
    if bad:
        raise ConfigError(f"unknown DVM option(s) {', '.join(bad)}; known: {', '.join(sorted(known))}")
    new = replace(_options, **changes)
    check_options(new)
    _options = new
    return new


def check_options(o: Options) -> None:
    if o.backend not in BACKENDS:
        raise ConfigError(f"DVM backend must be one of {BACKENDS}, got {o.backend!r}")
    for name in ("l2_bytes", "tile_bytes"):
        v = getattr(o, name)
        if v is not None and (not isinstance(v, int) or v <= 0):
            raise ConfigError(f"DVM option {name} must be a positive int, got {v!r}")
    if o.threads is not None and (not isinstance(o.threads, int) or o.threads < 1):
        raise ConfigError(f"DVM option threads must be an int >= 1, got {o.threads!r}")


_SIZE = re.compile(r"^\s*([0-9.]+)\s*([KMG]?)(i?B)?\s*$", re.I)
_l2_cache: int | None = None


def _parse_size(text: str) -> int | None:
    m = _SIZE.match(text)
    if not m:
        return None
    return int(float(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2).upper()])


def l2_cache_bytes() -> int:
    """Per-core L2 size: sysfs, else ``lscpu``, else 1 MiB (detected once)."""
    global _l2_cache
    if _l2_cache is None:
        _l2_cache = _detect_l2() or _DEFAULT_L2
    return _l2_cache


def _detect_l2() -> int | None:
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for idx in sorted(os.listdir(base)):
            d = os.path.join(base, idx)
            with open(os.path.join(d, "level")) as f:
                level = f.read().strip()
            with open(os.path.join(d, "type")) as f:
                kind = f.read().strip()
            if level == "2" and kind in ("Unified", "Data"):
                with open(os.path.join(d, "size")) as f:
                    return _parse_size(f.read())
    except OSError:
        pass
    try:
        out = subprocess.run(["lscpu", "-C=NAME,ONE-SIZE"], capture_output=True, text=True, timeout=2).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == "L2":
            return _parse_size(parts[1])
    return None


# -- compiled plan ---------------------------------------------------------------------

@dataclass(slots=True)
class _Plan:
    """Register allocation of one program for one set of tiled dims."""

    pre: list[tuple[Callable, int, tuple[int, ...]]]  # invariant steps (once per call)
    steps: list[tuple[Callable, int, tuple[int, ...]]]  # per-tile steps: (step, slot, arg slots)
    tiled_in: list[tuple[int, int, tuple[int | None, ...]]]  # (input index, slot, value dim per tiled dim)
    tiled_out: list[tuple[int, int, tuple[int | None, ...]]]  # (output index, slot, dims)
    inv_in: list[tuple[int, int]]  # (input index, slot): inputs used whole
    inv_out: dict[int, int]  # slot -> output index, for invariant outputs
    regs: list[tuple[str, str]]  # register slot order: (dtype, pattern)
    reg_slot0: int
    n_slots: int
    bytes_per_elem: int  # live tile bytes per domain element (sizing)


class TiledKernel:
    """A compiled fused program: ``kernel(inputs, outputs)`` writes the outputs in place."""

    backend = "tiled"

    def __init__(self, program: Program, opts: Options):
        self.program = program
        self.opts = opts
        n_in = len(program.inputs)
        self._rank = len(program.domain)
        self._patterns = [pattern(s, program.domain) for s, _ in program.specs]
        self._dtypes = [d for _, d in program.specs]
        self._steps = [bind(i.op, i.attr_dict, program.specs[n_in + k][1]) for k, i in enumerate(program.code)]
        self._plans: dict[tuple[int, ...], _Plan] = {}
        self._local = threading.local()
        self._plan((0,) if self._rank else ())  # the usual plan, so compiling pays for it

    # compile: register allocation for the dims that get tiled
    def _plan(self, tiled: tuple[int, ...]) -> _Plan:
        plan = self._plans.get(tiled)
        if plan is None:
            plan = self._plans[tiled] = self._allocate(tiled)
        return plan

    def _allocate(self, tiled: tuple[int, ...]) -> _Plan:
        prog, pats = self.program, self._patterns
        n_in, n_val = len(prog.inputs), prog.n_values
        varies = [any(pats[v][d] == "f" for d in tiled) for v in range(n_val)]
        out_of = {v: j for j, v in enumerate(prog.outputs)}
        last_use = [-1] * n_val
        for k, ins in enumerate(prog.code):
            for a in ins.args:
                last_use[a] = k
        slot = [-1] * n_val
        n_slots = 0

        def new_slot() -> int:
            nonlocal n_slots
            n_slots += 1
            return n_slots - 1

        def dims(v: int) -> tuple[int | None, ...]:
            lead = self._rank - len(prog.specs[v][0])
            return tuple(d - lead if pats[v][d] == "f" else None for d in tiled)

        tiled_in, inv_in, tiled_out, inv_out = [], [], [], {}
        for v in range(n_in):
            if last_use[v] >= 0:
                slot[v] = new_slot()
                (tiled_in.append((v, slot[v], dims(v))) if varies[v] else inv_in.append((v, slot[v])))
        pre, steps = [], []
        free: dict[tuple[str, str], list[int]] = {}
        pending_regs: list[tuple[int, tuple[str, str]]] = []
        for k, ins in enumerate(prog.code):
            v = n_in + k
            args = tuple(slot[a] for a in ins.args)
            if not varies[v]:
                slot[v] = new_slot()
                pre.append((self._steps[k], slot[v], args))
                if v in out_of:
                    inv_out[slot[v]] = out_of[v]
                continue
            for a in set(ins.args):  # values dying here free their registers (in-place reuse)
                if last_use[a] == k and a >= n_in and varies[a] and a not in out_of:
                    key = (self._dtypes[a], pats[a])
                    free.setdefault(key, []).append(slot[a])
            if v in out_of:
                slot[v] = new_slot()
                tiled_out.append((out_of[v], slot[v], dims(v)))
            else:
                key = (self._dtypes[v], pats[v])
                pool = free.get(key)
                if pool:
                    slot[v] = pool.pop()
                else:
                    slot[v] = -1 - len(pending_regs)  # fixed up below, after other slots
                    pending_regs.append((v, key))
            steps.append((k, slot[v], args))
        # registers take the last slots so per-tile views are one contiguous range
        regs_base = n_slots
        remap = {-1 - i: regs_base + i for i in range(len(pending_regs))}
        reg_keys = [key for _, key in pending_regs]
        fix = lambda s: remap.get(s, s)  # noqa: E731
        steps = [(self._steps[k], fix(s), tuple(fix(a) for a in args)) for k, s, args in steps]
        n_slots += len(pending_regs)
        live = [self._dtypes[v] for v, _, _ in tiled_in] + [self._dtypes[prog.outputs[j]] for j, _, _ in tiled_out]
        bpe = sum(itemsize(d) for d in live) + sum(itemsize(d) for d, _ in reg_keys)
        return _Plan(pre, steps, tiled_in, tiled_out, inv_in, inv_out, reg_keys, regs_base, n_slots, max(bpe, 1))

    # run
    def __call__(self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> None:
        dom = broadcast([x.shape for x in inputs], "fused kernel inputs")
        if len(dom) != self._rank:
            raise ExecutionError(f"fused kernel for domain rank {self._rank} got inputs of shapes "
                                 f"{[tuple(x.shape) for x in inputs]}")
        if 0 in dom:  # empty domain, yet a broadcast value (and output) may be non-empty: no tiling
            for o, r in zip(outputs, self.program.run_reference(inputs)):
                o.copy_(r)
            return
        tiled = self._tiling(dom)
        plan = self._plan(tiled)
        tile_elems = self._tile_elems(plan)
        blocks = _blocks(dom, tiled, tile_elems)
        slots: list[Any] = [None] * plan.n_slots
        for v, s in plan.inv_in:
            slots[s] = inputs[v]
        for step, s, args in plan.pre:
            j = plan.inv_out.get(s)
            slots[s] = step(outputs[j] if j is not None else None, *(slots[a] for a in args))
        if not plan.steps:
            return
        tiles = _tiles(dom, tiled, blocks)
        if len(tiles) == 1:
            self._run_tiles(plan, dom, tiled, blocks, tiles, slots, inputs, outputs)
            return
        threads = min(self.opts.threads or torch.get_num_threads(), len(tiles))
        per = -(-len(tiles) // threads)
        pool = _pool(threads)
        futs = [pool.submit(self._run_tiles, plan, dom, tiled, blocks, tiles[i:i + per], list(slots), inputs, outputs)
                for i in range(0, len(tiles), per)]
        for f in futs:
            f.result()

    def _tiling(self, dom: tuple[int, ...]) -> tuple[int, ...]:
        """Tile rows (dim 0); also dim 1 when one row alone exceeds the tile budget."""
        if self._rank <= 1:
            return (0,) * self._rank
        row = 1
        for d in dom[1:]:
            row *= d
        return (0,) if row <= self._tile_elems(self._plan((0,))) else (0, 1)

    def _tile_elems(self, plan: _Plan) -> int:
        o = self.opts
        if o.tile_bytes is not None:
            return max(1, o.tile_bytes // max(itemsize(d) for d in self._dtypes))
        l2 = o.l2_bytes or l2_cache_bytes()
        return max(1024, min(GRAIN - 1, l2 // plan.bytes_per_elem))

    def _scratch(self, plan: _Plan, dom: tuple[int, ...], tiled: tuple[int, ...], blocks: tuple[int, ...],
                 device: torch.device) -> list[torch.Tensor]:
        key = (id(plan), dom, blocks, device)
        cache = getattr(self._local, "scratch", None)
        if cache is None or cache[0] != key:
            regs = []
            for dt, pat in plan.regs:
                shape = [1 if c == "b" else d for c, d in zip(pat, dom) if c != "-"]
                lead = pat.count("-")
                for t, b in zip(tiled, blocks):
                    if pat[t] == "f":
                        shape[t - lead] = b
                regs.append(torch.empty(shape, dtype=torch_dtype(dt), device=device))
            cache = self._local.scratch = (key, regs)
        return cache[1]

    def _run_tiles(self, plan: _Plan, dom, tiled, blocks, tiles, slots, inputs, outputs) -> None:
        regs = self._scratch(plan, dom, tiled, blocks, outputs[0].device)
        base = plan.reg_slot0
        reg_pats = [(pat.count("-"), [t for t in tiled if pat[t] == "f"]) for _, pat in plan.regs]
        full = tuple(blocks)
        steps, tin, tout = plan.steps, plan.tiled_in, plan.tiled_out
        for box in tiles:
            ext = tuple(b - a for a, b in box)
            if ext == full:
                slots[base:base + len(regs)] = regs
            else:
                for i, (r, (lead, ts)) in enumerate(zip(regs, reg_pats)):
                    for t in ts:
                        r = r.narrow(t - lead, 0, ext[tiled.index(t)])
                    slots[base + i] = r
            for v, s, vd in tin:
                slots[s] = _view(inputs[v], vd, box)
            for j, s, vd in tout:
                slots[s] = _view(outputs[j], vd, box)
            for step, s, args in steps:
                slots[s] = step(slots[s], *[slots[a] for a in args])


def _view(x: torch.Tensor, vdims: tuple[int | None, ...], box) -> torch.Tensor:
    for d, (a, b) in zip(vdims, box):
        if d is not None:
            x = x.narrow(d, a, b - a)
    return x


def _blocks(dom: tuple[int, ...], tiled: tuple[int, ...], tile_elems: int) -> tuple[int, ...]:
    if not tiled:
        return ()
    if len(tiled) == 1:
        row = 1
        for d in dom[1:]:
            row *= d
        return (max(1, min(dom[0], tile_elems // max(row, 1))),)
    inner = 1
    for d in dom[2:]:
        inner *= d
    return 1, max(1, min(dom[1], tile_elems // max(inner, 1)))


def _tiles(dom: tuple[int, ...], tiled: tuple[int, ...], blocks: tuple[int, ...]) -> list[tuple[tuple[int, int], ...]]:
    if not tiled:
        return [()]
    ranges = [[(a, min(a + b, dom[t])) for a in range(0, dom[t], b)] for t, b in zip(tiled, blocks)]
    if len(ranges) == 1:
        return [(r,) for r in ranges[0]]
    return [(r0, r1) for r0 in ranges[0] for r1 in ranges[1]]


_pools: dict[int, ThreadPoolExecutor] = {}
_pool_lock = threading.Lock()


def _pool(n: int) -> ThreadPoolExecutor:
    """``n`` tile workers whose torch calls never fork OpenMP/MKL teams of their own.

    Some element-wise ops (exp, tanh, ... through MKL VML) parallelise from 2048 elements,
    far below a tile, and a fork/join per call per tile stalls on a busy machine. Each
    worker sets torch's intra-op threads to 1 for itself; ``torch.set_num_threads`` also
    stores the count new threads start with, so the caller's count is put back once every
    worker has started.
    """
    with _pool_lock:
        p = _pools.get(n)
        if p is None:
            saved = torch.get_num_threads()
            started = threading.Barrier(n + 1)
            p = ThreadPoolExecutor(n, thread_name_prefix="dvm-tiles", initializer=torch.set_num_threads, initargs=(1,))
            for _ in range(n):  # blocked workers are never idle, so each submit starts a new one
                p.submit(started.wait, 10.0)
            started.wait(10.0)
            torch.set_num_threads(saved)
            _pools[n] = p
        return p


# -- cache -----------------------------------------------------------------------------

_cache: dict[tuple, Any] = {}
_cache_lock = threading.Lock()


_epoch = 0


def compile_program(program: Program, opts: Options | None = None) -> Callable[[Sequence[torch.Tensor], Sequence[torch.Tensor]], None]:
    """The kernel for ``program`` under ``opts`` (default: :func:`options`), cached by signature."""
    opts = opts or _options
    key = (program.signature, opts, native.enabled())
    k = _cache.get(key)
    if k is not None:
        return k
    if opts.backend == "inductor":
        from megaloom.ops.dvm.inductor import InductorKernel

        k = InductorKernel(program)
    else:
        k = (native_kernel(program, opts) if opts.backend == "native" else None) or TiledKernel(program, opts)
    with _cache_lock:
        return _cache.setdefault(key, k)


def clear_cache() -> None:
    """Forget every compiled kernel (kernels cached elsewhere by :func:`cache_epoch` too)."""
    global _epoch
    with _cache_lock:
        _cache.clear()
        _epoch += 1


def cache_epoch() -> int:
    """Bumped by every :func:`clear_cache`: a key part for caches of compiled kernels."""
    return _epoch


def cache_size() -> int:
    return len(_cache)
