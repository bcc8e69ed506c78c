"""FSDP with torch's FSDP2 (``torch.distributed.fsdp.fully_shard``) over the data x context ranks.

Each decoder layer is one FSDP unit and the root model (embedding, final norm, head) another:
parameters are DTensors holding uneven dim-0 shards (``torch.chunk``: 7 rows on 4 ranks
are 2, 2, 2, 1); a unit's weights are all-gathered just before its forward (and, with
``reshard_after_forward``, freed after it and gathered again for backward), gradients
reduce-scattered and averaged in its backward. FSDP2 itself gathers the next layer's
weights during backward; ``prefetch`` > 0 also issues that many layers' gathers early in
forward and backward (on a 2-core CPU with gloo this cost 7-17% wall time: the gathers
compete with compute for the cores; meant for devices where communication runs beside it). The mixed-precision policy comes from
``parallel.fsdp_param_dtype`` / ``fsdp_reduce_dtype``. Expert weights split by expert
parallelism are left out (``ignored``): their gradients are synced by the trainer.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from megaloom.train.parallel.clock import CommClock, fsdp_collectives
from megaloom.train.parallel.recompute import decoder_layers


def apply(model: nn.Module, mesh: Any, par: dict, ignored: set[nn.Parameter], clock: CommClock) -> list[nn.Module]:
    """Shard ``model`` in place over ``mesh`` (the dp_cp DeviceMesh); returns its FSDP units, root last."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dtype = {None: None, "float32": torch.float32, "bfloat16": torch.bfloat16}
    mp = MixedPrecisionPolicy(param_dtype=dtype[par["fsdp_param_dtype"]], reduce_dtype=dtype[par["fsdp_reduce_dtype"]])
    layers = [m for _, m in decoder_layers(model)]
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=par["reshard_after_forward"], mp_policy=mp,
                    ignored_params=ignored or None)
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=mp, ignored_params=ignored or None)
    ahead = par["prefetch"]
    if ahead:
        for i, layer in enumerate(layers):
            layer.set_modules_to_forward_prefetch(layers[i + 1:i + 1 + ahead])
            layer.set_modules_to_backward_prefetch(layers[max(0, i - ahead):i][::-1])
    units = layers + [model]
    timed = fsdp_collectives(clock)
    if timed is not None:
        for unit in units:
            unit.set_custom_all_gather(timed[0])
            unit.set_custom_reduce_scatter(timed[1])
    return units
