"""Work figures of imported kernels, whole-chip costing across devices, and the what-if knobs."""
import pytest

from megaloom.runtime.registry import Cost
from megaloom.scheduler import CostModel, load_profile
from megaloom.scheduler.importers import import_torch_profiler
from megaloom.scheduler.importers.kineto.work import comm_work, copy_work, op_work
from megaloom.scheduler.replay import WhatIf, device_ratio, event_width, replay

from .kineto import by_name, call, cpu, kernel, write

GEMM = {"Input Dims": [[64], [128, 256], [256, 64]], "Input type": ["c10::BFloat16"] * 3}


def test_gemm_conv_and_elementwise_figures():
    mm = op_work("aten::addmm", GEMM)
    assert (mm.flops, mm.bytes, mm.precision) == (2 * 128 * 64 * 256, 2 * (128 * 256 + 256 * 64 + 128 * 64), "bf16")
    lin = op_work("aten::linear", {"Input Dims": [[8, 32], [16, 32], [16]], "Input type": ["float"] * 3})
    assert lin.flops == 2 * 8 * 16 * 32
    conv = op_work("aten::convolution", {"Input Dims": [[2, 3, 8, 8], [4, 3, 3, 3], [4], [], [], [], [], [], []],
                                          "Input type": ["float"] * 3 + ["ScalarList"] * 3 + ["Scalar"] * 3,
                                          "Concrete Inputs": ["", "", "", "[1, 1]", "[1, 1]", "[1, 1]", "False", "[0, 0]", "1"]})
    assert conv.flops == 2 * 2 * 4 * 8 * 8 * 3 * 3 * 3
    assert op_work("aten::convolution", {"Input Dims": [[2, 3, 8, 8], [4, 3, 3, 3]], "Input type": ["float"] * 2}) is None
    bwd = op_work("aten::convolution_backward", {"Input Dims": [[2, 4, 8, 8], [2, 3, 8, 8], [4, 3, 3, 3]],
                                                  "Input type": ["float"] * 3})
    assert bwd.flops == 2 * conv.flops
    add = op_work("aten::add", {"Input Dims": [[4, 8], [4, 8], []], "Input type": ["c10::Half", "c10::Half", "Scalar"]})
    assert (add.flops, add.bytes, add.precision) == (32, 3 * 32 * 2, "fp16")
    assert op_work("aten::add", {"Input Dims": [[], []], "Input type": ["Scalar", "Scalar"]}) is None


def test_collective_and_copy_figures():
    ar = comm_work("all_reduce", {"In msg nelems": 1000, "Out msg nelems": 1000, "dtype": "BFloat16", "Group size": 8}, None)
    assert (ar.comm_bytes, ar.bytes, ar.link) == (2 * 7 / 8 * 2000, 4000, "intra")
    ag = comm_work("all_gather", {"In msg nelems": 10, "Out msg nelems": 160, "dtype": "Float", "Group size": 16}, None)
    assert (ag.comm_bytes, ag.link) == (15 / 16 * 640, "inter")
    assert comm_work("all_reduce", {"In msg nelems": 10, "dtype": "Float"}, 1).comm_bytes == 0  # a world of one
    assert comm_work("all_reduce", {"dtype": "Float", "Group size": 2}, None) is None
    assert comm_work(None, {"In msg nelems": 10, "dtype": "Float", "Group size": 2}, None) is None
    assert (copy_work("Memcpy HtoD (Pinned -> Device)", {"bytes": 100}).comm_bytes, copy_work("Memset (Device)",
            {"bytes": 100}).bytes, copy_work("Memcpy DtoD (Device -> Device)", {"bytes": 100}).bytes) == (100, 100, 200)


def test_kernels_share_their_launching_ops_figures_by_duration(tmp_path):
    trace, rep = import_torch_profiler(write(tmp_path / "t.json", [
        cpu("aten::linear", 0, 20), cpu("aten::addmm", 1, 18, **GEMM),
        call("cudaLaunchKernel", 2, 2, 1), kernel("ampere_bf16_s16816gemm_bf16_128x64", 5, 30, 1, grid=[8, 4, 1]),
        call("cudaLaunchKernel", 6, 2, 2), kernel("void splitKreduce_kernel", 35, 10, 2),
        call("cudaLaunchKernel", 30, 2, 3), kernel("void unlaunched_shape_kernel", 46, 1, 3),
    ]))
    ev = {e.task: e for e in trace.events}
    gemm, red = ev["ampere_bf16_s16816gemm_bf16_128x64"], ev["void splitKreduce_kernel"]
    total = op_work("aten::addmm", GEMM)
    assert gemm.flops == pytest.approx(total.flops * 30 / 40) and red.flops == pytest.approx(total.flops * 10 / 40)
    assert gemm.precision == "bf16" and gemm.tags["blocks"] == 32 and gemm.engine == "cube"
    assert ev["void unlaunched_shape_kernel"].flops == 0 and (rep.with_work, rep.without_work) == (2, 1)


def test_whole_chip_costing_gives_per_kernel_ratios():
    a100, h100 = load_profile("a100"), load_profile("h100")
    from megaloom.runtime import TraceEvent

    gemm = TraceEvent(0, "g", "g", "cube", 0, 0, 0.0, 1e-3, flops=2e12, bytes=1e6, precision="bf16")
    copy = TraceEvent(1, "c", "c", "vector", 0, 0, 0.0, 1e-3, bytes=3e9)
    small = TraceEvent(2, "s", "s", "cube", 0, 0, 0.0, 1e-3, flops=2e12, bytes=1e6, precision="bf16", tags={"blocks": 4})
    r = device_ratio(a100, h100, whole_chip=True)
    want_gemm = CostModel(h100).duration(Cost(2e12, 1e6, 0, "bf16"), "cube", width=132) / \
        CostModel(a100).duration(Cost(2e12, 1e6, 0, "bf16"), "cube", width=108)
    assert r(gemm) == pytest.approx(want_gemm) and r(gemm) == pytest.approx(312 / 989, rel=0.01)  # compute-bound
    assert r(copy) == pytest.approx(1.555 / 3.35, rel=0.01)  # memory-bound: HBM ratio
    assert r(small) == pytest.approx((312 / 108) / (989 / 132), rel=0.01)  # 4 blocks: 4 SMs of each chip
    assert event_width(small, h100, True) == 4 and event_width(gemm, h100, True) == 132
    assert device_ratio(a100, h100, whole_chip=False)(gemm) == pytest.approx(r(small), rel=0.01)  # a megaloom tile: one SM


def test_link_bandwidth_and_class_what_ifs(tmp_path):
    trace, _ = import_torch_profiler(write(tmp_path / "t.json", [
        cpu("record_param_comms", 0, 5, **{"Collective name": "allreduce", "In msg nelems": 1 << 24,
                                           "Out msg nelems": 1 << 24, "dtype": "Float", "Group size": 2}),
        call("cudaLaunchKernel", 1, 2, 1), kernel("ncclKernel_AllReduce_RING_LL_Sum_float", 4, 1000, 1, stream=14),
        call("cudaLaunchKernel", 6, 2, 2), kernel("flash_fwd_kernel", 8, 100, 2),
    ]))
    a100 = load_profile("a100")
    alpha, beta = a100.link("intra")
    nbytes = 4 * (1 << 24)  # 2 (n-1)/n of the message for n = 2
    model = lambda b: alpha + a100.task_overhead + nbytes / b  # noqa: E731
    out = by_name(replay(trace, whatif=WhatIf(link_bandwidth=beta / 2)).trace)
    nccl = out["ncclKernel_AllReduce_RING_LL_Sum_float"]
    assert nccl[1] - nccl[0] == pytest.approx(1000 * model(beta / 2) / model(beta))
    out = by_name(replay(trace, whatif=WhatIf(speedup={"flash": 4}, comm_speedup=2)).trace)
    assert out["flash_fwd_kernel"] == (8, 33) and out["ncclKernel_AllReduce_RING_LL_Sum_float"] == (4, 504)
    with pytest.raises(Exception, match="speedup of 'flash'"):
        replay(trace, whatif=WhatIf(speedup={"flash": 0}))
