"""The graph families' torch ops (one kit: custom ops, fakes, autograd, trace recording): every run of
every micro-batch is recorded, in a bare loop and in a traced training step with gradient accumulation."""
import pytest
import torch

from megaloom.graphs import MegaGate, MegaMHC, MegaMoE
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
