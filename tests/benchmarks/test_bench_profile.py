"""bench_profile's summary of a profiled run, on synthetic kernel intervals (no GPU needed)."""

import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [
    str(ROOT),
    str(ROOT / "benchmarks"),
]  # bench.py at the repo root, bench_profile.py in benchmarks/

from bench_profile import (  # noqa: E402
    CATEGORIES,
    IDLE,
    OTHER,
    busy_time,
    category,
    device_events,
    format_notes,
    format_table,
    idle_gaps,
    merged,
    summarize,
    work_and_calls,
)

FLASH_DECODE = (
    "void flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64, 128, 4, false, false, "
    "cutlass::bfloat16_t, Flash_kernel_traits<128, 64, 128, 4, cutlass::bfloat16_t> >, "
    "false, false, false, false, true, false, true, false>(flash::Flash_fwd_params)"
)
FLASH_COMBINE = (
    "void flash::flash_fwd_splitkv_combine_kernel<Flash_fwd_kernel_traits<128, 64, 128, 4, "
    "false, false, cutlass::bfloat16_t>, 4, 3, true>(flash::Flash_fwd_params)"
)
FLASH_PREFILL = (
    "void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, "
    "cutlass::bfloat16_t>, true, false, false, false, true, true, false, false>"
    "(flash::Flash_fwd_params)"
)


@pytest.mark.parametrize(
    "name,expected",
    [
        (FLASH_DECODE, "decode attention"),  # contains "cutlass", still attention
        (FLASH_COMBINE, "decode attention"),
        ("_decode_kernel", "decode attention"),
        ("_decode_reduce_kernel", "decode attention"),
        ("_gate_up_kernel", "MoE experts"),
        ("_down_kernel", "MoE experts"),
        ("_gate_up_fp8_kernel", "MoE experts"),
        ("_down_fp8_kernel", "MoE experts"),
        ("_select_experts_kernel", "MoE routing"),
        ("_scatter_kernel", "MoE routing"),
        ("_fp8_gemm_kernel", "FP8 linears"),
        ("_quantize_kernel", "FP8 linears"),
        ("_decode_fp8_kernel", "decode attention"),
        (FLASH_PREFILL, "prefill attention"),
        ("_prefill_kernel", "prefill attention"),
        ("_prefill_fp8_kernel", "prefill attention"),
        (
            "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas",
            "GEMMs",
        ),
        ("nvjet_tst_128x64_64x8_1x1_v_bz_coopA_TNN", "GEMMs"),
        (
            "void cutlass::Kernel2<"
            "cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>(Params)",
            "GEMMs",
        ),
        (
            "void cublasLt::splitKreduce_kernel<"
            "32, 16, int, float, __nv_bfloat16, float, false>(...)",
            "GEMMs",
        ),
        ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "norms / rotary / activation"),
        ("triton_poi_fused_cat_mul_silu_1", "norms / rotary / activation"),
        ("triton_per_fused_add_mean_2", "norms / rotary / activation"),
        ("_rope_store_kernel", "norms / rotary / activation"),
        ("_rms_norm_quant_kernel", "norms / rotary / activation"),
        ("_silu_mul_quant_kernel", "norms / rotary / activation"),
        ("_gumbel_argmax_kernel", "sampler"),
        ("_best_of_chunks_kernel", "sampler"),
        (
            "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
            "collectives",
        ),
        ("_one_shot_kernel", "collectives"),
        ("_one_shot_add_rms_norm_kernel", "collectives"),
        ("_add_rms_norm_kernel", "norms / rotary / activation"),
        ("_rms_norm_kernel", "norms / rotary / activation"),  # layers/few_rows.py
        ("_silu_mul_kernel", "norms / rotary / activation"),
        (
            "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, "
            "at::native::ArgMaxOps<float>, unsigned int, long, 4> >(...)",
            "sampler",
        ),
        (
            "void at::native::sbtopk::gatherTopK<c10::BFloat16, unsigned int, 2, false>(...)",
            "sampler",
        ),
        (
            "void at::native::mbtopk::radixFindKthValues<"
            "c10::BFloat16, unsigned int, unsigned int, 2>(...)",
            "sampler",
        ),
        ("void at_cuda_detail::cub::DeviceRadixSortOnesweepKernel<...>(...)", "sampler"),
        (
            "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, "
            "at::native::(anonymous namespace)::LogSoftMaxForwardEpilogue>(...)",
            "sampler",
        ),
        ("Memcpy HtoD (Pinned -> Device)", "copies"),
        ("Memset (Device)", "copies"),
        (
            "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, "
            "std::array<char*, 1ul> >(...)",
            OTHER,
        ),
    ],
)
def test_category(name, expected):
    assert category(name) == expected


def test_categories_are_distinct_and_lowercase():
    labels = [label for label, _ in CATEGORIES]
    assert len(set(labels)) == len(labels) and OTHER not in labels
    assert all(
        p == p.lower() for _, patterns in CATEGORIES for p in patterns
    )  # names are lowered, not patterns


@pytest.mark.parametrize(
    "intervals,expected",
    [
        ([], 0.0),
        ([(1.0, 2.0)], 1.0),
        ([(1.0, 2.0), (3.0, 3.5)], 1.5),  # a gap
        ([(3.0, 3.5), (1.0, 2.0)], 1.5),  # unsorted
        ([(1.0, 2.0), (1.5, 2.5)], 1.5),  # overlap
        ([(1.0, 4.0), (1.5, 2.0), (2.5, 3.0)], 3.0),  # nested
        ([(1.0, 2.0), (2.0, 3.0)], 2.0),  # touching
        ([(1.0, 2.0), (1.0, 2.0)], 1.0),  # identical
        ([(1.0, 1.0), (2.0, 2.25)], 0.25),  # empty interval
    ],
)
def test_busy_time(intervals, expected):
    assert busy_time(intervals) == expected


def test_summarize_overlaps_gaps_and_unknown_names():
    events = [
        ("_prefill_kernel", 10.0, 10.5),
        ("nvjet_tst_128x64", 10.25, 11.0),  # overlaps the prefill kernel on another stream
        ("Stream Sync", 11.0, 12.0),  # a wait, not work
        ("_decode_kernel", 12.0, 12.5),  # after a 1 s gap
        ("_decode_reduce_kernel", 12.5, 12.75),
        ("mystery_kernel", 13.0, 13.125),
        ("other_kernel", 13.125, 13.5),
        ("mystery_kernel", 13.5, 13.75),
        ("_gumbel_argmax_kernel", 13.75, 14.0),
    ]
    p = summarize(events, wall=5.0)
    assert p.times == {
        "decode attention": 0.75,
        "prefill attention": 0.5,
        "MoE experts": 0.0,
        "LoRA": 0.0,
        "MoE routing": 0.0,
        "FP8 linears": 0.0,
        "GEMMs": 0.75,
        "norms / rotary / activation": 0.0,
        "sampler": 0.25,
        "collectives": 0.0,
        "copies": 0.0,
        OTHER: 0.75,
    }
    assert list(p.times) == [label for label, _ in CATEGORIES] + [OTHER]
    assert p.counts["decode attention"] == 2 and p.counts[OTHER] == 3 and p.counts["copies"] == 0
    assert p.busy == 1.0 + 0.75 + 1.0  # [10, 11), [12, 12.75) and [13, 14); the sync left out
    assert p.idle == 5.0 - 2.75
    assert (p.first, p.last, p.span) == (10.0, 14.0, 4.0)
    assert p.top_other == [
        ("mystery_kernel", 0.375),
        ("other_kernel", 0.375),
    ]  # equal times: by name
    assert p.top_kernels[:3] == [
        ("nvjet_tst_128x64", 0.75, 1, 0.75, 0.75),
        ("_decode_kernel", 0.5, 1, 0.5, 0.5),
        ("_prefill_kernel", 0.5, 1, 0.5, 0.5),
    ]
    # calls of one name: the total, the count and the shortest and longest call
    assert ("mystery_kernel", 0.375, 2, 0.125, 0.25) in p.top_kernels and len(
        p.top_kernels
    ) == 7  # all but the sync
    events.append(("other_kernel", 14.0, 14.25))
    p = summarize(events, wall=5.0, num_other=1, num_top=2)
    assert p.top_other == [("other_kernel", 0.625)]
    assert p.top_kernels == [
        ("nvjet_tst_128x64", 0.75, 1, 0.75, 0.75),
        ("other_kernel", 0.625, 2, 0.25, 0.375),
    ]


def test_summarize_empty_and_clamped():
    p = summarize([], wall=2.0)
    assert p.busy == 0.0 and p.idle == 2.0 and p.span == 0.0 and p.top_other == []
    assert sum(p.times.values()) == 0.0
    # busy longer than the measured wall (clocks differ by a little): idle is 0, not negative
    assert summarize([("gemm", 0.0, 2.5)], wall=2.0).idle == 0.0
    with pytest.raises(ValueError, match="ends before it starts"):
        summarize([("gemm", 2.0, 1.0)], wall=2.0)


def test_idle_gaps_by_length_and_by_part():
    # busy [0, 1), [1.000004, 2), [2.00005, 5), [5.0005, 8), [8.002, 10): gaps of 4 us, 50 us,
    # 500 us and 2 ms; the span 0-10 s in tenths of 1 s
    busy = merged(
        [(0.0, 1.0), (1.000004, 2.0), (2.00005, 5.0), (5.0005, 8.0), (8.002, 10.0), (3.0, 4.0)]
    )
    assert busy == [(0.0, 1.0), (1.000004, 2.0), (2.00005, 5.0), (5.0005, 8.0), (8.002, 10.0)]
    by_length, by_part = idle_gaps(busy)
    assert [n for n, _ in by_length] == [1, 1, 1, 1]
    assert [t for _, t in by_length] == pytest.approx([4e-6, 50e-6, 500e-6, 2e-3])
    expected = [0.0] * 10
    expected[1], expected[2], expected[5], expected[8] = 4e-6, 50e-6, 500e-6, 2e-3
    assert by_part == pytest.approx(expected)
    # a gap across a border is split there: busy [0, 0.5) and [1.5, 2) over tenths of 0.2 s
    _, by_part = idle_gaps([(0.0, 0.5), (1.5, 2.0)])
    assert by_part == pytest.approx([0.0, 0.0, 0.1, 0.2, 0.2, 0.2, 0.2, 0.1, 0.0, 0.0])
    assert idle_gaps([]) == ([(0, 0.0)] * 4, [0.0] * 10)


def test_format_table():
    events = [
        ("_decode_kernel", 0.0, 2.0),
        ("nvjet_x", 2.0, 3.0),
        ("Memcpy DtoH (Device -> Pinned)", 3.0, 3.5),
        ("what_is_this", 3.5, 4.0),
    ]
    text = format_table(summarize(events, wall=5.0))
    lines = text.splitlines()
    assert lines[0] == "| | GPU time | share of wall | kernels |"
    assert "| decode attention | 2.00 s | 40.0% | 1 |" in lines
    assert "| GEMMs | 1.00 s | 20.0% | 1 |" in lines
    assert "| copies | 0.50 s | 10.0% | 1 |" in lines
    assert f"| {OTHER} | 0.50 s | 10.0% | 1 |" in lines
    assert f"| {IDLE} | 1.00 s | 20.0% | |" in lines
    assert not any(
        line.startswith("| prefill attention") for line in lines
    )  # empty categories left out
    assert [line.split(" | ")[0] for line in lines[2:6]] == [
        "| decode attention",
        "| GEMMs",
        "| copies",
        f"| {OTHER}",
    ]


def test_format_notes_lists_other_kernels_and_warns_on_sparse_coverage():
    notes = format_notes(summarize([("x" * 300, 0.0, 0.5)], wall=2.0), width=40)
    assert (
        "largest 'other' kernels:" in notes
        and ("x" * 37 + "...") in notes
        and "x" * 38 not in notes
    )
    assert "warning" in notes  # 0.5 s of events over a 2 s run
    notes = format_notes(
        summarize([("gemm", 0.0, 0.25), ("gemm", 0.5, 0.75), ("y" * 300, 1.0, 1.5)], wall=2.0),
        width=40,
    )
    lines = notes.splitlines()
    assert lines[:3] == [
        "largest kernels:",
        "     0.500 s         2 x 250000.00 us (250000.0-250000.0)  gemm",
        "     0.500 s         1 x 500000.00 us (500000.0-500000.0)  " + "y" * 37 + "...",
    ]
    notes = format_notes(summarize([("gemm", 0.0, 0.000025), ("gemm", 0.5, 0.5025)], wall=2.0))
    assert (
        "     0.003 s         2 x   1262.50 us       (25.0-2500.0)  gemm" in notes
    )  # unlike calls show
    notes = format_notes(summarize([("a", 0.0, 1.0), ("b", 1.00002, 2.0)], wall=2.0))
    assert (
        "idle gaps between kernels by length: < 10 us: 0 (0.000 s), 10-100 us: 1 (0.000 s),"
        in notes
    )
    notes = format_notes(
        summarize([("gemm", 10.25, 10.5), ("gemm", 11.5, 12.0)], wall=2.0), window=(10.0, 12.125)
    )
    assert "warning" not in notes
    assert (
        "first event +0.250 s after the profiled window opened, "
        "last event +0.125 s before it closed" in notes
    )


class FakeKinetoEvent:
    def __init__(self, name, device_type, device_index, start_ns, end_ns, annotation=False, corr=0):
        self._v = (name, device_type, device_index, start_ns, end_ns, annotation, corr)

    def correlation_id(self):
        return self._v[6]

    def is_user_annotation(self):
        return self._v[5]

    def name(self):
        return self._v[0]

    def device_type(self):
        return self._v[1]

    def device_index(self):
        return self._v[2]

    def start_ns(self):
        return self._v[3]

    def end_ns(self):
        return self._v[4]


def test_device_events_keeps_one_gpus_records():
    from torch.autograd import DeviceType

    raw = [
        FakeKinetoEvent("cudaLaunchKernel", DeviceType.CPU, 0, 0, 10),
        FakeKinetoEvent("_decode_kernel", DeviceType.CUDA, 0, 1_000_000_000, 1_500_000_000),
        FakeKinetoEvent("nvjet", DeviceType.CUDA, 1, 2_000_000_000, 3_000_000_000),
        FakeKinetoEvent("my range", DeviceType.CUDA, 0, 0, 5_000_000_000, annotation=True),
    ]
    assert device_events(raw, 0) == [("_decode_kernel", 1.0, 1.5)]
    assert device_events(raw, 1) == [("nvjet", 2.0, 3.0)]
    assert sorted(device_events(raw, 7)) == [("_decode_kernel", 1.0, 1.5), ("nvjet", 2.0, 3.0)]
    assert device_events(raw[:1], 0) == []


def test_work_and_calls_sorts_one_pass_of_events():
    from torch.autograd import DeviceType

    cpu, cuda = DeviceType.CPU, DeviceType.CUDA
    raw = [
        FakeKinetoEvent("cudaGraphLaunch", cpu, 0, 1_000, 2_000, corr=7),
        FakeKinetoEvent("@forward", cpu, 0, 500, 9_000),
        FakeKinetoEvent("aten::mm", cpu, 0, 600, 700),  # neither a call nor a label
        FakeKinetoEvent("_decode_kernel", cuda, 0, 3_000, 4_500, corr=7),
        FakeKinetoEvent("Memset (Device)", cuda, 0, 5_000, 5_100, corr=8),
        FakeKinetoEvent("@forward", cuda, 0, 500, 9_000, annotation=True),
    ]
    gpu, calls, labels = work_and_calls(raw, unit=1e-3, skip=("Memset (Device)",))
    assert gpu == [(3.0, 4.5, 7, "_decode_kernel")]
    assert calls == {7: (1.0, "cudaGraphLaunch")}
    assert labels == [(0.5, 9.0, "@forward")]
    assert work_and_calls(raw)[0][0][:2] == (3e-6, 4.5e-6)  # seconds by default


@pytest.mark.gpu  # skipped without a CUDA GPU (tests/conftest.py)
def test_gpu_profiler_records_this_gpus_kernels(tmp_path):
    """The real profiler: ten bf16 matmuls are GEMMs, and a 0.2 s sleep between them is idle."""
    from bench_profile import GpuProfiler

    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    a @ a  # cuBLAS initialised before the profiled region
    trace = tmp_path / "trace.json"
    with GpuProfiler(str(trace)) as profiler:
        start = time.perf_counter()
        for i in range(10):
            a @ a
            if i == 4:
                torch.cuda.synchronize()
                time.sleep(0.2)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    p = profiler.summary(wall)
    assert p.counts["GEMMs"] >= 10, (p.counts, p.top_other)
    assert 0 < p.times["GEMMs"] <= p.busy <= wall
    assert p.idle >= 0.2
    start, end = profiler.window  # the events' clock is the epoch clock of the window
    assert start - 0.05 <= p.first <= p.last <= end + 0.05, (start, p.first, p.last, end)
    assert trace.stat().st_size > 0
