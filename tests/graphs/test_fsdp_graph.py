"""FSDP MLP graph: structure of the prefetch edges, correctness on 1, 2 and 3 ranks against
unsharded torch autograd, ReferenceExecutor vs ThreadExecutor, and simulated overlap."""
from __future__ import annotations

import pytest
import torch

from megaloom.graphs.fsdp import build_fsdp_mlp_graph, fsdp_mlp_inputs, fsdp_mlp_reference, weight_layouts
from megaloom.comm.spawn import run_world
from megaloom.runtime import CommError, ExecContext, GraphError, ReferenceExecutor, ThreadExecutor
from megaloom.runtime.metrics import metrics
from megaloom.scheduler import Simulator

DIMS, TOKENS, TILE = [6, 7, 5, 4], 10, 4  # weight rows 7, 5, 4: uneven on 2 and on 3 ranks
UNITS = {"cube": 2, "vector": 1, "comm": 2}  # two comm units: only the chain keeps the ranks' order


def _weights() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(DIMS[i + 1], DIMS[i], generator=g) / DIMS[i] ** 0.5 for i in range(len(DIMS) - 1)]


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(TOKENS, DIMS[0], generator=g), torch.randn(TOKENS, DIMS[-1], generator=g)


def _check_rank(comm, world: int, rank: int) -> list[str]:
    """Run both prefetch settings on this rank; compare with the unsharded reference."""
    weights, checked = _weights(), []
    refs = [fsdp_mlp_reference(weights, *_batch(r)) for r in range(world)]
    x, dy = _batch(rank)
    ctx = ExecContext(rank=rank, world_size=world, comm=comm)
    for prefetch, op in ((0, "sum"), (1, "avg")):
        g = build_fsdp_mlp_graph(DIMS, TOKENS, world, rank, tile=TILE, prefetch=prefetch, reduce_op=op)
        inputs = fsdp_mlp_inputs(weights, x, dy, world, rank)
        real = ThreadExecutor(UNITS, ctx=ctx).run(g, inputs)
        ref = ReferenceExecutor(ctx).run(g, inputs)
        for name in real.outputs:
            assert torch.equal(real[name], ref[name]), f"prefetch={prefetch} {name}: ThreadExecutor != Reference"
        for name in ("y", "dx"):
            assert torch.allclose(real[name], refs[rank][name], atol=1e-5), f"prefetch={prefetch} {name}"
        for i, lay in enumerate(weight_layouts(DIMS, world, rank)):
            want = sum(r[f"dw{i}"] for r in refs) / (world if op == "avg" else 1)
            assert real[f"dw{i}"].shape == lay.local_shape
            assert torch.allclose(real[f"dw{i}"], lay.shard(want), atol=1e-5), f"prefetch={prefetch} dw{i} ({op})"
        checked.append(f"{prefetch}:{op}:{sorted(real.outputs)}")
    return checked


def world_fsdp_graph(comm) -> list[str]:
    return _check_rank(comm, comm.world_size, comm.rank)


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3])
def test_sharded_graph_matches_unsharded_torch(world):
    out = run_world(world_fsdp_graph, world, timeout=60, comm_timeout=15)
    assert len(out) == world and all(len(r) == 2 and "dw2" in r[0] for r in out)


def test_world_of_one_matches_torch():
    assert len(_check_rank(None, 1, 0)) == 2


def test_prefetch_edges():
    """p=1: the next layer's gather does not wait for this layer's compute; p=0: it does."""
    for p in (0, 1, 2):
        g = build_fsdp_mlp_graph(DIMS, TOKENS, 2, 0, tile=TILE, prefetch=p)
        reach = lambda a, b: g.reaches(g[a].id, g[b].id)  # noqa: E731
        assert reach("relu.fwd0.8", "gather.fwd1") == (p == 0)
        assert reach("relu.fwd0.8", "gather.fwd2") == (p <= 1)
        assert reach("relu.fwd1.8", "gather.bwd2") == (p <= 1)  # backward re-gathers, prefetched alike
        assert reach("matmul.fwd2.8", "gather.bwd1") == (p <= 1)
        comm = [t for t in g if t.engine == "comm"]
        assert all(reach(a.name, b.name) for a, b in zip(comm, comm[1:])), "comm tasks must form one chain"
        assert [t.op for t in comm].count("shard_all_gather") == 6


def test_forward_only_and_errors():
    g = build_fsdp_mlp_graph(DIMS, TOKENS, 2, 1, backward=False)
    assert {b.name for b in g.outputs} == {"y"} and "dy" not in g.buffers
    assert g.buffers["w0"].shape == (3, 6)  # rank 1 of 7 rows on 2 ranks
    with pytest.raises(CommError, match="'w2'.*4 rows.*5 ranks"):
        build_fsdp_mlp_graph(DIMS, TOKENS, 5, 0)
    with pytest.raises(GraphError, match="prefetch"):
        build_fsdp_mlp_graph(DIMS, TOKENS, 2, 0, prefetch=-1)


@pytest.mark.parametrize("profile", ["h100", "ascend-910b"])
def test_prefetch_hides_gathers_in_simulation(profile):
    dims, tokens, tile = [512] * 5, 1024, 128
    m = {}
    for p in (0, 1):
        g = build_fsdp_mlp_graph(dims, tokens, 3, 0, tile=tile, prefetch=p, dtype="bfloat16")
        m[p] = metrics(Simulator(profile).run(g).trace)
    assert m[1].makespan < m[0].makespan
    assert m[1].comm_hidden > m[0].comm_hidden
    assert m[1].comm_time == pytest.approx(m[0].comm_time)  # the same collectives, only moved
