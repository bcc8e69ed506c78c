"""Training modules: ``MXFP8Linear`` and the SwiGLU experts ``GroupedExperts`` / ``MXFP8GroupedExperts``.

The MXFP8 modules hold the same parameters, under the same names, as the modules they
replace; ``from_float`` builds one around the very same Parameter objects (no copy), so
state_dict keys, optimiser state and checkpoints carry over unchanged.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from megaloom.ops.mxfp8.autograd import as_offsets, mx_grouped_linear, mx_linear
from megaloom.ops.mxfp8.format import BLOCK, check_mode
from megaloom.ops.mxfp8.grouped import bounds
from megaloom.runtime.errors import ConfigError


def dim_problems(dims: dict[str, int]) -> list[str]:
    """One message per named dim that is not a positive multiple of 32."""
    return [f"{name}={n} is not a multiple of {BLOCK}" for name, n in dims.items() if n <= 0 or n % BLOCK]


def require_dims(owner: str, dims: dict[str, int]) -> None:
    """Raise ConfigError naming ``owner`` and every dim that is not a multiple of 32."""
    problems = dim_problems(dims)
    if problems:
        raise ConfigError(f"{owner}: {'; '.join(problems)}")


class MXFP8Linear(nn.Linear):
    """``nn.Linear`` whose matmuls (forward and both gradients) run on MXFP8 operands.

    ``in_features`` and ``out_features`` must be multiples of 32; any token count works
    (tokens are zero-padded to 32 internally for the weight gradient).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 scale_mode: str = "floor"):
        require_dims("MXFP8Linear", {"in_features": in_features, "out_features": out_features})
        super().__init__(in_features, out_features, bias, device, dtype)
        self.scale_mode = check_mode(scale_mode)

    @classmethod
    def from_float(cls, linear: nn.Linear, scale_mode: str = "floor") -> MXFP8Linear:
        """An MXFP8Linear around ``linear``'s own weight and bias Parameters (shared, not copied)."""
        require_dims("MXFP8Linear", {"in_features": linear.in_features, "out_features": linear.out_features})
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight
        new.bias = linear.bias
        new.scale_mode = check_mode(scale_mode)
        new.train(linear.training)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return mx_linear(x, self.weight, self.bias, self.scale_mode)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, scale_mode={self.scale_mode}"


class GroupedExperts(nn.Module):
    """SwiGLU expert MLPs over tokens sorted by expert, in high precision (the reference).

    ``forward(x, group_offsets)``: ``x`` (T, dim), rows ``offsets[g-1]:offsets[g]`` belong to
    expert ``g``; each expert computes ``(silu(x W_gate^T) * (x W_up^T)) W_down^T``.
    Parameters: ``w_gate``, ``w_up`` (E, hidden, dim) and ``w_down`` (E, dim, hidden).
    """

    def __init__(self, num_experts: int, dim: int, hidden: int, device=None, dtype=None):
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.num_experts, self.dim, self.hidden = num_experts, dim, hidden
        self.w_gate = nn.Parameter(torch.empty(num_experts, hidden, dim, **kw))
        self.w_up = nn.Parameter(torch.empty(num_experts, hidden, dim, **kw))
        self.w_down = nn.Parameter(torch.empty(num_experts, dim, hidden, **kw))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for w in (self.w_gate, self.w_up, self.w_down):
            nn.init.normal_(w, std=1.0 / math.sqrt(w.shape[-1]))

    def forward(self, x: torch.Tensor, group_offsets: Sequence[int] | torch.Tensor) -> torch.Tensor:
        offs = as_offsets(group_offsets, x.shape[0])
        out = []
        for g, (s, e) in enumerate(bounds(offs)):
            h = F.silu(x[s:e] @ self.w_gate[g].t()) * (x[s:e] @ self.w_up[g].t())
            out.append(h @ self.w_down[g].t())
        return torch.cat(out)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, dim={self.dim}, hidden={self.hidden}"


class MXFP8GroupedExperts(GroupedExperts):
    """``GroupedExperts`` on MXFP8 grouped matmuls; gate and up share one quantisation of ``x``.

    ``dim`` and ``hidden`` must be multiples of 32; groups may have any size, empty included.
    """

    def __init__(self, num_experts: int, dim: int, hidden: int, device=None, dtype=None, scale_mode: str = "floor"):
        require_dims("MXFP8GroupedExperts", {"dim": dim, "hidden": hidden})
        super().__init__(num_experts, dim, hidden, device, dtype)
        self.scale_mode = check_mode(scale_mode)

    @classmethod
    def from_float(cls, experts: GroupedExperts, scale_mode: str = "floor") -> MXFP8GroupedExperts:
        """An MXFP8GroupedExperts around ``experts``' own Parameters (shared, not copied)."""
        require_dims("MXFP8GroupedExperts", {"dim": experts.dim, "hidden": experts.hidden})
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.num_experts, new.dim, new.hidden = experts.num_experts, experts.dim, experts.hidden
        new.w_gate, new.w_up, new.w_down = experts.w_gate, experts.w_up, experts.w_down
        new.scale_mode = check_mode(scale_mode)
        new.train(experts.training)
        return new

    def forward(self, x: torch.Tensor, group_offsets: Sequence[int] | torch.Tensor) -> torch.Tensor:
        offs = as_offsets(group_offsets, x.shape[0])
        gate_up = mx_grouped_linear(x, (self.w_gate, self.w_up), offs, self.scale_mode)
        gate, up = gate_up.split(self.hidden, dim=1)
        return mx_grouped_linear(F.silu(gate) * up, self.w_down, offs, self.scale_mode)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, scale_mode={self.scale_mode}"
