"""MegaMoE spec and routing metadata (computed on the host, as real trainers do).

Row layouts (``W`` EP ranks, ``E_l`` experts per rank, global expert ``g = p * E_l + e``
lives on rank ``p`` as local expert ``e``):

- *send* layout, on the source rank: its ``T * k`` routed rows sorted by global expert
  (stable), so the rows for (destination ``p``, local expert ``e``) are one block;
- *recv* layout, on the owner rank: blocks ``[local expert e][source rank s]``, so each
  local expert's rows ``X_e`` are contiguous. At ``W == 1`` both layouts coincide.

Counts-built graphs depend on the per-expert counts only (``counts[s][g]``: rows source rank
``s`` routes to global expert ``g``); token indices travel as int64 input buffers, so one such
graph serves every routing with those counts. Buffers are sized from the actual counts: any
imbalance is handled, an expert may get 0 rows, nothing is dropped. The module runs dynamic
graphs instead (:mod:`.layout`), which take the counts as run-time data too.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from itertools import accumulate
from typing import Sequence

import torch

from megaloom.graphs.common.spec import GraphSpec, bools, dtype_problems, positive, report
from megaloom.ops.mxfp8.format import SCALE_MODES
from megaloom.runtime.errors import ConfigError

SCHEDULES = ("sequential", "interleaved")
PRECISIONS = ("none", "mxfp8")  # the expert GEMMs: in the spec's dtype, or MXFP8 (E4M3 + E8M0 block scales)
ROUTINGS = ("balanced", "random", "skewed")


@dataclass(frozen=True, slots=True)
class MegaMoESpec(GraphSpec):
    """Shapes and tiling of one MoE expert block, per EP rank.

    ``tokens``: tokens per rank (T, may be 0); ``experts``: global expert count (E); ``ep``: EP
    size; ``tile_m``: rows per tile (dispatch packing, GEMM rows, SwiGLU, top-k sums);
    ``cube_split``: column blocks per GEMM row tile (spread over the cube units);
    ``wgrad_split``: row blocks of each expert weight gradient (times ``cube_split``
    column blocks); ``comm_tile``: rows per all-to-all chunk (0: one chunk per expert and
    peer round); ``ordered_comm``: chain the collectives in one order on every rank
    (needed to execute on real ranks; off to simulate one-sided puts on all channels);
    ``schedule``: ``sequential`` (stage barriers) or ``interleaved`` (per-expert
    dependencies, expert groups of ``group_size`` prioritised in order); ``precision``:
    ``mxfp8`` runs the six expert GEMMs (forward, input and weight gradients) as MXFP8 matmul
    tiles on operands quantised on the vector units (``scale_mode``: the MX scale rule; one task
    per ``quant_cols`` columns of a tile, a multiple of 32), and keeps for backward the token-axis
    quantised ``xr`` and ``a`` instead of their high-precision copies; ``fuse_vector``: SwiGLU and
    its gradient run as ``dvm.fused`` tiles (one fused DVM program each; off: the ``swiglu`` /
    ``swiglu_grad`` ops); ``grouped`` (dynamic graphs, ``ep == 1``, no MXFP8): each stage is one task
    over every expert's rows (a grouped GEMM: one GEMM per expert with rows, the vector ops unfused)
    instead of one per row tile, and the top-k sums one task over all tokens.
    """

    tokens: int
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    ep: int = 1
    dtype: str = "float32"
    tile_m: int = 128
    cube_split: int = 1
    wgrad_split: int = 1
    schedule: str = "interleaved"
    group_size: int = 1
    comm_tile: int = 0
    ordered_comm: bool = True
    precision: str = "none"
    scale_mode: str = "floor"
    quant_cols: int = 1024
    fuse_vector: bool = True
    grouped: bool = False

    def __post_init__(self) -> None:
        problems = positive(self, *(f.name for f in fields(self) if f.type == "int"
                                    and f.name not in ("comm_tile", "tokens")))
        for name in ("comm_tile", "tokens"):  # a rank may have no tokens in a step
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                problems.append(f"{name} must be a non-negative integer, got {getattr(self, name)!r}")
        if not problems:
            if self.experts % self.ep:
                problems.append(f"experts ({self.experts}) must be a multiple of ep ({self.ep})")
            if self.top_k > self.experts:
                problems.append(f"top_k ({self.top_k}) exceeds experts ({self.experts})")
        choices = {"schedule": SCHEDULES, "precision": PRECISIONS, "scale_mode": SCALE_MODES}
        problems += bools(self, "ordered_comm", "fuse_vector", "grouped") + [
            f"{n} must be one of {known}, got {getattr(self, n)!r}" for n, known in choices.items()
            if getattr(self, n) not in known]
        if not problems and self.quant_cols % 32:
            problems.append(f"quant_cols must be a multiple of 32, got {self.quant_cols}")
        if self.grouped and (self.ep > 1 or self.precision == "mxfp8"):
            problems.append(f"grouped needs ep=1 and precision none, got ep={self.ep}, precision={self.precision!r}")
        if self.precision == "mxfp8" and not problems:
            problems += [f"precision mxfp8 needs {n} to be a multiple of 32, got {getattr(self, n)}"
                         for n in ("hidden", "intermediate") if getattr(self, n) % 32]
        report("MegaMoESpec", problems + dtype_problems(self))

    @property
    def mxfp8(self) -> bool:
        return self.precision == "mxfp8"

    @property
    def experts_local(self) -> int:
        return self.experts // self.ep

    @property
    def rows(self) -> int:
        """Routed rows each rank sends (``T * k``)."""
        return self.tokens * self.top_k

    def group_of(self, expert: int) -> int:
        return expert // self.group_size


@dataclass(slots=True)
class Counts:
    """Rows each source rank routes to each global expert, with the derived offsets."""

    rank: int
    ep: int
    experts_local: int
    counts: tuple[tuple[int, ...], ...]  # [W][E]
    send_off: list[int] = field(init=False)  # [E + 1]: this rank's send-layout block starts
    recv_off: list[list[int]] = field(init=False)  # [E_l][W + 1]: recv-layout block starts

    def __post_init__(self) -> None:
        self.send_off = list(accumulate(self.counts[self.rank], initial=0))
        El, W = self.experts_local, self.ep
        at = list(accumulate((self.counts[s][self.rank * El + e] for e in range(El) for s in range(W)), initial=0))
        self.recv_off = [at[e * W:(e + 1) * W + 1] for e in range(El)]

    @property
    def send_rows(self) -> int:
        return self.send_off[-1]

    @property
    def recv_rows(self) -> int:
        return self.recv_off[-1][-1] if self.recv_off else 0

    def send_block(self, dest: int, e: int) -> tuple[int, int]:
        """Rows of this rank's send layout bound for local expert ``e`` of ``dest``."""
        g = dest * self.experts_local + e
        return self.send_off[g], self.send_off[g + 1]

    def recv_block(self, e: int, src: int) -> tuple[int, int]:
        """Rows of this rank's recv layout for local expert ``e`` that came from ``src``."""
        return self.recv_off[e][src], self.recv_off[e][src + 1]

    def expert_rows(self, e: int) -> tuple[int, int]:
        """All rows of local expert ``e`` in the recv layout."""
        return self.recv_off[e][0], self.recv_off[e][-1]

    def pair(self, src: int, dest: int, e: int) -> int:
        """Rows ``src`` sends to local expert ``e`` of ``dest``."""
        return self.counts[src][dest * self.experts_local + e]

    def round(self, e: int, j: int, combine: bool) -> tuple[list[int], tuple[int, int], tuple[int, int]]:
        """All-to-all round ``j`` of local expert ``e`` (this rank sends to ``rank + j``, receives from
        ``rank - j``): the rows each rank ``s`` sends in it, this rank's source and destination blocks."""
        W, r = self.ep, self.rank
        to, frm = (r + j) % W, (r - j) % W
        if combine:  # owner r returns the rows of source `to`; gets its own rows back from `frm`
            return [self.pair((s + j) % W, s, e) for s in range(W)], self.recv_block(e, to), self.send_block(frm, e)
        return [self.pair(s, (s + j) % W, e) for s in range(W)], self.send_block(to, e), self.recv_block(e, frm)

    def __hash__(self) -> int:  # the offsets follow from rank and counts: counts-built graphs are cached by them
        return hash((self.rank, self.counts))


@dataclass(slots=True)
class Routing:
    """Host routing metadata of one rank: counts plus the token permutation tensors.

    ``tok[s]``: token of send-layout row ``s``; ``flat[s]``: its (token, slot) index in
    the flattened ``[T, k]`` top-k arrays; ``pos[t, j]``: send-layout row of (t, j).
    """

    counts: Counts
    tok: torch.Tensor
    flat: torch.Tensor
    pos: torch.Tensor


def local_counts(topk_ids: torch.Tensor, experts: int) -> list[int]:
    """Rows this rank routes to each global expert; ids outside ``[0, experts)`` raise ConfigError."""
    if topk_ids.numel() and (int(topk_ids.min()) < 0 or int(topk_ids.max()) >= experts):
        raise ConfigError(f"top-k ids must lie in [0, {experts}), got range "
                          f"[{int(topk_ids.min())}, {int(topk_ids.max())}]")
    return torch.bincount(topk_ids.reshape(-1).long(), minlength=experts).tolist()


def make_routing(topk_ids: torch.Tensor, spec: MegaMoESpec, rank: int = 0,
                 all_counts: Sequence[Sequence[int]] | None = None) -> Routing:
    """Routing metadata of ``rank``; ``all_counts`` holds every rank's :func:`local_counts`
    (exchanged by the caller; only this rank's at ``ep == 1``)."""
    if tuple(topk_ids.shape) != (spec.tokens, spec.top_k):
        raise ConfigError(f"top-k ids are {tuple(topk_ids.shape)}, spec expects {(spec.tokens, spec.top_k)}")
    mine = local_counts(topk_ids, spec.experts)
    if all_counts is None:
        if spec.ep != 1:
            raise ConfigError(f"ep={spec.ep}: pass every rank's counts (all_counts)")
        all_counts = [mine]
    all_counts = tuple(tuple(int(c) for c in row) for row in all_counts)
    if len(all_counts) != spec.ep or any(len(r) != spec.experts for r in all_counts) or list(all_counts[rank]) != mine:
        raise ConfigError(f"all_counts must be {spec.ep} rows of {spec.experts} counts with row {rank} "
                          f"matching this rank's top-k ids")
    flat = torch.argsort(topk_ids.reshape(-1).long(), stable=True)
    pos = torch.empty_like(flat)
    pos[flat] = torch.arange(flat.numel())
    return Routing(Counts(rank, spec.ep, spec.experts_local, all_counts), flat // spec.top_k, flat,
                   pos.view(spec.tokens, spec.top_k))


def synthetic_counts(spec: MegaMoESpec, routing: str = "balanced", *, rank: int = 0, seed: int = 0,
                     skew: float = 1.2) -> Counts:
    """Per-expert counts of every rank for simulation.

    ``balanced``: each rank spreads its ``T * k`` rows evenly (remainders rotated by rank);
    ``random``: uniform random choices; ``skewed``: Zipf(``skew``) expert popularity over a
    seeded random expert order (hot experts get many rows, cold ones may get none).
    """
    if routing not in ROUTINGS:
        raise ConfigError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    if not 0 <= rank < spec.ep:
        raise ConfigError(f"rank {rank} is outside ep={spec.ep}")
    E, S = spec.experts, spec.rows
    gen = torch.Generator().manual_seed(seed)
    if routing == "skewed":
        probs = torch.arange(1, E + 1, dtype=torch.float64).pow(-skew)[torch.randperm(E, generator=gen)]
    else:
        probs = torch.ones(E, dtype=torch.float64)
    if routing == "balanced":
        rows = [tuple(S // E + (1 if (g - s) % E < S % E else 0) for g in range(E)) for s in range(spec.ep)]
    else:
        picks = [torch.multinomial(probs, S, replacement=True, generator=gen) for _ in range(spec.ep)]
        rows = [tuple(torch.bincount(pick, minlength=E).tolist()) for pick in picks]
    return Counts(rank, spec.ep, spec.experts_local, tuple(rows))
