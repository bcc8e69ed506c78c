"""What the graph families share: tiles and the tag table, the projection ops, the spec
parser, the graph factory (:class:`GraphBuilder`) and the graph runner of the modules."""
from megaloom.graphs.common.builder import DIRECTIONS, GraphBuilder
from megaloom.graphs.common.ops import acc_dtype, up
from megaloom.graphs.common.runner import EXECUTORS, GraphRunner
from megaloom.graphs.common.spec import DTYPES, GraphSpec, load_options, parse_spec
from megaloom.graphs.common.tags import TAGS, tags
from megaloom.graphs.common.tiles import split, tile_ranges, weight_grad_chains

__all__ = [
    "DIRECTIONS", "DTYPES", "EXECUTORS", "GraphBuilder", "GraphRunner", "GraphSpec", "TAGS", "acc_dtype",
    "load_options", "parse_spec", "split", "tags", "tile_ranges", "up", "weight_grad_chains",
]
