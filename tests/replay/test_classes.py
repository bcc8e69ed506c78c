"""The class table: every row has real kernel names that land on it, and names that must not."""
import pytest

from megaloom.scheduler.importers import import_torch_profiler
from megaloom.scheduler.importers.kineto.classes import (
    CPU_CLASSES, DEVICE_CLASSES, collective, cpu_class, device_class, sync_kind,
)

from .kineto import call, cpu, kernel, write

DEVICE_EXAMPLES = {
    "memcpy": [("Memcpy HtoD (Pageable -> Device)", "gpu_memcpy"), ("Memcpy DtoD (Device -> Device)", "gpu_memcpy")],
    "memset": [("Memset (Device)", "gpu_memset")],
    "rccl": ["void rcclGenericKernel<1, false>(ncclDevComm*, unsigned long, ncclWork*)"],
    "nccl": ["ncclKernel_AllReduce_RING_LL_Sum_float(ncclWorkElem)", "ncclDevKernel_Generic_4(ncclDevKernelArgsStorage<4096ul>)",
             "ncclDevKernel_SendRecv(ncclDevComm*, unsigned long, ncclWork*)"],
    "gloo": ["gloo::cuda_allreduce_ring_chunked"],
    "deepep": ["void deep_ep::intranode::dispatch<8, 768, 8192>(int4*, float*)", "void ep::internode::combine<true>(void*)",
               "void deep_ep::intranode::notify_dispatch<8>(int const*, int*)"],
    "nvshmem": ["nvshmemi_transfer_rma_nbi_kernel", "void nvshmem_putmem_block(void*)"],
    "hccl": ["HcclAllReduce_ring_kernel"],
    "flash": ["void flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>(Flash_fwd_params)",
              "fmha_cutlassF_f16_aligned_64x64_rf_sm80", "void pytorch_flash::flash_bwd_dq_dk_dv_loop_kernel<>()"],
    "cutlass": ["cutlass_80_tensorop_s1688gemm_128x128_16x4_nn_align4", "void cutlass::Kernel<cutlass_80_wmma_tensorop_h161616gemm>()"],
    "rocblas": ["Cijk_Alik_Bljk_SB_Bias_AS_SAV_UserArgs_MT64x16x32_MI16x16x1_SN", "Cijk_Ailk_Bjlk_HHS_BH_MT128x128x32",
                "void rocblas_gemvn_kernel<64, 16>()", "void rocblas_gemm_batched_kernel<float, 16, 16>()"],
    "simt_gemm": ["volta_sgemm_64x64_nt", "ampere_sgemm_128x64_nn", "void gemv2T_kernel_val<int, int, float, float>()",
                  "void gemmk1_kernel<int, float, 256, 5>()", "void gemmSN_TN_kernel<float, 128, 16>()",
                  "void cudnn::detail::implicit_convolve_sgemm<float, float, 128, 5, 5>()", "dgemm_largek_lds64"],
    "wgmma": ["sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel",
              "wgmma_gemm_128x128"],
    "xmma": ["sm80_xmma_gemm_f16f16_f16f32_f32_nn_n_tilesize128x128x32", "void xmma_cudnn::gemm::kernel<>()"],
    "cublas": ["volta_h884gemm_128x128_ldg8_nn", "ampere_s16816gemm_fp16_128x128_ldg8_f2f_stages_32x5_nn",
               "void cublasLt::splitKreduce_kernel<32, 16, int, float>()", "ampere_bf16_s16816gemm_bf16_256x128_ldg8_f2f_nn"],
    "cudnn": ["cudnn_infer_volta_scudnn_128x64_relu_medium_nn_v1", "void cudnn::detail::dgrad_engine<float, 512, 6>()",
              "void wgrad_alg0_engine<float, 128, 6, 7, 3, 3, 5, false, 512>()",
              "void cudnn::winograd_nonfused::winogradForwardData4x4<float, float>()",
              "void cudnn::cnn::conv2d_grouped_direct_kernel_fprop()"],
    "kernel": ["void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>()",
               "void cudnn::bn_fw_tr_1C11_kernel_NCHW<float, float, int, 32>()", "cask_cudnn_infer::computeOffsetsKernel",
               "void at::native::reduce_kernel<512, 1>()", "triton_poi_fused_add_0"],
}
CPU_EXAMPLES = {
    "cpu_comm": ["c10d::allreduce_", "gloo:all_reduce", "nccl:all_gather"],
    "cpu_gemm": ["aten::mm", "aten::addmm", "aten::linear", "aten::conv2d", "aten::convolution", "aten::bmm"],
    "cpu_op": ["aten::softmax", "aten::add", "aten::sum", "aten::mmap_like"],
}


def _cases(examples):
    for label, names in examples.items():
        for n in names:
            name, cat = n if isinstance(n, tuple) else (n, "kernel")
            yield pytest.param(label, name, cat, id=f"{label}:{name[:30]}")


def test_every_row_of_the_tables_has_examples():
    assert [c.label for c in DEVICE_CLASSES] == list(DEVICE_EXAMPLES)
    assert [c.label for c in CPU_CLASSES] == list(CPU_EXAMPLES)


@pytest.mark.parametrize("label, name, cat", list(_cases(DEVICE_EXAMPLES)))
def test_device_class(label, name, cat):
    c = device_class(name, cat)
    assert c.label == label, (name, c.label)


@pytest.mark.parametrize("label, name, cat", list(_cases(CPU_EXAMPLES)))
def test_cpu_class(label, name, cat):
    assert cpu_class(name).label == label


def test_engines_by_row():
    engines = {c.label: c.engine for c in DEVICE_CLASSES}
    assert {k for k, v in engines.items() if v == "comm"} == {"nccl", "rccl", "gloo", "deepep", "nvshmem", "hccl"}
    assert {k for k, v in engines.items() if v == "cube"} == {"flash", "cutlass", "wgmma", "xmma", "cublas", "cudnn", "rocblas"}
    assert engines["memcpy"] == engines["memset"] == "copy"


def test_host_side_events_are_host_never_compute(tmp_path):
    events = [cpu("ProfilerStep#1", 0, 100, cat="user_annotation"), cpu("aten::mm", 1, 20),
              call("cudaLaunchKernel", 2, 5, 1), cpu("c10d::allreduce_", 30, 20), call("cudaMemcpyAsync", 31, 5, 2),
              kernel("volta_h884gemm_128x128_ldg8_nn", 10, 5, 1), kernel("Memcpy HtoD", 40, 5, 2, cat="gpu_memcpy")]
    trace, _ = import_torch_profiler(write(tmp_path / "t.json", events))
    assert {e.task: e.engine for e in trace.events} == {  # the CPU ops and the annotation are context, not tasks
        "cudaLaunchKernel": "host", "cudaMemcpyAsync": "host", "thread end": "host",
        "volta_h884gemm_128x128_ldg8_nn": "cube", "Memcpy HtoD": "copy"}


@pytest.mark.parametrize("name, kind", [
    ("cudaDeviceSynchronize", "device"), ("hipDeviceSynchronize", "device"), ("cudaStreamSynchronize", "stream"),
    ("cudaEventSynchronize", "event"), ("cudaMemcpy", "copy"), ("hipMemcpyWithStream", "copy"),
    ("cudaStreamWaitEvent", "wait"), ("cudaMemcpyAsync", None), ("cudaLaunchKernel", None), ("cudaEventRecord", None),
])
def test_sync_calls(name, kind):
    assert sync_kind(name) == kind


@pytest.mark.parametrize("name, kind", [
    ("ncclKernel_AllReduce_RING_LL_Sum_float", "all_reduce"), ("allgather_into_tensor_coalesced", "all_gather"),
    ("_reduce_scatter_base", "reduce_scatter"), ("all_to_allv", "all_to_all"), ("ncclDevKernel_Broadcast_RING_LL", "broadcast"),
    ("ncclDevKernel_SendRecv", "send_recv"), ("deep_ep::intranode::dispatch", "all_to_all"), ("ncclDevKernel_Generic_4", None),
])
def test_collective_kinds(name, kind):
    assert collective(name) == kind
