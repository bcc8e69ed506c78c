"""FSDP as one task graph: an MLP over uneven weight shards with prefetched gathers (:mod:`.graph`)."""
from megaloom.graphs.fsdp.graph import build_fsdp_mlp_graph, fsdp_mlp_inputs, fsdp_mlp_reference, weight_layouts

__all__ = ["build_fsdp_mlp_graph", "fsdp_mlp_inputs", "fsdp_mlp_reference", "weight_layouts"]
