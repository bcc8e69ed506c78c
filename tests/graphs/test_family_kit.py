"""The graph-family kit of ``graphs/common``: the families' torch ops (custom ops, fakes, autograd, trace
recording: every run of every micro-batch is recorded, in a bare loop and in a traced training step with
gradient accumulation), and a family of one's own plugged in with the kit alone (spec, builders, ops,
tags, the graph-builder registry)."""
from dataclasses import dataclass

import pytest
import torch

from megaloom.cli import main
from megaloom.graphs import MegaGate, MegaMHC, MegaMoE
from megaloom.graphs.common import (
    GraphBuilder, GraphOps, GraphRunner, GraphSpec, register_tag, tags, tile_ranges, weight_grad_chains,
)
from megaloom.graphs.common import builder as graph_builders
from megaloom.graphs.common.torch_ops import json_options
from megaloom.runtime.errors import GraphError
from megaloom.runtime.graph import TaskGraph
from megaloom.runtime.plugins import Registry
from megaloom.runtime.trace import Trace


def _families():
    torch.manual_seed(0)
    return MegaMoE(16, 8, 4, 2, tile_m=4), MegaGate(16, 4, 2), MegaMHC(16, tile_tokens=4, iters=2)


def _step(moe, gate, mhc, x):
    """One micro-batch through the three families: a scalar loss."""
    route = gate(x)
    y = moe(x, route.indices, route.weights)
    t, n = x.shape[0], mhc.streams
    out = mhc(y, x.unsqueeze(1).expand(-1, n, -1), torch.full((t, n), 0.5), torch.eye(n).expand(t, n, n))
    return out.block_in.square().sum() + out.new_res.sum()


def test_every_run_of_every_micro_batch_is_recorded():
    fams = _families()
    for f in fams:
        f.runner.record()
    for t in (6, 9):  # two micro-batches (gradient accumulation): fwd then bwd of each
        x = torch.randn(t, 16, requires_grad=True)
        _step(*fams, x).backward()
    for f in fams:
        runs = f.runner.record(False)
        assert [d for d, _ in runs] == ["fwd", "bwd", "fwd", "bwd"], type(f).__name__
        assert all(tr.events for _, tr in runs), type(f).__name__
        assert f.runner.recorded is None and f.runner.record(False) == []
        assert set(f.runner.last_trace) == {"fwd", "bwd"}  # the latest run of each direction stays


def test_compiled_families_without_graph_breaks():
    fams = _families()
    x = torch.randn(12, 16, requires_grad=True)
    want = _step(*fams, x)
    (gx_want,) = torch.autograd.grad(want, x)
    torch._dynamo.reset()
    assert torch._dynamo.explain(lambda t: _step(*fams, t))(x).graph_break_count == 0
    compiled = torch.compile(lambda t: _step(*fams, t), fullgraph=True, backend="aot_eager")
    got = compiled(x)
    (gx,) = torch.autograd.grad(got, x)
    assert torch.allclose(got, want) and torch.allclose(gx, gx_want)


@pytest.mark.slow
def test_traced_step_with_gradient_accumulation_keeps_every_micro_batch(tmp_path):
    from megaloom.train.trainer import Trainer
    from tests.trainer.tiny import tiny_config

    moe = {"rules": [{"match": "model.layers.*.mlp", "with": "mega_moe", "options": {"gate": "mega_gate"}}]}
    counts = {}
    for accum in (1, 2):
        out = tmp_path / f"a{accum}"
        cfg = tiny_config(out, steps=1, replace=moe, trace={"steps": [1]}, data={"batch_size": 2},
                          optimizer={"grad_accum_steps": accum})
        Trainer(cfg).fit()
        trace = Trace.load(out / "traces" / "step1.rank0.trace")
        graphs = [ev.task.split("/")[0] for ev in trace.events if "/" in ev.task]  # <module>/<graph task>
        counts[accum] = {m: sum(1 for g in graphs if g.endswith(m)) for m in (".mlp", ".gate")}
        assert all(counts[accum].values()), counts  # MegaMoE and MegaGate tasks are there
    assert counts[2] == {k: 2 * v for k, v in counts[1].items()}  # both micro-batches, each family


# -- a graph family of one's own, on the kit alone: a linear layer over token tiles ----------------
@dataclass(frozen=True, slots=True)
class LinearSpec(GraphSpec):
    tokens: int
    hidden: int
    out: int
    tile_tokens: int = 4
    dtype: str = "float32"


def _linear_fwd(spec: LinearSpec) -> TaskGraph:
    g = TaskGraph("linear_fwd")
    x, w = g.input("x", (spec.tokens, spec.hidden)), g.input("weight", (spec.out, spec.hidden))
    y = g.output("y", (spec.tokens, spec.out))
    for i, (a, b) in enumerate(tile_ranges(spec.tokens, spec.tile_tokens)):
        g.task("proj", [x[a:b], w], [y[a:b]], tags=tags(stage="proj", direction="fwd", tile=i, shard=a))
    return g


def _linear_bwd(spec: LinearSpec) -> TaskGraph:
    g = TaskGraph("linear_bwd")
    x, w = g.input("x", (spec.tokens, spec.hidden)), g.input("weight", (spec.out, spec.hidden))
    gy = g.input("grad_y", (spec.tokens, spec.out))
    gx, gw = g.output("grad_x", x.shape), g.output("grad_weight", w.shape)
    tiles = tile_ranges(spec.tokens, spec.tile_tokens)
    for a, b in tiles:
        g.task("proj_grad_input", [gy[a:b], w], [gx[a:b]], tags=tags(stage="dx", direction="bwd", shard=a))
    weight_grad_chains(g, gy, x, gw, tiles, spec.hidden, spec.tokens, "float32", "dw")
    return g


LINEAR = GraphBuilder("linear", "Linear", LinearSpec, _linear_fwd, _linear_bwd)


class LinearOps(GraphOps):
    name, family = "test_linear", LINEAR
    inputs, outputs, grad_inputs, grad_outputs = ("x", "weight"), ("y",), ("x", "weight"), ("y",)

    def spec(self, tensors, options):
        x, w = tensors
        return LinearSpec.from_dict({"tokens": x.shape[0], "hidden": x.shape[1], "out": w.shape[0],
                                     **json_options(options)})

    def fake(self, runner, tensors, options):
        return [tensors[0].new_empty(tensors[0].shape[0], tensors[1].shape[0])]


LINEAR_OPS = LinearOps()  # registers megaloom::test_linear_forward and megaloom::test_linear_backward


def test_a_new_family_plugs_in_with_the_kit_alone(monkeypatch, capsys):
    register_tag("shard", "first row of a token shard (test family)")
    register_tag("shard", "first row of a token shard (test family)")  # the same meaning again: fine
    with pytest.raises(GraphError, match="already registered"):
        register_tag("stage", "something else")
    ops, runner = LINEAR_OPS, GraphRunner()
    options = ops.options({"tokens": 1, "hidden": 8, "out": 6}, tile_tokens=3)
    x, w = torch.randn(10, 8, requires_grad=True), torch.randn(6, 8, requires_grad=True)
    y = ops(runner.key, [x, w], options)[0]
    y.square().sum().backward()
    xr, wr = x.detach().requires_grad_(), w.detach().requires_grad_()
    torch.nn.functional.linear(xr, wr).square().sum().backward()
    assert torch.allclose(x.grad, xr.grad, atol=1e-5) and torch.allclose(w.grad, wr.grad, atol=1e-5)
    assert runner.last_trace["fwd"].events[0].tags["shard"] == 0
    torch._dynamo.reset()
    assert torch._dynamo.explain(lambda t: ops(runner.key, [t, w], options)[0].sum())(x).graph_break_count == 0
    monkeypatch.setattr(graph_builders, "GRAPH_BUILDERS", Registry("graph builder"))
    graph_builders.register_graph_builder("linear", LINEAR)
    assert main(["simulate", "--graph", "linear:tokens=12,hidden=8,out=4,direction=bwd", "--no-progress"]) == 0
    assert "tasks               4" in capsys.readouterr().out  # 3 dx tiles, one dW link
