"""MegaGate graphs and module: executors and simulator against the golden torch router."""
import pytest
import torch

from megaloom.graphs import GateSpec, MegaGate, build_megagate, megagate_reference, run_megagate
from megaloom.graphs.common import GraphRunner
from megaloom.runtime.testing import rel_l2
from megaloom.runtime import ExecContext, ReferenceExecutor, ThreadExecutor
from megaloom.runtime.errors import ConfigError, ExecutionError

EXECUTORS = {"reference": ReferenceExecutor, "threaded": lambda: ThreadExecutor({"cube": 2, "vector": 2})}
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _golden(x, w, bias, g_w, g_l, **opts):
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    logits, weights, idx = megagate_reference(x, w, bias, **opts)
    ((weights * g_w).sum() + (logits * g_l).sum()).backward()
    return logits, weights, idx, x.grad, w.grad


@pytest.mark.parametrize("executor", sorted(EXECUTORS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("score", ["softmax", "sigmoid", "sqrtsoftplus"])
def test_matches_golden(executor, dtype, score):
    T, H, E, k = 45, 24, 12, 3  # 45 tokens in shards of 16: a ragged last shard
    opts = {"top_k": k, "score": score, "scale": 2.5, "renorm": True}
    x, w, bias = torch.randn(T, H).to(dtype), (0.3 * torch.randn(E, H)).to(dtype), 0.1 * torch.randn(E)
    g_w, g_l = torch.randn(T, k), torch.randn(T, E)
    logits, weights, idx, gx, gw = _golden(x, w, bias, g_w, g_l, **opts)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    runner = GraphRunner(EXECUTORS[executor]())
    out = run_megagate(xr, wr, bias, tile_tokens=16, weight_cols=10, weight_rows=32, runner=runner, **opts)
    ((out.weights * g_w).sum() + (out.logits * g_l).sum()).backward()
    assert torch.equal(out.indices, idx)
    assert out.logits.dtype == out.weights.dtype == torch.float32
    assert xr.grad.dtype == wr.grad.dtype == dtype
    for name, got, want in [("logits", out.logits, logits), ("weights", out.weights, weights),
                            ("grad_x", xr.grad, gx), ("grad_w", wr.grad, gw)]:
        assert rel_l2(got, want) <= TOL[dtype], name


def test_single_expert_no_renorm_and_weights_only_gradient():
    x, w = torch.randn(10, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)
    out = run_megagate(x, w, top_k=1, score="sigmoid", scale=1.0, renorm=True, tile_tokens=4)
    ref = megagate_reference(x, w, torch.zeros(4), top_k=1, score="sigmoid")
    assert rel_l2(out.weights, ref[1]) < 1e-6  # k = 1: no renormalisation despite renorm=True
    out.weights.sum().backward()  # logits get no gradient: the graph takes zeros for them
    gx, gw = torch.autograd.grad(ref[1].sum(), (x, w))
    assert rel_l2(x.grad, gx) < 1e-5 and rel_l2(w.grad, gw) < 1e-5


def test_gradcheck_float64():
    x = torch.randn(9, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    bias = 0.1 * torch.randn(6, dtype=torch.float64)
    for score in ("softmax", "sigmoid", "sqrtsoftplus"):
        def f(x_, w_):
            out = run_megagate(x_, w_, bias, top_k=2, score=score, scale=1.7, tile_tokens=4, weight_cols=3,
                               weight_rows=4)
            return out.weights, out.logits
        assert torch.autograd.gradcheck(f, (x, w), eps=1e-6, atol=1e-6)


def test_module_parameters_and_batches():
    gate = MegaGate(16, 8, 2, score="sigmoid", scale=2.0, tile_tokens=8, executor=ThreadExecutor())
    assert [n for n, _ in gate.named_parameters()] == ["weight"]
    assert isinstance(gate.weight, torch.nn.Parameter) and "bias" in dict(gate.named_buffers())
    gate.bias.copy_(torch.linspace(-1, 1, 8))
    x = torch.randn(2, 5, 16)
    out = gate(x)
    assert out.weights.shape == (2, 5, 2) and out.indices.shape == (2, 5, 2) and out.logits.shape == (2, 5, 8)
    ref = megagate_reference(x.reshape(10, 16), gate.weight, gate.bias, top_k=2, score="sigmoid", scale=2.0)
    assert torch.equal(out.indices.reshape(10, 2), ref[2])
    g = torch.randn(10, 2)  # (renormalised weights sum to the scale: their plain sum has no gradient)
    (out.weights.reshape(10, 2) * g).sum().backward()
    (want,) = torch.autograd.grad((ref[1] * g).sum(), gate.weight)
    assert rel_l2(gate.weight.grad, want) < 1e-5


def test_graph_structure():
    spec = GateSpec(tokens=40, hidden=24, experts=8, top_k=2, tile_tokens=16, weight_cols=10, weight_rows=16)
    fwd = build_megagate(spec, "fwd").validate()
    assert [t.name for t in fwd] == ["proj.0", "topk.0", "proj.1", "topk.1", "proj.2", "topk.2"]
    assert [p.name for p in fwd["topk.1"].predecessors] == ["proj.1"]  # shards are independent
    assert {t.engine for t in fwd if t.op == "proj"} == {"cube"} and fwd["topk.0"].engine == "vector"
    bwd = build_megagate(spec, "bwd").validate()
    assert sum(t.op == "proj_grad_weight" for t in bwd) == 3 * 3  # 3 shards x 3 column blocks
    coarse = build_megagate(GateSpec(40, 24, 8, 2, tile_tokens=16, weight_cols=10, weight_rows=32), "bwd")
    links = [t for t in coarse if t.name.endswith(".0") and t.op == "proj_grad_weight"]  # column block 0
    assert [t.inputs[0].shape[0] for t in links] == [32, 8]  # links of 2 shards, then the ragged rest
    assert {p.name for p in links[0].predecessors} == {"topk_bwd.0", "topk_bwd.1"}
    assert all(t.tags["direction"] == "bwd" for t in bwd)


def test_spec_errors():
    with pytest.raises(ConfigError, match="top_k"):
        GateSpec(tokens=4, hidden=8, experts=2, top_k=3)
    with pytest.raises(ConfigError, match="score"):
        GateSpec(tokens=4, hidden=8, experts=4, top_k=1, score="relu")
    with pytest.raises(ConfigError, match="unknown option.*tokenz"):
        GateSpec.from_dict({"tokenz": 4, "hidden": 8, "experts": 4, "top_k": 1})
    with pytest.raises(ConfigError, match="scale"):
        GateSpec.from_dict({"tokens": 4, "hidden": 8, "experts": 4, "top_k": 1, "scale": "big"})
    assert GateSpec.from_dict({"tokens": 4, "hidden": 8, "experts": 4, "top_k": 1, "scale": 2}).scale == 2.0
    with pytest.raises(ConfigError, match="direction"):
        build_megagate(GateSpec(4, 8, 4, 1), "sideways")


@pytest.mark.gpu
def test_cuda_matches_cpu_golden():
    x, w, bias = torch.randn(300, 64), torch.randn(32, 64), 0.1 * torch.randn(32)
    runner = GraphRunner(ThreadExecutor({"cube": 2, "vector": 2}, ctx=ExecContext(device=torch.device("cuda"))))
    out = run_megagate(x.cuda().requires_grad_(), w.cuda(), bias.cuda(), top_k=4, score="sigmoid", runner=runner)
    ref = megagate_reference(x, w, bias, top_k=4, score="sigmoid")
    assert out.weights.is_cuda and torch.equal(out.indices.cpu(), ref[2])
    assert rel_l2(out.weights.cpu(), ref[1]) < 1e-5


def test_executor_on_another_device_is_refused():
    ex = ThreadExecutor(ctx=ExecContext(device=torch.device("meta")))
    with pytest.raises(ExecutionError, match="executor 'threaded' runs on meta"):
        run_megagate(torch.randn(4, 8), torch.randn(4, 8), top_k=1, runner=GraphRunner(ex))
