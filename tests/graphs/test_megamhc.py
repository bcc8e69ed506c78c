"""MegaMHC graphs and module: executors and simulator against the golden torch reference."""
import pytest
import torch

from megaloom.graphs import MegaMHC, MHCSpec, build_megamhc, megamhc_reference, run_megamhc
from megaloom.graphs.common import GraphRunner
from megaloom.runtime.testing import rel_l2
from megaloom.runtime import ExecContext, ReferenceExecutor, ThreadExecutor
from megaloom.runtime.errors import ConfigError

EXECUTORS = {"reference": ReferenceExecutor, "threaded": lambda: ThreadExecutor({"cube": 2, "vector": 3})}
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float64: 1e-10}
NAMES = ("y", "h", "post", "res", "phi", "alpha", "bias", "norm_w")


def _inputs(T, H, n=4, dtype=torch.float32):
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    m = n * (n + 2)
    x = [torch.randn(T, H), torch.randn(T, n, H), 2 * torch.rand(T, n),
         torch.softmax(torch.randn(T, n, n), -1), 0.3 * torch.randn(m, n * H), torch.tensor([0.8, 1.2, 0.9]),
         0.5 * torch.randn(m), 1 + 0.1 * torch.randn(H)]
    low = {0, 1, 4, 7}  # activations, phi and norm_w take the run's dtype; the rest accumulate
    return [t.to(dtype if i in low else acc).requires_grad_() for i, t in enumerate(x)]


def _loss(outs, cot):
    return sum((o.double() * c.double()).sum() for o, c in zip(outs, cot))


@pytest.mark.parametrize("executor", sorted(EXECUTORS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_golden(executor, dtype):
    x = _inputs(37, 12, dtype=dtype)  # 37 tokens in tiles of 8: a ragged last tile
    ref = megamhc_reference(*x)
    cot = [torch.randn(r.shape) for r in ref]
    want = torch.autograd.grad(_loss(ref, cot), x)
    out = run_megamhc(*x, tile_tokens=8, weight_cols=5, weight_rows=16, runner=GraphRunner(EXECUTORS[executor]()))
    got = torch.autograd.grad(_loss(out, cot), x)
    for name, o, r in zip(("new_res", "block_in", "pre", "post", "res"), out, ref):
        assert o.dtype == r.dtype and rel_l2(o, r) <= TOL[dtype], name
    for name, g, w in zip(NAMES, got, want):
        assert g.dtype == w.dtype and rel_l2(g, w) <= TOL[dtype], f"grad_{name}"


def test_block_input_uses_the_pre_of_the_new_streams():
    """mHC: layer l's coefficients, pre included, come from x_l; the block input is RMSNorm(H_pre x_l)."""
    y, h, post, res, *params = [t.detach() for t in _inputs(9, 6)]
    out = run_megamhc(y, h, post, res, *params, tile_tokens=4)
    z = (out.pre.unsqueeze(-1) * out.new_res).sum(1)
    want = torch.nn.functional.rms_norm(z, (6,), params[-1], 1e-6)
    assert rel_l2(out.block_in, want) < 1e-6


def test_streams_other_than_four():
    x = _inputs(10, 6, n=2)
    ref = megamhc_reference(*x, iters=5)
    out = run_megamhc(*x, iters=5, tile_tokens=4)
    assert all(rel_l2(o, r) < 1e-5 for o, r in zip(out, ref))


def test_gradcheck_float64():
    x = _inputs(6, 3, dtype=torch.float64)

    def f(*args):
        return tuple(run_megamhc(*args, iters=4, tile_tokens=4, weight_cols=2, weight_rows=4))

    assert torch.autograd.gradcheck(f, tuple(x), eps=1e-6, atol=1e-6)


def test_module():
    mhc = MegaMHC(8, tile_tokens=4, executor=ThreadExecutor({"cube": 1, "vector": 2}))
    assert sorted(n for n, _ in mhc.named_parameters()) == ["alpha", "bias", "norm_w", "phi"]
    assert mhc.phi.shape == (24, 32) and mhc.bias.shape == (24,)
    y, h = torch.randn(2, 3, 8), torch.randn(2, 3, 4, 8)
    post, res = torch.ones(2, 3, 4), torch.eye(4).expand(2, 3, 4, 4)
    out = mhc(y, h, post, res)
    assert out.new_res.shape == (2, 3, 4, 8) and out.block_in.shape == (2, 3, 8) and out.res.shape == (2, 3, 4, 4)
    assert torch.allclose(out.new_res, h + y.unsqueeze(-2))  # identity mix, unit post
    ref = megamhc_reference(y.reshape(6, 8), h.reshape(6, 4, 8), post.reshape(6, 4), res.reshape(6, 4, 4),
                            mhc.phi, mhc.alpha, mhc.bias, mhc.norm_w)
    cot = [torch.randn(r.shape) for r in ref]
    _loss([o.reshape(r.shape) for o, r in zip(out, ref)], cot).backward()
    params = [mhc.phi, mhc.alpha, mhc.bias, mhc.norm_w]
    want = torch.autograd.grad(_loss(ref, cot), params)
    for p, w in zip(params, want):
        assert rel_l2(p.grad, w) < 1e-5


def test_graph_structure():
    spec = MHCSpec(tokens=20, hidden=6, tile_tokens=8, weight_cols=4, weight_rows=8)
    fwd = build_megamhc(spec, "fwd").validate()
    assert [t.name for t in fwd][:4] == ["mix_norm.0", "proj.0", "coeff.0", "block_in.0"]
    assert fwd["proj.1"].engine == "cube" and [p.name for p in fwd["proj.1"].predecessors] == ["mix_norm.1"]
    assert {p.name for p in fwd["coeff.1"].predecessors} == {"mix_norm.1", "proj.1"}
    assert {p.name for p in fwd["block_in.1"].predecessors} == {"mix_norm.1", "coeff.1"}  # the new pre
    bwd = build_megamhc(spec, "bwd").validate()
    assert {p.name for p in bwd["coeff_bwd.1"].predecessors} == {"block_in_bwd.1"}
    assert {p.name for p in bwd["mix_norm_bwd.1"].predecessors} == {"block_in_bwd.1", "coeff_bwd.1", "dnew_proj.1"}
    assert sum(t.op == "proj_grad_weight" for t in bwd) == 3 * 4 * 2  # 3 tiles x (4 streams x 2 column blocks)


def test_spec_errors():
    with pytest.raises(ConfigError, match="iters"):
        MHCSpec(tokens=4, hidden=8, iters=-1)
    with pytest.raises(ConfigError, match="dtype"):
        MHCSpec(tokens=4, hidden=8, dtype="int8")
    with pytest.raises(ConfigError, match="missing option.*hidden"):
        MHCSpec.from_dict({"tokens": 4})
    assert MHCSpec.from_dict({"tokens": 4, "hidden": 8, "dtype": "bfloat16"}).logits == 24


@pytest.mark.gpu
def test_cuda_matches_cpu_golden():
    x = [t.detach() for t in _inputs(100, 32)]
    runner = GraphRunner(ThreadExecutor({"cube": 1, "vector": 2}, ctx=ExecContext(device=torch.device("cuda"))))
    out = run_megamhc(*(t.cuda() for t in x), runner=runner)
    for o, r in zip(out, megamhc_reference(*x)):
        assert o.is_cuda and rel_l2(o.cpu(), r) < 1e-5
