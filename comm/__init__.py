"""Communication: communicators (torch.distributed gloo / NCCL, world of one), comm ops on
the ``comm`` engine, uneven dim-0 sharding and its padded collectives, resharding DCP
checkpoints, and ZeroMQ trace streaming to a collector. See docs/comm.md.

Names are loaded from their modules on first use (``megaloom.comm.stream`` needs no torch)."""
from __future__ import annotations

import importlib
from typing import Any

_WHERE = {"Communicator": "communicator", "Handle": "communicator", "LocalCommunicator": "communicator",
          "ShardLayout": "sharding", "gather_uneven": "sharding", "reduce_scatter_uneven": "sharding",
          "shard_offsets": "sharding", "shard_sizes": "sharding", "TorchCommunicator": "torch_comm"}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'megaloom.comm' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"megaloom.comm.{_WHERE[name]}"), name)
    globals()[name] = value
    return value
