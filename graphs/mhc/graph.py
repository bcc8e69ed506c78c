"""MegaMHC: manifold-constrained hyper-connections (``n`` residual streams, 4 by default)
as forward and backward task graphs over token tiles.

One step joins two layers of the mHC recurrence ``x_{l+1} = R_l^T x_l + post_l F_l(H_pre,l x_l)``
(Xie et al., DeepSeek, 2025), where the coefficients of layer ``l`` are computed from ``x_l``
itself. Per token, with the streams ``h = x_{l-1}`` [n, H], the previous block's output
``y = F_{l-1}`` [H] and the previous layer's ``post`` [n] and residual mix ``R`` [n, n]::

    new_i      = sum_j R[j, i] h_j + post_i y                     (x_l, the new residual streams)
    raw        = flat(new) @ phi^T,  l = raw / rms(flat(new))      (m = n*n + 2n logits)
    next_pre   = sigmoid(a0 l[0:n] + b[0:n]) + pre_eps             (layer l's coefficients, from x_l)
    next_post  = 2 sigmoid(a1 l[n:2n] + b[n:2n])
    next_R     = sinkhorn_iters(softmax_rows(a2 l[2n:] + b[2n:]  as row-major [n, n]))
    block_in   = RMSNorm(sum_j next_pre_j new_j) * norm_w          (layer l's block input)

Forward, per tile ``i`` (vector stages around the cube projection)::

    mix_norm[i] (V) --new[i], inv_rms[i]--> proj[i] (C) --raw[i]--> coeff[i] (V) --> next pre/post/R
                                                                       \\--next_pre[i]--> block_in[i] (V)

While the cube projects tile i, the vector units mix tile i+1 and run Sinkhorn and the block
input of tile i-1. Backward, per tile::

    block_in_bwd[i] (V) --g_new, g_pre--> coeff_bwd[i] (V) --g_raw--> dnew_proj[i] (C: g_raw @ phi)
        --> mix_norm_bwd[i] (V) --> g_y, g_h, g_post, g_R
    coeff_bwd[i] --g_raw--> dphi chains (C: += g_raw^T flat(new), one per column block)
    per-tile alpha / bias / norm_w partials --sum_partials (V)--> grad_alpha, grad_bias, grad_norm_w

pre / post / R, their gradients, alpha and bias are float32 (float64 for float64 runs);
activations, phi and norm_w use the spec's dtype.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megaloom.graphs.common.builder import GraphBuilder
from megaloom.graphs.common.ops import up
from megaloom.graphs.common.spec import GraphSpec, bools, dtype_problems, positive, report
from megaloom.graphs.common.tags import tags
from megaloom.graphs.common.tiles import tile_ranges, weight_grad_chains
from megaloom.graphs.mhc.ops import coeff_attrs, fused_coeff  # (registers the MegaMHC ops)
from megaloom.runtime.graph import TaskGraph


@dataclass(frozen=True, slots=True)
class MHCSpec(GraphSpec):
    """MegaMHC shape and options; ``iters``: Sinkhorn rounds; ``rms_eps`` is used by both RMS norms;
    ``weight_cols``: columns of phi per gradient chain (chains run in parallel);
    ``weight_rows``: tokens per link of a chain; ``fuse_vector``: the forward coefficients (pre, post,
    the softmax mix and its Sinkhorn rounds) as one ``dvm.fused`` task per tile when they are float32
    (:func:`megaloom.ops.dvm.library.mhc_coeff`), else the ``mhc_coeff`` op."""

    tokens: int
    hidden: int
    streams: int = 4
    dtype: str = "float32"
    tile_tokens: int = 32
    iters: int = 20
    rms_eps: float = 1e-6
    pre_eps: float = 1e-6
    weight_cols: int = 1024
    weight_rows: int = 1024
    fuse_vector: bool = True

    def __post_init__(self) -> None:
        problems = positive(self, "tokens", "hidden", "streams", "tile_tokens", "weight_cols", "weight_rows")
        if not isinstance(self.iters, int) or self.iters < 0:
            problems.append(f"iters must be >= 0, got {self.iters!r}")
        if not isinstance(self.rms_eps, (int, float)) or not self.rms_eps > 0:
            problems.append(f"rms_eps must be positive, got {self.rms_eps!r}")
        report("MHCSpec", problems + bools(self, "fuse_vector") + dtype_problems(self))

    @property
    def logits(self) -> int:
        """Logits per token: n pre + n post + n*n mix."""
        return self.streams * (self.streams + 2)


def _inputs(g: TaskGraph, spec: MHCSpec) -> dict:
    """The forward inputs, parameters included, as graph inputs."""
    T, H, n, dt, acc = spec.tokens, spec.hidden, spec.streams, spec.dtype, spec.acc
    return {
        "y": g.input("y", (T, H), dt), "h": g.input("h", (T, n, H), dt),
        "post": g.input("post", (T, n), acc), "res": g.input("res", (T, n, n), acc),
        "phi": g.input("phi", (spec.logits, n * H), dt), "alpha": g.input("alpha", (3,), acc),
        "bias": g.input("bias", (spec.logits,), acc), "norm_w": g.input("norm_w", (H,), dt),
    }


def build_megamhc_forward(spec: MHCSpec) -> TaskGraph:
    """Inputs ``y, h, post, res, phi, alpha, bias, norm_w``; outputs ``new_res``, ``block_in``,
    ``next_pre``, ``next_post``, ``next_res`` and, saved for backward, ``raw`` [T, m] and ``inv_rms`` [T, 1]."""
    T, H, n, dt, acc = spec.tokens, spec.hidden, spec.streams, spec.dtype, spec.acc
    g = TaskGraph("megamhc_fwd")
    x = _inputs(g, spec)
    new, block = g.output("new_res", (T, n, H), dt), g.output("block_in", (T, H), dt)
    nxt_pre, nxt_post = g.output("next_pre", (T, n), acc), g.output("next_post", (T, n), acc)
    nxt_res = g.output("next_res", (T, n, n), acc)
    raw, inv = g.output("raw", (T, spec.logits), acc), g.output("inv_rms", (T, 1), acc)
    eps, made = {"rms_eps": spec.rms_eps}, {}  # made: one fused-coefficient attrs dict per tile size
    for i, (a, b) in enumerate(tile_ranges(T, spec.tile_tokens)):
        g.task("mhc_mix_norm", [x[k][a:b] for k in ("y", "h", "post", "res")], [new[a:b], inv[a:b]],
               name=f"mix_norm.{i}", attrs=eps, tags=tags(stage="mix_norm", direction="fwd", tile=i))
        g.task("proj", [new[a:b], x["phi"]], [raw[a:b]], name=f"proj.{i}",
               tags=tags(stage="proj", direction="fwd", tile=i))
        coeff = [raw[a:b], inv[a:b], x["alpha"], x["bias"]], [nxt_pre[a:b], nxt_post[a:b], nxt_res[a:b]]
        if spec.fuse_vector and acc == "float32":
            if b - a not in made:
                made[b - a] = coeff_attrs(b - a, n, spec.iters, spec.pre_eps)
            g.task("dvm.fused", *fused_coeff(*coeff), name=f"coeff.{i}", attrs=made[b - a],
                   tags=tags(stage="coeff", direction="fwd", tile=i))
        else:
            g.task("mhc_coeff", *coeff, name=f"coeff.{i}", attrs={"n": n, "iters": spec.iters, "pre_eps": spec.pre_eps},
                   tags=tags(stage="coeff", direction="fwd", tile=i))
        g.task("mhc_block_in", [new[a:b], nxt_pre[a:b], x["norm_w"]], [block[a:b]], name=f"block_in.{i}",
               attrs=eps, tags=tags(stage="block_in", direction="fwd", tile=i))
    return g


GRAD_OUTPUTS = ("new_res", "block_in", "next_pre", "next_post", "next_res")
GRAD_INPUTS = ("y", "h", "post", "res", "phi", "alpha", "bias", "norm_w")


def build_megamhc_backward(spec: MHCSpec) -> TaskGraph:
    """Inputs: the forward inputs, the saved ``new_res``, ``raw``, ``inv_rms``, ``next_pre``, and ``grad_<o>`` for
    every forward output ``o`` in :data:`GRAD_OUTPUTS`; outputs ``grad_<x>`` for every x in :data:`GRAD_INPUTS`."""
    T, H, n, dt, acc, m = spec.tokens, spec.hidden, spec.streams, spec.dtype, spec.acc, spec.logits
    g = TaskGraph("megamhc_bwd")
    x = _inputs(g, spec)
    new, raw, inv = g.input("new_res", (T, n, H), dt), g.input("raw", (T, m), acc), g.input("inv_rms", (T, 1), acc)
    pre = g.input("next_pre", (T, n), acc)
    gin = {"new_res": g.input("grad_new_res", (T, n, H), dt), "block_in": g.input("grad_block_in", (T, H), dt),
           "next_pre": g.input("grad_next_pre", (T, n), acc), "next_post": g.input("grad_next_post", (T, n), acc),
           "next_res": g.input("grad_next_res", (T, n, n), acc)}
    out = {k: g.output(f"grad_{k}", b.shape, b.dtype) for k, b in x.items()}
    tiles = tile_ranges(T, spec.tile_tokens)
    g_raw, g_inv = g.buffer("g_raw", (T, m), acc), g.buffer("g_inv_rms", (T, 1), acc)
    g_proj, g_block = g.buffer("g_new_proj", (T, n, H), acc), g.buffer("g_new_block", (T, n, H), acc)
    g_pre = g.buffer("g_pre", (T, n), acc)
    p_alpha, p_bias = g.buffer("part_alpha", (len(tiles), 3), acc), g.buffer("part_bias", (len(tiles), m), acc)
    p_norm_w = g.buffer("part_norm_w", (len(tiles), H), acc)
    eps = {"rms_eps": spec.rms_eps}
    for i, (a, b) in enumerate(tiles):
        g.task("mhc_block_in_bwd", [new[a:b], pre[a:b], x["norm_w"], gin["block_in"][a:b], gin["next_pre"][a:b]],
               [g_block[a:b], g_pre[a:b], p_norm_w[i:i + 1]], name=f"block_in_bwd.{i}", attrs=eps,
               tags=tags(stage="block_in", direction="bwd", tile=i))
        g.task("mhc_coeff_bwd", [raw[a:b], inv[a:b], x["alpha"], x["bias"], g_pre[a:b],
                                 gin["next_post"][a:b], gin["next_res"][a:b]],
               [g_raw[a:b], g_inv[a:b], p_alpha[i:i + 1], p_bias[i:i + 1]], name=f"coeff_bwd.{i}",
               attrs={"n": n, "iters": spec.iters, "pre_eps": spec.pre_eps},
               tags=tags(stage="coeff", direction="bwd", tile=i))
        g.task("proj_grad_input", [g_raw[a:b], x["phi"]], [g_proj[a:b]], name=f"dnew_proj.{i}",
               attrs={"cols": [n, H], "out_dtype": acc}, tags=tags(stage="proj_dx", direction="bwd", tile=i))
        fwd_in = [x[k][a:b] for k in ("y", "h", "post", "res")] + [new[a:b], inv[a:b]]
        g.task("mhc_mix_norm_bwd", fwd_in + [gin["new_res"][a:b], g_proj[a:b], g_block[a:b], g_inv[a:b]],
               [out[k][a:b] for k in ("y", "h", "post", "res")], name=f"mix_norm_bwd.{i}", attrs=eps,
               tags=tags(stage="mix_norm", direction="bwd", tile=i))
    weight_grad_chains(g, g_raw, new, out["phi"], tiles, spec.weight_cols, spec.weight_rows, acc, "dphi")
    for name, part in (("alpha", p_alpha), ("bias", p_bias), ("norm_w", p_norm_w)):
        g.task("sum_partials", [part], [out[name]], name=f"sum_{name}", attrs={"out_dtype": out[name].dtype},
               tags=tags(stage="reduce", direction="bwd"))
    return g


MEGAMHC = GraphBuilder("megamhc", "MegaMHC", MHCSpec, build_megamhc_forward, build_megamhc_backward)
build_megamhc = MEGAMHC.build  # build_megamhc(spec, "fwd" | "bwd")


def megamhc_reference(y, h, post, res, phi, alpha, bias, norm_w, *, iters: int = 20,
                      rms_eps: float = 1e-6, pre_eps: float = 1e-6):
    """Golden MegaMHC in plain torch with autograd, written independently of the tile ops.

    Returns (new_res [T, n, H], block_in [T, H], next_pre [T, n], next_post [T, n], next_res [T, n, n]);
    the block input collapses the new streams with the new ``pre``.
    """
    n = h.shape[1]
    new = (res.transpose(1, 2) @ up(h) + post[:, :, None] * up(y)[:, None, :]).to(h.dtype)
    flat = up(new).reshape(new.shape[0], -1)
    l = (flat / flat.pow(2).mean(-1, keepdim=True).add(rms_eps).sqrt()) @ up(phi).t()
    z = torch.cat([alpha[0] * l[:, :n], alpha[1] * l[:, n:2 * n], alpha[2] * l[:, 2 * n:]], -1) + bias
    mix = torch.softmax(z[:, 2 * n:].reshape(-1, n, n), -1)
    for _ in range(iters):
        mix = mix / mix.sum(-1, keepdim=True)
        mix = mix / mix.sum(-2, keepdim=True)
    pre = torch.sigmoid(z[:, :n]) + pre_eps
    u = torch.einsum("tj,tjh->th", pre, up(new))
    block = torch.nn.functional.rms_norm(u, (u.shape[-1],), up(norm_w), rms_eps).to(h.dtype)
    return new, block, pre, 2 * torch.sigmoid(z[:, n:2 * n]), mix
