"""The torch ops of a graph family (MegaMoE, MegaGate, MegaMHC): its forward and backward graph
runs as ``torch.library`` custom ops, ``megaloom::<name>_forward`` and ``megaloom::<name>_backward``,
with fake (shape-only) implementations and an autograd formula, so ``torch.compile`` traces a model
that calls them with no graph break (``fullgraph=True`` works).

A family subclasses :class:`GraphOps` with the names of its graph inputs and outputs and the fake
results of its forward, and makes one instance (which registers the ops). Custom ops take no Python
objects: the ops take the tensors as a list, the :class:`~.runner.GraphRunner` by its key and the
family's options as a JSON string (:func:`json_options` reads it)::

    GATE_OPS(runner.key, [x, weight, bias], '{"top_k": 2}')   # -> [logits, weights, indices]

By default the forward runs the family's ``fwd`` graph of :meth:`GraphOps.spec` on the inputs by
name and returns its ``outputs`` and ``extras``; the backward runs its ``bwd`` graph on the inputs,
the ``saved`` outputs, the extras and ``grad_<output>`` for each differentiable output, and returns
``grad_<input>`` for each input that has a gradient. A family
whose runs differ (MegaMoE: host routing first) overrides :meth:`GraphOps.forward` and
:meth:`GraphOps.backward`. The runner keeps the trace of every run (:meth:`GraphRunner.record`).
"""
from __future__ import annotations

import json
from functools import lru_cache
from typing import Any, Mapping

import torch
from torch import Tensor

from megaloom.graphs.common.runner import GraphRunner, runner_for


@lru_cache(maxsize=256)
def json_options(text: str) -> dict[str, Any]:
    """The options of a call, parsed once per distinct JSON string (read-only: shared between calls)."""
    return json.loads(text)


class GraphOps:
    """The custom ops of one graph family; calling the object runs the forward op (with autograd)."""

    name: str  # the ops are megaloom::<name>_forward and megaloom::<name>_backward
    family: Any  # the family's GraphBuilder
    inputs: tuple[str, ...]  # the forward graph's inputs, in the order of the op's tensors
    outputs: tuple[str, ...]  # the forward graph's outputs the op returns
    saved: tuple[str, ...] = ()  # of the outputs, those the backward graph reads
    extras: tuple[str, ...] = ()  # further forward-graph outputs the backward graph reads (returned after outputs)
    grad_inputs: tuple[str, ...] = ()  # inputs that get a gradient (the backward graph's grad_<input>)
    grad_outputs: tuple[str, ...] = ()  # outputs that are differentiable (the backward graph reads grad_<output>)

    def __init__(self) -> None:
        def forward(tensors: list[Tensor], runner: int, options: str) -> list[Tensor]:
            return self.forward(runner_for(runner), tensors, options)

        def backward(grads: list[Tensor], saved: list[Tensor], runner: int, options: str) -> list[Tensor]:
            return self.backward(runner_for(runner), grads, saved, options)

        self.forward_op = torch.library.custom_op(f"megaloom::{self.name}_forward", forward, mutates_args=())
        self.backward_op = torch.library.custom_op(f"megaloom::{self.name}_backward", backward, mutates_args=())
        self.forward_op.register_fake(lambda tensors, runner, options: self.fake(runner_for(runner), tensors, options))
        self.backward_op.register_fake(lambda grads, saved, runner, options: [
            torch.empty_like(saved[self.inputs.index(n)]) for n in self.grad_inputs])
        self.forward_op.register_autograd(self._backward, setup_context=self._setup)

    def options(self, shape: Mapping[str, Any], **options: Any) -> str:
        """``options`` as the ops' JSON string, checked first as the family's spec with the ``shape`` fields."""
        self.family.spec.from_dict({**shape, **options})
        return json.dumps(options, sort_keys=True)

    def __call__(self, runner: int, tensors: list[Tensor], options: str) -> list[Tensor]:
        """The forward op's outputs (``outputs``, then ``extras``) on the runner of key ``runner``."""
        return self.forward_op(tensors, runner, options)

    # -- the family's ---------------------------------------------------------------------
    def spec(self, tensors: list[Tensor], options: str) -> Any:
        """The spec of a call (the default forward and backward build their graphs of it)."""

    def fake(self, runner: GraphRunner, tensors: list[Tensor], options: str) -> list[Tensor]:
        """Empty tensors shaped as the forward op's outputs (what ``torch.compile`` traces with)."""

    def forward(self, runner: GraphRunner, tensors: list[Tensor], options: str) -> list[Tensor]:
        """Run the forward graph: its ``outputs``, then its ``extras``."""
        g = runner.graph(self.family, self.spec(tensors, options), "fwd")
        out = runner.run(g, dict(zip(self.inputs, tensors)), "fwd").outputs
        return [out[n] for n in self.outputs + self.extras]

    def backward(self, runner: GraphRunner, grads: list[Tensor], saved: list[Tensor], options: str) -> list[Tensor]:
        """Run the backward graph on ``saved`` (:meth:`_setup`) and the gradients of ``grad_outputs``; returns
        the gradients of ``grad_inputs``."""
        g = runner.graph(self.family, self.spec(saved[:len(self.inputs)], options), "bwd")
        feed = dict(zip(self.inputs + self.saved + self.extras, saved))
        feed.update((f"grad_{n}", gr) for n, gr in zip(self.grad_outputs, grads))
        out = runner.run(g, {b.name: feed[b.name] for b in g.inputs}, "bwd").outputs
        return [out[f"grad_{n}"] for n in self.grad_inputs]

    def differentiable_backward(self, ctx: Any, grads: list[Tensor]) -> list[Tensor | None]:
        """The gradients of the op's tensors as differentiable tensors (``create_graph=True``); by default
        those of :meth:`backward`, which are not themselves differentiable."""
        return self._grads(ctx, grads)

    # -- autograd ---------------------------------------------------------------------------
    def _setup(self, ctx, inputs, output) -> None:
        tensors, runner, opts = inputs
        ctx.runner, ctx.options, ctx.keep = runner, opts, runner_for(runner)  # keep: the runner lives to backward
        n = len(self.outputs)
        ctx.mark_non_differentiable(*(o for name, o in zip(self.outputs, output) if name not in self.grad_outputs),
                                    *output[n:])
        ctx.save_for_backward(*tensors, *(output[self.outputs.index(s)] for s in self.saved), *output[n:])

    def _backward(self, ctx, grads):
        ours = [grads[self.outputs.index(n)].contiguous() for n in self.grad_outputs]
        got = self.differentiable_backward(ctx, ours) if torch.is_grad_enabled() else self._grads(ctx, ours)
        return got, None, None

    def _grads(self, ctx, grads: list[Tensor]) -> list[Tensor | None]:
        """One gradient per op tensor (None for those without) from the backward op."""
        got = iter(self.backward_op(grads, list(ctx.saved_tensors), ctx.runner, ctx.options))
        return [next(got) if n in self.grad_inputs else None for n in self.inputs]
