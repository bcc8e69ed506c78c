"""MXFP8Linear and MXFP8GroupedExperts: accuracy against bf16, saved-tensor memory, a short training run."""
import pytest
import torch
from torch import nn

from megaloom.ops.mxfp8 import GroupedExperts, MXFP8GroupedExperts, MXFP8Linear
from megaloom.runtime.errors import ConfigError

TOL = 0.08  # documented in docs/mxfp8.md: relative Frobenius error vs bf16 of outputs and grads, one GEMM
TOL_MLP = 0.12  # two quantised GEMMs in a row (gate/up, then down)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def saved_bytes(fn, params=()) -> int:
    """Bytes of the distinct storages autograd saves while ``fn`` runs, the storage of
    ``params`` (there anyway, and shared by their views) left out."""
    own = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in own:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


@pytest.mark.parametrize("mode", ["floor", "rceil"])
def test_linear_matches_bf16_forward_and_backward(mode):
    lin = nn.Linear(128, 96).bfloat16()
    mx = MXFP8Linear.from_float(lin, scale_mode=mode)
    x = torch.randn(3, 25, 128, dtype=torch.bfloat16, requires_grad=True)  # 75 tokens: padded to 96 inside
    y, y0 = mx(x), lin(x)
    assert y.shape == y0.shape and y.dtype == torch.bfloat16
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, (x, lin.weight, lin.bias), dy)
    want = torch.autograd.grad(y0, (x, lin.weight, lin.bias), dy)
    assert rel(y, y0) < TOL
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype and rel(g, w) < TOL
    assert rel(got[2], want[2]) < 1e-2  # the bias gradient is high precision


@pytest.mark.parametrize("m,k,n", [(64, 256, 128), (8, 512, 512), (20, 64, 32), (4096, 64, 32)])
def test_linear_saves_only_what_backward_needs(m, k, n):
    """Column-wise X in FP8 (plus one E8M0 scale per 32, tokens padded to 32) for dW, or X
    itself where that is smaller; the weight Parameter itself (no copy) for dX. bf16
    nn.Linear saves X and the weight Parameter."""
    x = torch.randn(m, k, dtype=torch.bfloat16, requires_grad=True)
    lin = nn.Linear(k, n).bfloat16()
    mx = MXFP8Linear.from_float(lin)
    params = list(lin.parameters())
    for_dw = min(-(-m // 32) * 32 * k * 33 // 32, 2 * m * k)
    bf16 = saved_bytes(lambda: lin(x), params)
    assert bf16 == 2 * m * k
    assert saved_bytes(lambda: mx(x), params) == for_dw <= (0.52 if m % 32 == 0 else 1) * bf16
    assert saved_bytes(lambda: mx(x)) == for_dw + 2 * n * k  # and the weight, as it is
    lin.weight.requires_grad_(False)
    assert saved_bytes(lambda: mx(x), params) == 0  # only the weight
    lin.weight.requires_grad_(True)
    assert saved_bytes(lambda: mx(x.detach()), params) == for_dw  # only X
    with torch.no_grad():
        assert saved_bytes(lambda: mx(x)) == 0


def test_grouped_experts_save_less_than_bf16():
    t, dim, hidden = 100, 64, 96
    ref = GroupedExperts(4, dim, hidden).bfloat16()
    mx = MXFP8GroupedExperts.from_float(ref)
    x = torch.randn(t, dim, dtype=torch.bfloat16, requires_grad=True)
    params = list(ref.parameters())
    for offs, padded in (([21, 21, 80, 100], 128), ([1, 2, 3, 100], 224)):  # groups padded to 32 rows each
        bf16 = saved_bytes(lambda: ref(x, offs), params)
        assert bf16 == 2 * t * dim + 4 * 2 * t * hidden  # x; per expert gate, silu(gate), up, h
        got = saved_bytes(lambda: mx(x, offs), params)
        # x and h for dW (column-wise FP8, or themselves where smaller); gate_up (silu's input
        # and mul's up) and silu(gate)
        for_dw = sum(min(padded * d * 33 // 32, 2 * t * d) for d in (dim, hidden))
        assert got == for_dw + 2 * t * 2 * hidden + 2 * t * hidden <= bf16


def test_from_float_shares_parameters_and_checks_dims():
    lin = nn.Linear(64, 32, bias=False)
    mx = MXFP8Linear.from_float(lin)
    assert mx.weight is lin.weight and mx.bias is None
    assert list(mx.state_dict()) == list(lin.state_dict())
    with pytest.raises(ConfigError, match="in_features=40"):
        MXFP8Linear.from_float(nn.Linear(40, 32))
    with pytest.raises(ConfigError, match="out_features=48"):
        MXFP8Linear(64, 48)


def test_grouped_experts_match_reference():
    torch.manual_seed(1)
    ref = GroupedExperts(4, 64, 96).bfloat16()
    mx = MXFP8GroupedExperts.from_float(ref)
    assert all(getattr(mx, n) is getattr(ref, n) for n in ("w_gate", "w_up", "w_down"))
    offs = torch.tensor([21, 21, 80, 100])  # uneven groups, one empty
    x = torch.randn(100, 64, dtype=torch.bfloat16, requires_grad=True)
    y, y0 = mx(x, offs), ref(x, offs)
    assert rel(y, y0) < TOL_MLP
    dy = torch.randn_like(y)
    params = (x, ref.w_gate, ref.w_up, ref.w_down)
    got, want = torch.autograd.grad(y, params, dy), torch.autograd.grad(y0, params, dy)
    for g, w in zip(got, want):
        assert g.shape == w.shape and rel(g, w) < TOL_MLP
    assert (got[1][1] == 0).all() and (got[3][1] == 0).all()  # empty expert: zero gradients
    with pytest.raises(ConfigError, match="hidden=40"):
        MXFP8GroupedExperts(2, 64, 40)


def test_tiny_mlp_trains_like_bf16():
    def run(mx: bool) -> float:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
        if mx:
            model[0], model[2] = MXFP8Linear.from_float(model[0]), MXFP8Linear.from_float(model[2])
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        g = torch.Generator().manual_seed(1)
        teacher = torch.randn(64, 64, generator=g) / 8
        losses = []
        for _ in range(100):
            x = torch.randn(64, 64, generator=g)
            target = torch.tanh(x @ teacher) * 2
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not mx):
                y = model(x.bfloat16())
            loss = (y.float() - target).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert sum(losses[-10:]) / 10 < 0.25 * losses[0]  # it did learn
        return sum(losses[-10:]) / 10

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: one thread is fastest, and robust on a shared machine
    try:
        bf16, mx = run(False), run(True)  # about 3 s together on an idle 2-core VM
    finally:
        torch.set_num_threads(threads)
    assert abs(mx - bf16) / bf16 < 0.05
