"""Activation recomputation: chosen modules keep only their inputs for backward and run again there.

``parallel.recompute``: ``none``; ``full`` (every decoder layer); or module-name globs
(``fnmatch``, ``*`` crosses dots: ``["model.layers.*.mlp"]``). Each chosen module's
forward runs under ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``; the module
itself (names, parameters, hooks) is unchanged. :func:`saved_bytes` measures what a
forward keeps for backward, so the trainer can log what recomputation saves.
"""
from __future__ import annotations

import functools
from fnmatch import fnmatchcase
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from megaloom.runtime.errors import ConfigError


def decoder_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The blocks of every ``layers`` ModuleList (a transformers decoder's layers), with their names."""
    return [(f"{name}.{i}", layer) for name, mod in model.named_modules()
            if isinstance(mod, nn.ModuleList) and name.rpartition(".")[2] == "layers"
            for i, layer in enumerate(mod)]


def targets(model: nn.Module, spec: str | list[str]) -> list[tuple[str, nn.Module]]:
    """The modules ``spec`` names; a ConfigError for a glob matching nothing or a module inside another."""
    if spec == "none":
        return []
    if spec == "full":
        found = decoder_layers(model)
        if not found:
            raise ConfigError("parallel.recompute: full recomputes decoder layers; the model has no 'layers' list")
        return found
    found, problems = [], []
    for glob in spec:
        hits = [(n, m) for n, m in model.named_modules() if n and fnmatchcase(n, glob)]
        if not hits:
            problems.append(f"parallel.recompute: {glob!r} matches no module")
        found += [h for h in hits if h not in found]
    names = [n for n, _ in found]
    problems += [f"parallel.recompute: {n} lies inside {outer}, which is recomputed already"
                 for n in names for outer in names if n.startswith(outer + ".")]
    if problems:
        raise ConfigError("\n  ".join(problems))
    return found


class Recompute:
    """Wraps the forward of each target; ``enabled`` switches recomputation off and on (for measuring)."""

    def __init__(self, modules: list[tuple[str, nn.Module]]):
        self.names = [n for n, _ in modules]
        self.enabled = True
        self.probe: Callable[[Any], None] | None = None  # sees checkpointed inputs while measuring
        for _, mod in modules:
            mod.forward = self._wrap(mod.forward)

    def _wrap(self, forward):
        @functools.wraps(forward)
        def run(*args, **kwargs):
            if not self.enabled or not torch.is_grad_enabled():
                return forward(*args, **kwargs)
            if self.probe is not None:
                self.probe(list(args) + list(kwargs.values()))
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return run


def _storage(t: torch.Tensor) -> Any:
    return getattr(t, "_local_tensor", t).untyped_storage()  # a DTensor holds its shard


def saved_bytes(model: nn.Module, fn: Callable[[], Any], recompute: Recompute | None = None) -> int:
    """Bytes of distinct activation storages (not ``model``'s parameters or buffers) a forward ``fn()``
    keeps for backward, checkpointed inputs included; the autograd graph is dropped afterwards."""
    weights = {_storage(t).data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    seen: dict[Any, int] = {}

    def keep(t: Any) -> None:
        if isinstance(t, torch.Tensor) and (ptr := _storage(t).data_ptr()) not in weights:
            seen[ptr] = _storage(t).nbytes()

    if recompute is not None:
        recompute.probe = lambda values: [keep(v) for v in values]
    try:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: keep(t) or t, lambda t: t):
            fn()  # its output, and with it the autograd graph, is dropped at once
    finally:
        if recompute is not None:
            recompute.probe = None
    return sum(seen.values())
