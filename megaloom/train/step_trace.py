"""Record one training step as a megaloom :class:`Trace`: phases and module spans, fwd and bwd.

Tracks (engine ``host``): unit 0 holds the phases (``forward``, ``backward``,
``optimizer``), unit 1 the forward spans of the watched modules and unit 2 their
backward spans. A module's backward span runs from the gradient of its output
arriving to the gradient of its input leaving (tensor hooks, so keyword-only
transformers calls are covered). Events of megaloom task graphs run inside the step (their
:class:`~megaloom.graphs.common.runner.GraphRunner` records them) are added with
:meth:`StepTracer.add_events` and keep their own engines (cube, vector, comm).
"""
from __future__ import annotations

import dataclasses
import re
import time
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn

from megaloom.runtime.registry import HOST
from megaloom.runtime.trace import Trace, TraceEvent

# children of decoder layers, plus the embedding / final norm / head of a causal LM
_WATCH = re.compile(r"(^|\.)(embed_tokens|norm|lm_head)$|\.layers\.\d+\.[^.]+$")
_LAYER = re.compile(r"\.layers\.(\d+)\.")


class StepTracer:
    """Hooks on ``model``; events are collected only while :meth:`active` is on."""

    def __init__(self, model: nn.Module, rank: int = 0, world_size: int = 1):
        self.rank, self.world_size, self.events, self.on = rank, world_size, [], False
        self._handles = [h for name, mod in model.named_modules() if name and _WATCH.search(name)
                         for h in (mod.register_forward_pre_hook(self._pre(name), with_kwargs=True),
                                   mod.register_forward_hook(self._post(name), with_kwargs=True))]

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    @contextmanager
    def active(self) -> Iterator[None]:
        self.events, self.on = [], True
        try:
            yield
        finally:
            self.on = False

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.on:
                self._event(name, "phase", 0, t0, time.perf_counter(), {"stage": name})

    def add_events(self, events: list[TraceEvent], module: str, direction: str) -> None:
        """Events of a graph ``module`` ran during the step: names prefixed ``<module>/``, layer and
        direction tagged (task ids renumbered, deps dropped; engine, work and precision kept)."""
        if self.on:
            tags = self._tags(module, direction)
            self.events += [dataclasses.replace(e, task_id=len(self.events) + i, task=f"{module}/{e.task}",
                                                rank=self.rank, deps=[], tags={**tags, **e.tags})
                            for i, e in enumerate(events)]

    def trace(self, step: int) -> Trace:
        return Trace(list(self.events), {"graph": f"train-step-{step}", "mode": "execute", "clock": "wall",
                                         "world_size": self.world_size, "step": step})

    def _event(self, task: str, op: str, unit: int, start: float, end: float, tags: dict[str, Any]) -> None:
        self.events.append(TraceEvent(len(self.events), task, op, HOST, unit, self.rank, start, end, tags=tags))

    def _tags(self, name: str, direction: str) -> dict[str, Any]:
        m = _LAYER.search("." + name + ".")
        return {"direction": direction, "stage": name.rsplit(".", 1)[-1], **({"layer": int(m.group(1))} if m else {})}

    def _pre(self, name: str):
        def hook(mod, args, kwargs):
            if not self.on:
                return
            mod._megaloom_t0 = time.perf_counter()
            x = _first_grad_tensor(list(args) + list(kwargs.values()))
            if x is not None:  # gradient w.r.t. the input leaves: the module's backward ends
                def done(_g, name=name):
                    t1 = time.perf_counter()
                    start = getattr(mod, "_megaloom_bwd_t0", t1)
                    if self.on:
                        self._event(f"{name}.bwd", type(mod).__name__, 2, start, t1, self._tags(name, "bwd"))
                x.register_hook(done)
        return hook

    def _post(self, name: str):
        def hook(mod, args, kwargs, out):
            if not self.on:
                return
            self._event(name, type(mod).__name__, 1, mod._megaloom_t0, time.perf_counter(), self._tags(name, "fwd"))
            y = _first_grad_tensor(out if isinstance(out, (tuple, list)) else [getattr(out, "logits", out)])
            if y is not None:  # gradient w.r.t. the output arrives: the module's backward starts
                y.register_hook(lambda _g: setattr(mod, "_megaloom_bwd_t0", time.perf_counter()))
        return hook


def _first_grad_tensor(values: list[Any]) -> torch.Tensor | None:
    return next((v for v in values if isinstance(v, torch.Tensor) and v.requires_grad and v.is_floating_point()), None)
