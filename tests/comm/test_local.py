"""Single-process checks: world of one, op registry entries, shard arithmetic."""
from __future__ import annotations

import pytest
import torch

from megaloom.comm import LocalCommunicator, ShardLayout, shard_offsets, shard_sizes
from megaloom.comm.ops import chain
from megaloom.runtime import CommError, ExecContext, GraphError, ReferenceExecutor, TaskGraph, ThreadExecutor
from megaloom.runtime.registry import TensorSpec, get_op

COMM_OPS = ["all_to_all", "all_gather", "reduce_scatter", "all_reduce", "send", "recv",
            "shard_all_gather", "shard_reduce_scatter"]


@pytest.mark.parametrize("n,w,want", [(7, 4, [2, 2, 2, 1]), (5, 2, [3, 2]), (6, 4, [2, 2, 1, 1]), (9, 3, [3, 3, 3])])
def test_shard_sizes(n, w, want):
    assert shard_sizes(n, w) == want
    assert shard_offsets(want)[-1] + want[-1] == n
    lay = ShardLayout.of((n, 3), w, w - 1)
    assert lay.local_shape == (want[-1], 3) and lay.offset == n - want[-1] and lay.padded == want[0]


def test_fewer_rows_than_ranks_names_the_parameter():
    with pytest.raises(CommError, match="'layer.bias'.*3 rows.*4 ranks"):
        shard_sizes(3, 4, "layer.bias")


def test_ops_registered_on_comm_engine_with_context():
    for name in COMM_OPS:
        op = get_op(name)
        assert op.engines == ("comm",) and op.context, name


def test_shape_rules_and_costs():
    x = TensorSpec((6, 4), "float32")
    assert get_op("all_to_all").shape([x], {"send_splits": [1, 5], "recv_splits": [2, 2]}) == [TensorSpec((4, 4), "float32")]
    with pytest.raises(GraphError, match="sum to 5"):
        get_op("all_to_all").shape([x], {"send_splits": [1, 4], "recv_splits": [2, 2]})
    assert get_op("all_gather").shape([x], {"world_size": 3})[0].shape == (18, 4)
    assert get_op("reduce_scatter").shape([x], {"world_size": 3})[0].shape == (2, 4)
    with pytest.raises(GraphError, match="world_size"):
        get_op("all_gather").shape([x], {})
    assert get_op("shard_all_gather").shape([TensorSpec((2, 4), "float32")], {"sizes": [2, 2, 2, 1], "rank": 0})[0].shape == (7, 4)
    assert get_op("shard_reduce_scatter").shape([TensorSpec((7, 4), "float32")], {"sizes": [2, 2, 2, 1], "rank": 3})[0].shape == (1, 4)
    cost = get_op("all_gather").cost([x], [TensorSpec((24, 4), "float32")], {"world_size": 4})
    assert cost.comm_bytes == 24 * 4 * 4 * 3 / 4 and cost.flops == 0
    # uneven gather pays for the padding: 4 ranks x 2 rows
    cost = get_op("shard_all_gather").cost([TensorSpec((1, 4), "float32")], [TensorSpec((7, 4), "float32")],
                                           {"sizes": [2, 2, 2, 1], "rank": 3})
    assert cost.comm_bytes == 8 * 4 * 4 * 3 / 4


def test_local_communicator_checks_splits_and_copies():
    c = LocalCommunicator()
    x, out = torch.arange(6.0).reshape(3, 2), torch.empty(3, 2)
    c.all_to_all(out, x, [3], [3])
    assert torch.equal(out, x)
    with pytest.raises(CommError, match="splits"):
        c.all_to_all(out, x, [2], [3])
    with pytest.raises(CommError, match="no peers"):
        c.send(x, 1)
    with pytest.raises(CommError, match="reduce op"):
        c.all_reduce(x, "prod")


def _comm_graph() -> TaskGraph:
    g = TaskGraph("comm-local")
    x, w = g.input("x", (8, 4)), g.input("w", (4, 4))
    h, a, s, y = g.buffer("h", (8, 4)), g.buffer("a", (8, 4)), g.buffer("s", (8, 4)), g.output("y", (8, 4))
    g.task("matmul", [x, w], [h])
    t1 = g.task("all_to_all", [h], [a], attrs={"send_splits": [8], "recv_splits": [8]})
    t2 = g.task("all_gather", [a], [s], attrs={"world_size": 1})
    t3 = g.task("all_reduce", [s], [y], attrs={"op": "sum"})
    chain(t1, t2, t3)
    return g


def test_comm_graph_world_of_one_threaded_equals_reference():
    g = _comm_graph()
    torch.manual_seed(0)
    inputs = {"x": torch.randn(8, 4), "w": torch.randn(4, 4)}
    ref = ReferenceExecutor().run(g, inputs)
    real = ThreadExecutor({"cube": 1, "comm": 1}, ctx=ExecContext(comm=LocalCommunicator())).run(g, inputs)
    assert torch.equal(ref["y"], inputs["x"] @ inputs["w"])
    assert torch.equal(real["y"], ref["y"])


def test_comm_task_without_communicator_in_a_bigger_world_fails_by_name():
    with pytest.raises(Exception, match="all_to_all.*ExecContext.comm"):
        ReferenceExecutor(ExecContext(rank=0, world_size=2)).run(
            _comm_graph(), {"x": torch.zeros(8, 4), "w": torch.zeros(4, 4)})


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_world_of_one_fully_shard_and_checkpoint_round_trip(tmp_path):
    from torch import nn

    from megaloom.comm import fully_shard
    from megaloom.comm.checkpoint import CheckpointError, load, save

    torch.manual_seed(0)
    model = fully_shard(nn.Linear(3, 4), LocalCommunicator())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    save(tmp_path / "ck", model, opt)
    torch.manual_seed(1)
    other = fully_shard(nn.Linear(3, 4), LocalCommunicator())
    opt2 = torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9)
    assert load(tmp_path / "ck", other, opt2)["world_size"] == 1
    for fqn in ("weight", "bias"):
        assert torch.equal(other.shard(fqn), model.shard(fqn))
        assert torch.equal(opt2.state[other.shard(fqn)]["momentum_buffer"], opt.state[model.shard(fqn)]["momentum_buffer"])
    with pytest.raises(CheckpointError, match="no checkpoint"):
        load(tmp_path / "missing", other)

    # a crash in the middle of the next save leaves the previous checkpoint whole
    import torch.distributed.checkpoint as dcp

    def crash(state, storage_writer, **kw):
        open(f"{storage_writer.path}/__0_0.distcp", "wb").write(b"half")
        raise KeyboardInterrupt("killed mid-save")

    before = model.shard("weight").detach().clone()
    with torch.no_grad():
        model.shard("weight").add_(1.0)
    real_save, dcp.save = dcp.save, crash
    try:
        with pytest.raises(KeyboardInterrupt):
            save(tmp_path / "ck", model, opt)
    finally:
        dcp.save = real_save
    load(tmp_path / "ck", other, opt2)
    assert torch.equal(other.shard("weight"), before)
    wrong = fully_shard(nn.Linear(3, 5), LocalCommunicator())
    with pytest.raises(CheckpointError, match=r"'model.weight' holds \(4, 3\), the model expects \(5, 3\)"):
        load(tmp_path / "ck", wrong)


def test_simulator_prices_comm_tasks_with_the_link_model():
    from megaloom.scheduler import CostModel, Simulator, load_profile

    profile = load_profile("ascend-910b")
    g = TaskGraph("sim-comm")
    a, b = g.input("a", (256, 64)), g.output("b", (256, 64))
    c, d = g.input("c", (256, 64)), g.output("d", (256, 64))
    splits = {"send_splits": [64] * 4, "recv_splits": [64] * 4}
    g.task("all_to_all", [a], [b], name="intra", attrs=splits)
    g.task("all_to_all", [c], [d], name="inter", attrs=splits, tags={"link": "inter"})
    trace = Simulator(profile, units={"comm": 2}).run(g).trace
    dur = {e.task: e.duration for e in trace.events}
    cost = g.task_cost(g["intra"])
    assert cost.comm_bytes == 256 * 64 * 4
    for link in ("intra", "inter"):
        assert dur[link] == pytest.approx(CostModel(profile).duration(cost, "comm", link))
    assert dur["inter"] > dur["intra"] > 0
