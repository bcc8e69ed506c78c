"""``MegaMHC``: hyper-connections as a torch module whose forward and backward run the task graphs.

The graph runs are the custom ops ``megaloom::mhc_forward`` and ``megaloom::mhc_backward``
(:mod:`megaloom.graphs.common.torch_ops`), so ``torch.compile`` traces a model that calls MegaMHC
without a graph break.
"""
from __future__ import annotations

from typing import Any, Mapping, NamedTuple

import torch
from torch import Tensor, nn

from megaloom.graphs.common.ops import acc_dtype
from megaloom.graphs.common.runner import GraphRunner
from megaloom.graphs.common.torch_ops import GraphOps, json_options
from megaloom.graphs.mhc.graph import GRAD_INPUTS, GRAD_OUTPUTS, MEGAMHC, MHCSpec
from megaloom.runtime.dtypes import dtype_name, torch_dtype
from megaloom.runtime.executors import Executor


class MHCOutput(NamedTuple):
    new_res: torch.Tensor  # [T, n, H] the updated residual streams
    block_in: torch.Tensor  # [T, H] the input of the next block (collapsed with the next pre)
    pre: torch.Tensor  # [T, n] next pre weights
    post: torch.Tensor  # [T, n] next post weights
    res: torch.Tensor  # [T, n, n] next residual mix (near doubly stochastic)


class MHCOps(GraphOps):
    """MegaMHC's custom ops; the options: the MHCSpec fields but tokens, hidden and streams, as JSON."""

    name, family = "mhc", MEGAMHC
    inputs = grad_inputs = GRAD_INPUTS
    outputs = grad_outputs = GRAD_OUTPUTS
    saved, extras = ("new_res", "next_pre"), ("raw", "inv_rms")  # what the backward graph reads

    def spec(self, tensors: list[Tensor], options: str) -> MHCSpec:
        T, n, H = tensors[1].shape
        return MHCSpec.from_dict({"tokens": T, "hidden": H, "streams": n, "dtype": dtype_name(tensors[1].dtype),
                                  **json_options(options)})

    def fake(self, runner: GraphRunner, tensors: list[Tensor], options: str) -> list[Tensor]:
        y, h, post, res = tensors[:4]
        T, n = post.shape
        return [torch.empty_like(h), torch.empty_like(y), torch.empty_like(post), torch.empty_like(post),
                torch.empty_like(res), post.new_empty(T, n * (n + 2)), post.new_empty(T, 1)]


MHC_OPS = MHCOps()


def run_megamhc(y, h, post, res, phi, alpha, bias, norm_w, *, runner: GraphRunner | None = None,
                **options) -> MHCOutput:
    """One hyper-connection step on token rows (see :mod:`megaloom.graphs.mhc.graph` for the maths).

    ``y`` [T, H] and ``h`` [T, n, H] set the dtype; phi and norm_w are used in it, and
    post / res / alpha / bias in float32 (float64 for float64 inputs). ``options``:
    the other :class:`MHCSpec` fields (iters, rms_eps, pre_eps, tile_tokens, weight_cols, weight_rows).
    """
    T, n, H = h.shape
    options = MHC_OPS.options({"tokens": T, "hidden": H, "streams": n, "dtype": dtype_name(h.dtype)}, **options)
    runner = runner or GraphRunner()  # alive through the call; autograd keeps it for backward
    return _step(runner.key, options, y, h, post, res, phi, alpha, bias, norm_w)


def _step(runner: int, options: str, y, h, post, res, phi, alpha, bias, norm_w) -> MHCOutput:
    acc, dt = torch_dtype(acc_dtype(dtype_name(h.dtype))), h.dtype
    tensors = [y.to(dt), h, post.to(acc), res.to(acc), phi.to(dt), alpha.to(acc), bias.to(acc), norm_w.to(dt)]
    return MHCOutput(*MHC_OPS(runner, [t.contiguous() for t in tensors], options)[:len(GRAD_OUTPUTS)])


class MegaMHC(nn.Module):
    """Manifold-constrained hyper-connections over ``streams`` residual streams.

    Parameters (``nn.Parameter``): ``phi`` [m, n*H], ``alpha`` [3], ``bias`` [m], ``norm_w`` [H],
    with ``m = n*n + 2n`` (24 for n = 4). ``forward(y, h, post, res)`` (the previous block's output,
    the previous streams, the previous layer's post and residual mix) takes token rows or
    [B, S, ...] batches and returns :class:`MHCOutput` with the same leading dims. ``options``:
    the other :class:`MHCSpec` fields (iters, rms_eps, pre_eps, tile_tokens, weight_cols, weight_rows);
    ``executor``, ``units``, ``policy``: what runs the graphs (see
    :class:`~megaloom.graphs.common.runner.GraphRunner`).
    """

    def __init__(self, hidden: int, streams: int = 4, *, executor: str | Executor = "thread",
                 units: Mapping[str, int] | None = None, policy: Any = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None, **options):
        super().__init__()
        self.hidden, self.streams, self.options = hidden, streams, dict(options)
        self._options = MHC_OPS.options({"tokens": 1, "hidden": hidden, "streams": streams}, **options)
        m = streams * (streams + 2)
        self.phi = nn.Parameter(torch.empty(m, streams * hidden, device=device, dtype=dtype))
        self.alpha = nn.Parameter(torch.empty(3, device=device, dtype=torch.float32))
        self.bias = nn.Parameter(torch.empty(m, device=device, dtype=torch.float32))
        self.norm_w = nn.Parameter(torch.empty(hidden, device=device, dtype=dtype))
        self.runner = GraphRunner(executor, units=units, policy=policy)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Small projection, small alphas, a mix bias leaning to identity, unit norm weight."""
        nn.init.normal_(self.phi, std=0.02 / self.streams)
        nn.init.constant_(self.alpha, 0.01)
        with torch.no_grad():
            n = self.streams
            self.bias.zero_()
            self.bias[2 * n:].view(n, n).fill_diagonal_(4.0)
        nn.init.ones_(self.norm_w)

    def forward(self, y: torch.Tensor, h: torch.Tensor, post: torch.Tensor, res: torch.Tensor) -> MHCOutput:
        lead, n, H = h.shape[:-2], self.streams, self.hidden
        out = _step(self.runner.key, self._options, y.reshape(-1, H), h.reshape(-1, n, H), post.reshape(-1, n),
                    res.reshape(-1, n, n), self.phi, self.alpha, self.bias, self.norm_w)
        return MHCOutput(*(t.reshape(*lead, *t.shape[1:]) for t in out))

    def extra_repr(self) -> str:
        opts = "".join(f", {k}={v!r}" for k, v in self.options.items())
        return f"hidden={self.hidden}, streams={self.streams}{opts}"
