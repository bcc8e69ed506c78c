"""What the graph families share, the kit of a new one: tiles and the (open) tag table, the projection
ops, the spec parser, the graph factory (:class:`GraphBuilder`) and the registry of graph builders,
the graph runner of the modules and their torch ops (:class:`~.torch_ops.GraphOps`)."""
from megaloom.graphs.common.builder import DIRECTIONS, GRAPH_BUILDERS, GraphBuilder, register_graph_builder
from megaloom.graphs.common.ops import acc_dtype, up
from megaloom.graphs.common.runner import EXECUTORS, GraphRunner
from megaloom.graphs.common.spec import DTYPES, GraphSpec, load_options, parse_spec
from megaloom.graphs.common.tags import TAGS, register_tag, tags
from megaloom.graphs.common.tiles import split, tile_ranges, weight_grad_chains
from megaloom.graphs.common.torch_ops import GraphOps

__all__ = [
    "DIRECTIONS", "DTYPES", "EXECUTORS", "GRAPH_BUILDERS", "GraphBuilder", "GraphOps", "GraphRunner", "GraphSpec",
    "TAGS", "acc_dtype", "load_options", "parse_spec", "register_graph_builder", "register_tag", "split", "tags",
    "tile_ranges", "up", "weight_grad_chains",
]
