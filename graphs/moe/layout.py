"""Static row layouts of MegaMoE's dynamic graphs and the per-step plan that fills them.

A dynamic graph (``build_forward(..., dynamic=True)``) is built once per spec: its buffers
have a static capacity and its tiles static row regions; the routing of a step arrives as
small int64 inputs that the tile kernels read to size their rows and pick their expert.

- *pooled* (``ep == 1``): each expert's rows start on a multiple of ``align`` (``tile_m``, or
  ``lcm(tile_m, 32)`` under MXFP8), so tile ``j`` (rows ``[j tm, (j + 1) tm)``) holds rows of one
  expert, chosen at run time; the capacity covers any routing of ``T k`` rows.
- *slotted* (``ep > 1``): local expert ``e`` owns the static slot ``[e C, (e + 1) C)`` of the recv
  layout (``C``: ``W T`` rows, rounded up to ``align``), so comm and tiles of one expert depend
  on that expert only (per-expert interleaving across ranks).

The plan of a step: ``meta [N + E_l, 3]``, one row per tile (expert, live rows, 0) then one per
local expert (first row, rows, end of its padded block); under EP ``comm [2, E_l, W, 5]``: per
direction (dispatch, combine), expert and round ``j`` (peer ``(rank + j) % W``), the source
offset and rows, destination offset and rows (relative to the task's regions) and the most
rows any rank moves in that round (0: every rank skips it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import accumulate

import torch

from megaloom.graphs.moe.spec import Counts, MegaMoESpec, Routing
from megaloom.ops.mxfp8.format import BLOCK
from megaloom.runtime.errors import ConfigError


def align(spec: MegaMoESpec) -> int:
    """Row multiple of every expert block: ``tile_m``, or ``lcm(tile_m, 32)`` under MXFP8."""
    return math.lcm(spec.tile_m, BLOCK) if spec.mxfp8 else spec.tile_m


def capacity(spec: MegaMoESpec, tokens):
    """(slot rows of one local expert (0: pooled), rows of the recv layout) for ``tokens`` per rank
    (an int, or a symbolic size under ``torch.compile``)."""
    a, El = align(spec), spec.experts_local
    if spec.ep == 1:  # sum_e ceil(n_e / a) a <= S + (non-empty experts) (a - 1)
        S = tokens * spec.top_k
        return 0, (S + torch.sym_min(El, S) * (a - 1)) // a * a
    slot = (spec.ep * tokens + a - 1) // a * a
    return slot, El * slot


class Layout:
    """The static capacity of one spec's dynamic graphs on one rank."""

    def __init__(self, spec: MegaMoESpec, rank: int = 0):
        self.spec, self.rank = spec, rank
        self.tm, self.W, self.El = spec.tile_m, spec.ep, spec.experts_local
        self.align, self.pooled = align(spec), self.W == 1
        self.slot, self.rows = capacity(spec, spec.tokens)
        self.tiles = self.rows // self.tm

    def region(self, e: int) -> tuple[int, int]:
        """Rows of the recv layout that local expert ``e``'s rows may occupy."""
        return (0, self.rows) if self.pooled else (e * self.slot, (e + 1) * self.slot)


@dataclass(slots=True)
class Plan:
    """One step's plan (see the module doc); ``start``/``n``: each local expert's first row and rows;
    ``tile``: (expert, rows) per tile."""

    start: list[int]
    n: list[int]
    tile: list[tuple[int, int]]
    comm: list  # [2][E_l][W] of (src off, src rows, dst off, dst rows, most rows)

    def meta(self, layout: Layout) -> torch.Tensor:
        ends = [s + -(-n // layout.align) * layout.align for s, n in zip(self.start, self.n)]
        rows = [(e, n, 0) for e, n in self.tile] + list(zip(self.start, self.n, ends))
        return torch.tensor(rows, dtype=torch.int64).view(-1, 3)


def make_plan(layout: Layout, c: Counts) -> Plan:
    """The plan of counts ``c`` in ``layout``; raises ConfigError when they exceed its capacity."""
    tm, a, W, El = layout.tm, layout.align, layout.W, layout.El
    n = [hi - lo for lo, hi in (c.expert_rows(e) for e in range(El))]
    if layout.pooled:
        start = list(accumulate((-(-k // a) * a for k in n[:-1]), initial=0))
    else:
        start = [e * layout.slot for e in range(El)]
    if not layout.pooled and (sum(map(sum, c.counts)) != W * layout.spec.rows
                              or max(map(max, c.counts)) > layout.spec.tokens):
        raise ConfigError(f"MegaMoE over {W} ranks: every rank needs {layout.spec.tokens} tokens and a token lists "
                          f"an expert at most once (per-rank counts {[sum(row) for row in c.counts]}, most rows "
                          f"of one rank for one expert {max(map(max, c.counts))})")
    tile = [(0, 0)] * layout.tiles
    for e in range(El):
        for j in range(start[e] // tm, -(-(start[e] + n[e]) // tm)):
            tile[j] = (e, min(tm, start[e] + n[e] - j * tm))
    comm = [] if layout.pooled else [[[_round(c, e, j, combine) for j in range(W)] for e in range(El)]
                                     for combine in (False, True)]
    return Plan(start, n, tile, comm)


def _round(c: Counts, e: int, j: int, combine: bool) -> tuple[int, int, int, int, int]:
    """The plan entry of all-to-all round ``j`` of local expert ``e`` (recv-layout rows relative to the
    expert's first row)."""
    rows, (s0, s1), (d0, d1) = c.round(e, j, combine)
    base = c.expert_rows(e)[0]
    return s0 - base * combine, s1 - s0, d0 - base * (not combine), d1 - d0, max(rows)


def step_inputs(layout: Layout, routing: Routing) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """A dynamic graph's routing inputs for ``routing``: the plan (``meta``, and ``comm`` under EP) and
    ``tok`` / ``pos`` in its layout; plus, pooled, the row each send-layout row lands on (to place ``ws``)."""
    plan = make_plan(layout, routing.counts)
    ins = {"meta": plan.meta(layout)}
    if not layout.pooled:
        return {**ins, "comm": torch.tensor(plan.comm, dtype=torch.int64), "tok": routing.tok, "pos": routing.pos}, None
    # each expert's block of send-layout rows, moved to its pooled start (no repeat_interleave: it
    # spreads over torch's thread pool, costly for a thousand rows on a busy machine)
    rows = torch.cat([torch.arange(s, s + n) for s, n in zip(plan.start, plan.n)])
    return {**ins, "tok": place(rows, routing.tok, layout), "pos": rows[routing.pos]}, rows


def place(rows: torch.Tensor | None, x: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Send-layout rows ``x`` in the pooled layout (zeros between experts); as they are under EP."""
    if rows is None:
        return x
    out = x.new_zeros((layout.rows, *x.shape[1:]))
    return out.index_copy_(0, rows, x)
