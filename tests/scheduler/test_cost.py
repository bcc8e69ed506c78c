import pytest

from megaloom.runtime import Cost, TaskGraph
from megaloom.runtime.errors import ConfigError
from megaloom.scheduler import CostModel, OpCoeffs, load_profile


@pytest.fixture
def cm():
    return CostModel("ascend-910b")


def test_compute_bound_roofline(cm):
    p = cm.profile
    c = Cost(flops=2 * 1024 ** 3, bytes=3 * 1024 * 1024 * 2, precision="bf16")
    expect = c.flops / (p.peak("cube", "bf16") / 24) + p.task_overhead
    assert c.flops / (p.peak("cube", "bf16") / 24) > c.bytes / (p.mem_bw / 24)
    assert cm.duration(c, "cube") == pytest.approx(expect, rel=1e-12)


def test_memory_bound_roofline(cm):
    p = cm.profile
    c = Cost(flops=1e6, bytes=64e6, precision="fp32")
    expect = 64e6 / (p.mem_bw / 48) + p.task_overhead
    assert cm.duration(c, "vector") == pytest.approx(expect, rel=1e-12)


def test_empty_task_costs_the_overhead(cm):
    assert cm.duration(Cost(), "vector") == cm.profile.task_overhead


def test_precision_picks_the_rate():
    cm = CostModel("ascend-950")
    fp8 = cm.duration(Cost(flops=1e12, precision="mxfp8"), "cube")
    bf16 = cm.duration(Cost(flops=1e12, precision="bf16"), "cube")
    assert bf16 - cm.profile.task_overhead == pytest.approx(2 * (fp8 - cm.profile.task_overhead))


def test_comm_alpha_beta_per_link(cm):
    p = cm.profile
    for link in ("intra", "inter"):
        a, b = p.link(link)
        got = cm.duration(Cost(comm_bytes=8e6), "comm", link)
        assert got == pytest.approx(a + 8e6 / (b / p.units["comm"]) + p.task_overhead, rel=1e-12)
    assert cm.duration(Cost(comm_bytes=8e6), "comm", "inter") > cm.duration(Cost(comm_bytes=8e6), "comm", "intra")


def test_comm_link_from_task_tags_and_measured_duration(cm):
    g = TaskGraph("c")
    g.task("noop", engine="comm", cost=Cost(comm_bytes=1e6))
    g.task("noop", engine="comm", cost=Cost(comm_bytes=1e6), tags={"link": "inter"})
    g.task("noop", engine="cube", cost=Cost(flops=1e15), attrs={"duration": 0.125})
    d = cm.durations(g)
    assert d[0] == cm.duration(Cost(comm_bytes=1e6), "comm", "intra")
    assert d[1] == cm.duration(Cost(comm_bytes=1e6), "comm", "inter") > d[0]
    assert d[2] == 0.125
    bad = g.task("noop", engine="cube", attrs={"duration": "slow"})
    with pytest.raises(ConfigError, match=f"task {bad.name!r}"):
        cm.task_duration(g, bad)


def test_overrides_per_op_class():
    p = load_profile("ascend-910b")
    cm = CostModel(p, overrides={"matmul": (1e12, 5e-6), "all_to_all": OpCoeffs(throughput=1e9, overhead=0.0)})
    c = Cost(flops=1e9, bytes=1.0, precision="bf16")
    assert cm.duration(c, "cube", op="matmul") == pytest.approx(1e9 / 1e12 + 5e-6)
    assert cm.duration(c, "cube", op="silu") == CostModel(p).duration(c, "cube")
    assert cm.duration(Cost(comm_bytes=2e9), "comm", op="all_to_all") == pytest.approx(2.0)
    assert CostModel(p, overrides={"x": {"mem_bw": 1e6}}).duration(Cost(bytes=1e6), "vector", op="x") == \
        pytest.approx(1.0 + p.task_overhead)
    with pytest.raises(ConfigError, match="op 'matmul'"):
        CostModel(p, overrides={"matmul": (-1.0, 0.0)})
    with pytest.raises(ConfigError, match="op 'matmul'"):
        CostModel(p, overrides={"matmul": "fast"})
    with pytest.raises(ConfigError, match="op 'matmul': throughput must be a positive finite number, got nan"):
        CostModel(p, overrides={"matmul": (float("nan"), 0.0)})
    with pytest.raises(ConfigError, match=r"op 'matmul' must be OpCoeffs, .* got \{'flops': "):
        CostModel(p, overrides={"matmul": {"flops": 1e12}})


# -- fused DVM nodes ----------------------------------------------------------------------
ASCEND = ("ascend-910b", "ascend-950", "atlas-a3")


def _chain(prog):
    """The unfused chain a fused program replaces: one primitive task per instruction."""
    g = TaskGraph("chain")
    vals = [g.input(f"in{i}", s, d) for i, (s, d) in enumerate(prog.inputs)]
    n_in = len(prog.inputs)
    for k, ins in enumerate(prog.code):
        shape, dtype = prog.specs[n_in + k]
        out = (g.output if n_in + k in prog.outputs else g.buffer)(f"v{n_in + k}", shape, dtype)
        g.task(f"dvm.{ins.op}", [vals[a] for a in ins.args], [out], attrs=ins.attr_dict)
        vals.append(out)
    return g


@pytest.mark.parametrize("profile", ASCEND)
@pytest.mark.parametrize("which", ["swiglu", "swiglu_backward"])
def test_a_fused_swiglu_tile_simulates_faster_than_its_unfused_chain(profile, which):
    from megaloom.ops import dvm
    from megaloom.scheduler import Simulator

    prog = getattr(dvm.library, which)((128, 256), "bfloat16")
    chain = _chain(prog)
    fused = dvm.fuse(chain, dvm.Limits(max_ops=16, max_cost=32.0))  # the whole program: one node
    assert [t.op for t in fused.tasks] == ["dvm.fused"]
    sim = Simulator(profile)
    t_chain, t_fused = sim.run(chain).trace, sim.run(fused).trace
    assert len(t_fused.events) == 1 and t_fused.events[0].op == "dvm.fused"  # one task in the trace
    assert len(t_chain.events) == len(prog.code)
    assert t_fused.makespan < t_chain.makespan
    cm = sim.cost_model
    (task,) = fused.tasks
    io = sum(b.nbytes for b in (*fused.inputs, *fused.outputs))
    assert fused.costs()[0].bytes == io  # intermediates never reach memory
    assert cm.task_duration(fused, task) == pytest.approx(
        max(io / cm.profile.unit_mem_bw("vector"), cm.compute(task)) + cm.profile.task_overhead)


def test_fused_compute_is_the_sum_of_its_primitives_at_their_own_rates():
    from megaloom.ops import dvm

    prog = dvm.library.gelu_tanh((64, 64))
    chain = _chain(prog)
    fused = dvm.fuse(chain)
    (task,) = fused.tasks
    cm = CostModel("ascend-910b")
    peak = cm.profile.unit_peak("vector", "fp32")
    assert cm.compute(task) == pytest.approx(sum(c.flops for c in chain.costs()) / peak)
    slow_tanh = CostModel("ascend-910b", overrides={"dvm.tanh": (1e6, None)})
    assert slow_tanh.compute(task) == pytest.approx(cm.compute(task) + 64 * 64 * (4 / 1e6 - 4 / peak))
    # a compute-bound fused node: its duration is its primitives' compute plus one overhead
    overhead = cm.profile.task_overhead
    assert slow_tanh.task_duration(fused, task) == pytest.approx(slow_tanh.compute(task) + overhead)
    fit = CostModel("ascend-910b", overrides={"dvm.fused": (1e9, 1e-6)})  # a fit of the fused class wins
    assert fit.task_duration(fused, task) == pytest.approx(max(prog.flops() / 1e9, fused.costs()[0].bytes /
                                                               cm.profile.unit_mem_bw("vector")) + 1e-6)
