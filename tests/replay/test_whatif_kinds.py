"""Every kind of what-if on small pairs the test records itself (tiny torch workloads under
torch.profiler on the CPU): the what-if applied to side A's trace must reproduce what side B's
own trace records (work figures, task counts), and move the replay where it says."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

from megaloom.runtime.errors import ConfigError
from megaloom.runtime.trace import Trace, TraceEvent
from megaloom.scheduler import load_profile
from megaloom.scheduler.importers import import_torch_profiler, reshaped
from megaloom.scheduler.replay import WhatIf, replay


class Tiny(nn.Module):
    """Layers of (linear, relu, linear) under ``layer.i``, then experts under ``expert.j``."""

    def __init__(self, width=48, layers=2, experts=3, dropout=0.0):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(20, width), nn.ReLU(), nn.Dropout(dropout),
                                                  nn.Linear(width, 20)) for _ in range(layers))
        self.experts = nn.ModuleList(nn.Linear(20, 20) for _ in range(experts))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            with record_function(f"layer.{i}"):
                x = layer(x)
        out = 0
        for j, expert in enumerate(self.experts):
            with record_function(f"expert.{j}"):
                out = out + expert(x[j::len(self.experts)]).sum()
        return out


def record(tmp_path, name, tokens=12, **kw):
    torch.manual_seed(0)
    model, x = Tiny(**kw), torch.randn(tokens, 20)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        model(x).backward()
    path = tmp_path / f"{name}.json"
    prof.export_chrome_trace(str(path))
    return import_torch_profiler(path)[0]


@pytest.fixture(scope="module")
def a(tmp_path_factory):
    return record(tmp_path_factory.mktemp("a"), "a")


def gemm_flops(trace, scope=None):
    return sum(e.flops for e in trace.events if e.engine == "cube"
               and (scope is None or any(scope in x for x in e.tags.get("annotations", ()))))


def test_backward_nodes_are_gemms_with_the_work_of_all_their_products(a):
    nodes = [e for e in a.events if "AddmmBackward" in e.op]
    assert nodes and all(e.engine == "cube" for e in nodes)
    assert all(e.tags["annotations"] for e in nodes)  # the forward op's scope, through the fwd -> bwd flow
    forward = {e.flops for e in a.events if e.op == "aten::linear" and "layer.1" in e.tags["annotations"]}
    # two products each (the input's gradient and the weight's), not the figures of one of them
    assert {e.flops for e in nodes if "layer.1" in e.tags["annotations"]} == {2 * f for f in forward}


@pytest.mark.parametrize("change, dims", [({"width": 96}, {48: 96}), ({"tokens": 24}, {12: 24})],
                         ids=["width", "batch"])
def test_dims_what_if_gives_side_b_its_recorded_work(tmp_path, a, change, dims):
    b = record(tmp_path, "b", **change)
    src = a.meta["source"]
    want = sum(e.flops * (reshaped(src, e.tags["sources"], dims) or (1, 1))[0] for e in a.events
               if e.engine == "cube" and e.tags.get("sources") and "layer." in str(e.tags.get("annotations")))
    assert want == pytest.approx(gemm_flops(b, "layer."), rel=1e-9) and want != gemm_flops(a, "layer.")
    faster = replay(a, whatif=WhatIf(dims=dims)).trace
    assert faster.makespan > replay(a).trace.makespan


def test_layers_what_if_repeats_and_removes_the_recorded_layers(tmp_path, a):
    b = record(tmp_path, "b", layers=4)
    def n_layer_tasks(t):
        return sum(1 for e in t.events if any(x.startswith("layer.") for x in e.tags.get("annotations", ())))
    assert n_layer_tasks(b) == 2 * n_layer_tasks(a)
    def busy(whatif):
        out = replay(a, whatif=whatif).trace
        return sum(e.duration for e in out.events if "layer.1" in e.tags.get("annotations", ()))
    assert busy(WhatIf(layers=("layer.*", 4))) == pytest.approx(2 * busy(None))
    assert busy(WhatIf(layers=("layer.*", 1))) == 0.0  # the second layer removed
    with pytest.raises(ConfigError, match="no annotation of this trace matches 'block.*'"):
        replay(a, whatif=WhatIf(layers=("block.*", 4)))


def test_remove_what_if_drops_what_side_b_does_not_run(tmp_path):
    a = record(tmp_path, "a", dropout=0.5)
    b = record(tmp_path, "b", dropout=0.0)
    def dropouts(t):
        return [e for e in t.events if "dropout" in e.op.lower() and e.duration > 0]
    assert dropouts(a) and not any("native_dropout" in e.op for e in dropouts(b))
    out = replay(a, whatif=WhatIf(remove=("*dropout*",))).trace
    assert not dropouts(out) and out.makespan < replay(a).trace.makespan


def test_speedup_by_pattern_and_scope(a):
    base = {e.task_id: e.duration for e in replay(a).trace.events}
    out = {e.task_id: e for e in replay(a, whatif=WhatIf(speedup={"*": 2.0}, scope=("expert.1",))).trace.events}
    for e in a.events:
        inside = "expert.1" in e.tags.get("annotations", ())
        assert out[e.task_id].duration == pytest.approx(base[e.task_id] / (2 if inside else 1))
    out = {e.task_id: e for e in replay(a, whatif=WhatIf(speedup={"aten::linear": 4.0})).trace.events}
    assert all(out[e.task_id].duration == pytest.approx(base[e.task_id] / 4) for e in a.events if e.op == "aten::linear")


def test_hot_experts_shift_work_to_the_first_expert(a):
    base = {e.task_id: e.duration for e in replay(a).trace.events}
    out = {e.task_id: e.duration for e in replay(a, whatif=WhatIf(hot_experts=("expert.*", 2.0))).trace.events}
    def change(scope):
        ids = [e.task_id for e in a.events if scope in e.tags.get("annotations", ()) and e.flops]
        return sum(out[i] for i in ids) / sum(base[i] for i in ids)
    # tiny ops: mostly the cost model's per-task overhead, so the shift is small but one-sided
    assert change("expert.0") > 1.0 > max(change("expert.1"), change("expert.2"))


def test_dp_what_if_adds_gradient_all_reduces_of_every_parameter(a):
    model = Tiny()
    params = sum(p.numel() * 4 for p in model.parameters())
    out = replay(a, whatif=WhatIf(dp=2)).trace
    added = [e for e in out.events if e.tags.get("class") == "added"]
    assert added and sum(e.comm_bytes for e in added) == pytest.approx(params)  # 2 (n-1)/n = 1 for n = 2
    assert out.makespan > replay(a).trace.makespan


def test_what_if_kinds_and_checks():
    assert WhatIf(dims={4: 8}, dp=2, speedup={"x": 2}).kinds() == ["op_speed", "shape", "parallelism"]
    for bad, says in [(WhatIf(dp=0), "dp must be a positive whole number"), (WhatIf(dims={4: 0}), "dimension 4 -> 0"),
                      (WhatIf(hot_experts=("e", -1.0)), "hot experts must be"), (WhatIf(comm_bytes=0), "comm bytes")]:
        with pytest.raises(ConfigError, match=says):
            bad.check()


def test_removing_an_op_removes_its_backward_nodes_too(tmp_path):
    """Dropout's backward is a MulBackward0 node: tagged with the forward op that recorded it, so
    ``--remove '*dropout*'`` takes it with the forward op."""
    trace = record(tmp_path, "dropout", dropout=0.5)
    mine = [e for e in trace.events if e.tags.get("forward", [None])[0] == "aten::dropout"]
    assert mine and all(e.op.startswith("autograd::engine::") for e in mine)
    assert any("MulBackward0" in e.op for e in mine)
    removed = {e.task_id: e for e in WhatIf(remove=("*dropout*",)).apply(trace, load_profile("cpu"), False).events}
    assert all(removed[e.task_id].end == removed[e.task_id].start for e in mine)


def test_an_op_nested_in_another_is_taken_out_of_it(tmp_path):
    """Attention with dropout runs its math path, dropout nested inside: removing ``aten::dropout``
    takes exactly the nested dropout's recorded time out of the attention op, and its backward
    node (recorded by the nested dropout) goes whole; a 2x speed-up takes half that time out.
    Fusing the math path keeps only its matmuls (and the backward GEMM nodes)."""
    q = torch.randn(2, 4, 64, 16, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.5).sum().backward()
    prof.export_chrome_trace(str(tmp_path / "sdpa.json"))
    trace = import_torch_profiler(tmp_path / "sdpa.json")[0]
    (attn,) = [e for e in trace.events if e.op == "aten::scaled_dot_product_attention"]
    inner = sum(s for name, depth, s in attn.tags["nested"] if name == "aten::dropout")
    assert 0 < inner < attn.end - attn.start
    nodes = [e for e in trace.events if "aten::dropout" in e.tags.get("forward", ())]
    assert nodes and all(e.tags["forward"][0] == "aten::scaled_dot_product_attention" for e in nodes)
    cpu = load_profile("cpu")
    for whatif, taken in [(WhatIf(remove=("aten::dropout",)), inner), (WhatIf(speedup={"aten::dropout": 2.0}), inner / 2)]:
        after = {e.task_id: e for e in whatif.apply(trace, cpu, False).events}
        assert after[attn.task_id].end - after[attn.task_id].start == pytest.approx(attn.end - attn.start - taken)
    removed = {e.task_id: e for e in WhatIf(remove=("aten::dropout",)).apply(trace, cpu, False).events}
    assert all(removed[e.task_id].end == removed[e.task_id].start for e in nodes)
    # the math path fused (as a flash kernel): only its matmuls stay, forward and backward alike
    nested = attn.tags["nested"]
    (math,) = [(i, s) for i, (name, _, s) in enumerate(nested) if name == "aten::_scaled_dot_product_attention_math"]
    gemms = sum(s for name, depth, s in nested[math[0]:] if name == "aten::matmul" and depth == 2)
    assert 0 < gemms < math[1]
    for whatif in (WhatIf(fuse=("*attention_math",)), WhatIf(fuse=("*attention_math",), remove=("aten::dropout",))):
        fused = {e.task_id: e for e in whatif.apply(trace, cpu, False).events}
        assert fused[attn.task_id].end - fused[attn.task_id].start == pytest.approx(attn.end - attn.start - math[1] + gemms)
        backward = [e for e in trace.events if "aten::_scaled_dot_product_attention_math" in e.tags.get("forward", ())]
        assert {e.engine for e in backward} >= {"cube", "vector"}
        for e in backward:
            kept = fused[e.task_id].end - fused[e.task_id].start
            assert kept == (e.end - e.start if e.engine == "cube" else 0.0)


def test_ranks_sharing_the_host_share_its_cores():
    """The ``cpu`` profile's 2 cores: a GEMM and an all-reduce that ran side by side, then an
    add. Alone or beside one more rank, each task has its core; four ranks give each two."""
    trace = Trace([TraceEvent(0, "mm", "mm", "cube", 0, 0, 0.0, 10e-6),
                   TraceEvent(1, "ar", "all_reduce", "comm", 0, 0, 0.0, 10e-6),
                   TraceEvent(2, "add", "add", "vector", 0, 0, 10e-6, 14e-6, deps=[0, 1])], {"profile": "cpu"})
    for n, span in [(1, 14), (2, 24), (4, 48)]:  # 2 ranks: mm and ar at half speed (20 us), then add (4 us)
        assert replay(trace, whatif=WhatIf(host_ranks=n)).trace.makespan == pytest.approx(span * 1e-6)
    no_cores = dataclasses.replace(load_profile("cpu"), contention=None)
    with pytest.raises(ConfigError, match="has no contention section"):
        replay(trace, recorded_profile=no_cores, whatif=WhatIf(host_ranks=2))


def _moe_rank(rank: int, world: int) -> list[TraceEvent]:
    """One rank's MoE step at expert-parallel degree 1, as the importer gives it: a router op, the
    experts' GEMM (tokens [8, 64, 256] x weights [8, 256, 512]) and its backward under ``experts``
    (the weight's gradient accumulated in between), the experts' gradient all-reduce (issued under
    ``experts.grad_sync``, run on gloo's thread), then the optimizer."""
    gemm = ["aten::bmm", [[8, 64, 256], [8, 256, 512]], ["float", "float"], ["", ""]]
    ms, main = 1e-3, {"thread": 1}

    def ev(i, op, engine, t0, t1, deps=(), scope=None, **tags):
        anns = {"annotations": [scope]} if scope else {}
        return TraceEvent(i, f"{op}#{i}", op, engine, 0, rank, t0 * ms, t1 * ms, deps=list(deps), tags={**main, **anns, **tags})

    return [ev(0, "aten::linear", "vector", 0, 1, **{"class": "cpu_op"}),
            ev(1, "aten::bmm", "cube", 1, 3, [0], "experts", sources=[gemm], **{"class": "cpu_gemm"}),
            ev(2, "aten::index_add", "vector", 3, 4, [1], **{"class": "cpu_op"}),
            ev(3, "autograd::engine::evaluate_function: BmmBackward0", "cube", 4, 8, [2], "experts",
               sources=[gemm], **{"class": "cpu_gemm"}),
            ev(4, "autograd::engine::evaluate_function: torch::autograd::AccumulateGrad", "vector", 8, 8.5, [3],
               grad_bytes=4.0 * 2**20, **{"class": "cpu_op"}),
            ev(5, "autograd::engine::evaluate_function: LinearBackward0", "vector", 8.5, 9, [4], **{"class": "cpu_op"}),
            ev(6, "c10d::allreduce_", "host", 9, 9.2, [5], "experts.grad_sync", **{"class": "runtime"}),
            TraceEvent(7, "gloo:all_reduce#7", "all_reduce", "comm", 0, rank, 9.2e-3, 13e-3, comm_bytes=4.0 * 2**20,
                       deps=[6], tags={"thread": 2, "class": "cpu_comm", "annotations": ["experts.grad_sync"]}),
            ev(8, "aten::_foreach_add_", "vector", 13, 14, [6, 7], **{"class": "cpu_op"})]


def test_ep_what_if_trades_the_experts_gradient_all_reduce_for_all_to_alls():
    """Degree 1 -> 2 on 2 ranks: the experts' gradients stay on their rank (their all-reduce and
    the call issuing it gone), the tokens go to the experts' ranks and back around the experts'
    forward and again around their backward (4 all-to-alls of half the token buffer each, on
    the alpha-beta link), and each rank's expert GEMMs keep their work (as many tokens, in
    fewer, larger GEMMs)."""
    prof = load_profile("cpu")
    trace = Trace(_moe_rank(0, 2) + _moe_rank(1, 2), {"profile": "cpu", "world_size": 2, "source": "kineto"})
    out = WhatIf(ep=2, scope=("experts",)).apply(trace, prof, True)
    for r in (0, 1):
        mine = {e.task_id: e for e in out.events if e.rank == r}
        a2a = sorted((e for e in mine.values() if e.op == "all_to_all"), key=lambda e: e.start)
        wire = 8 * 64 * 256 * 4 / 2  # float tokens, half of them to the other rank
        alpha, beta = prof.link("intra")
        assert [e.comm_bytes for e in a2a] == [wire] * 4
        assert [e.duration for e in a2a] == pytest.approx([alpha + prof.task_overhead + wire / beta] * 4)
        assert [e.tags["seq"] for e in a2a] == [1, 2, 3, 4]  # matched across ranks by group and order
        # each waits for what preceded its boundary; the task on the far side waits for it
        assert [e.deps for e in a2a] == [[0], [1], [2], [4]]
        assert [a2a[0].task_id in mine[1].deps, a2a[1].task_id in mine[2].deps,
                a2a[2].task_id in mine[3].deps, a2a[3].task_id in mine[5].deps] == [True] * 4
        assert mine[6].duration == mine[7].duration == 0.0  # no gradient all-reduce, nor its call
        assert mine[1].duration == pytest.approx(2e-3) and mine[3].duration == pytest.approx(4e-3)
    span = replay(trace, recorded_profile=prof).trace.makespan
    changed = replay(trace, recorded_profile=prof, whatif=WhatIf(ep=2, scope=("experts",))).trace.makespan
    assert span == pytest.approx(14e-3) and changed == pytest.approx(span - 4e-3 + 4 * a2a[0].duration, rel=1e-6)


def test_ep_what_if_resizes_the_experts_data_parallel_group():
    """Degree 2 on 4 ranks: the experts' gradient all-reduce runs over the 2 ranks holding the same
    experts, its wire bytes 2 (n-1)/n for n = 2 instead of 4 (alpha kept); the dense work stays."""
    prof = load_profile("cpu")
    trace = Trace([e for r in range(4) for e in _moe_rank(r, 4)], {"profile": "cpu", "world_size": 4})
    out = {(e.rank, e.task_id): e for e in WhatIf(ep=2, scope=("experts",)).apply(trace, prof, True).events}
    alpha, d = prof.link("intra")[0], 3.8e-3
    assert out[0, 7].duration == pytest.approx(alpha + (d - alpha) * (1.0 / 1.5))
    assert out[0, 6].duration == pytest.approx(0.2e-3) and out[0, 0].duration == pytest.approx(1e-3)
    assert out[0, 1].duration == pytest.approx(2e-3)  # each rank's experts: as many tokens, as much work
    with pytest.raises(ConfigError, match="no GEMM with shapes"):
        WhatIf(ep=2, scope=("experts",)).apply(Trace([e for e in trace.events if e.op != "aten::bmm" and "Bmm" not in e.op],
                                                      trace.meta), prof, True)
