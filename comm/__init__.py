"""Communication: communicators (torch.distributed gloo / NCCL, world of one), comm ops on
the ``comm`` engine, uneven dim-0 sharding and its padded collectives, resharding DCP
checkpoints, and ZeroMQ trace streaming to a collector. See docs/comm.md."""
from megaloom.comm.communicator import Communicator, Handle, LocalCommunicator
from megaloom.comm.sharding import ShardLayout, gather_uneven, reduce_scatter_uneven, shard_offsets, shard_sizes
from megaloom.comm.torch_comm import TorchCommunicator

__all__ = [
    "Communicator", "Handle", "LocalCommunicator", "ShardLayout", "TorchCommunicator",
    "gather_uneven", "reduce_scatter_uneven", "shard_offsets", "shard_sizes",
]
