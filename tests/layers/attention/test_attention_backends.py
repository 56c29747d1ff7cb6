"""The GPU attention backends against the torch reference, on the same inputs.

On the CPU the Triton kernels run under the Triton interpreter (TRITON_INTERPRET=1, which must be
set before triton is imported, so those cases run together in one subprocess: this file run as a
script). On a CUDA GPU the same cases run in bf16 for "triton" and "flash-attn", plus a CUDA-graph
capture of decode. Every case draws fresh random inputs; cache slots no sequence owns hold NaN, so a
kernel that reads past a sequence's context or through a padded block-table entry fails the
comparison.
"""

import importlib.util
import json

import pytest
import torch
from test_kv_store import rope_store_kvcache
from triton_interpreter import (
    results_under_interpreter,
    round_interpreter_casts_to_nearest,
    run_cases,
    squeeze_interpreter_loop_bounds,
)

from nanovllm.layers.attention.reference import TorchAttentionBackend
from nanovllm.utils.context import Context

HAS_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None

# (cached tokens, new tokens) per sequence
PREFILL_SEQS = [(0, 1), (0, 37), (0, 70)]
PREFIX_SEQS = [
    (32, 5),
    (16, 50),
    (0, 9),
    (48, 1),
]  # cached prefixes of whole blocks, one sequence without
CHUNKED_SEQS = [(5, 3), (23, 41), (70, 1), (0, 66)]  # a chunk continues mid-block
DECODE_LENS = [1, 16, 17, 100, 0, 33]  # 0: a padded row, as CUDA-graph replay leaves it


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    return ((out - ref).norm() / ref.norm()).item()


def poison_next_alloc(shape: tuple, dtype: torch.dtype, device: torch.device) -> None:
    """On the GPU, free a NaN tensor of this size so the caching allocator hands its memory to the
    next allocation of the same size: an output row a kernel forgets to write stays NaN."""
    if device.type == "cuda":
        torch.full(shape, float("nan"), dtype=dtype, device=device)


def paged_layout(
    lengths: list[int], block_size: int, device, spare_blocks: int = 3, extra_width: int = 2
):
    """Random, non-contiguous block ids for sequences of these lengths. Returns the per-sequence
    block lists, the int32 block tables padded with -1 (``extra_width`` more columns than needed)
    and the number of blocks in the cache (``spare_blocks`` of them owned by no sequence, block 0
    among them: a masked-off lane whose block id defaults to 0 reads NaN)."""
    needed = [-(-n // block_size) for n in lengths]
    num_blocks = sum(needed) + spare_blocks
    perm = (1 + torch.randperm(num_blocks - 1)).tolist()
    blocks, i = [], 0
    for n in needed:
        blocks.append(perm[i : i + n])
        i += n
    width = max(needed) + extra_width
    tables = torch.tensor(
        [b + [-1] * (width - len(b)) for b in blocks], dtype=torch.int32, device=device
    )
    return blocks, tables, num_blocks


def new_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype, device):
    """k_cache, v_cache as views of one NaN-filled tensor, like the model runner's layout."""
    kv = torch.full(
        (2, num_blocks, block_size, num_kv_heads, head_dim),
        float("nan"),
        dtype=dtype,
        device=device,
    )
    return kv[0], kv[1]


def qkv_views(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype, device):
    """q, k, v as strided views of one fused projection, as the model hands them over."""
    qkv = torch.randn(
        num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, device=device
    )
    q, k, v = qkv.split(
        [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1
    )
    return (
        q.view(-1, num_heads, head_dim),
        k.view(-1, num_kv_heads, head_dim),
        v.view(-1, num_kv_heads, head_dim),
    )


def check_prefill(
    backend, seqs, *, device, dtype, head_dim, block_size, num_heads=4, num_kv_heads=2
) -> dict:
    """Store the new tokens' K/V with ``backend`` (on top of a random cached prefix), then prefill;
    the same with the torch backend in float32. Returns the output's relative error and whether
    both caches agree exactly."""
    device = torch.device(device)
    scale = head_dim**-0.5
    cached = [c for c, _ in seqs]
    new = [n for _, n in seqs]
    totals = [c + n for c, n in seqs]
    blocks, tables, num_blocks = paged_layout(totals, block_size, device)
    k_cache, v_cache = new_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
    slots, cu_q, cu_k = [], [0], [0]
    for b, c, n in zip(blocks, cached, new):
        for p in range(c + n):
            slot = b[p // block_size] * block_size + p % block_size
            if p < c:  # the cached prefix, written by an earlier step
                k_cache.flatten(0, 1)[slot] = torch.randn(
                    num_kv_heads, head_dim, dtype=dtype, device=device
                )
                v_cache.flatten(0, 1)[slot] = torch.randn(
                    num_kv_heads, head_dim, dtype=dtype, device=device
                )
            else:
                slots.append(slot)
        cu_q.append(cu_q[-1] + n)
        cu_k.append(cu_k[-1] + c + n)
    context = Context(
        is_prefill=True,
        cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32, device=device),
        cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32, device=device),
        max_seqlen_q=max(new),
        max_seqlen_k=max(totals),
        slot_mapping=torch.tensor(slots, dtype=torch.int32, device=device),
        block_tables=tables if any(cached) else None,
    )
    q, k, v = qkv_views(sum(new), num_heads, num_kv_heads, head_dim, dtype, device)

    ref_k_cache, ref_v_cache = k_cache.clone(), v_cache.clone()
    reference = TorchAttentionBackend()
    reference.store_kvcache(k, v, ref_k_cache, ref_v_cache, context.slot_mapping)
    ref = reference.prefill(
        q.float(), k.float(), v.float(), ref_k_cache.float(), ref_v_cache.float(), context, scale
    )

    rope_store_kvcache(k, v, k_cache, v_cache, context.slot_mapping)  # the kernel backends' store
    poison_next_alloc(q.shape, dtype, device)
    out = backend.prefill(q, k, v, k_cache, v_cache, context, scale)
    cache_equal = all(
        torch.equal(a.nan_to_num(123.0), b.nan_to_num(123.0))
        for a, b in ((k_cache, ref_k_cache), (v_cache, ref_v_cache))
    )
    return {
        "rel_err": relative_error(out, ref),
        "cache_equal": cache_equal,
        "shape_ok": out.shape == q.shape,
    }


def decode_inputs(context_lens, *, device, dtype, head_dim, block_size, num_heads, num_kv_heads):
    """A filled paged cache (NaN outside every sequence's context), q as a strided view, and the
    decode context. The padded rows (context_len 0) get a block-table row of zeros and slot -1."""
    device = torch.device(device)
    blocks, tables, num_blocks = paged_layout([max(n, 1) for n in context_lens], block_size, device)
    k_cache, v_cache = new_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
    for i, (b, n) in enumerate(zip(blocks, context_lens)):
        if n == 0:
            tables[i] = 0
            continue
        slots = torch.tensor(
            [b[p // block_size] * block_size + p % block_size for p in range(n)], device=device
        )
        k_cache.flatten(0, 1)[slots] = torch.randn(
            n, num_kv_heads, head_dim, dtype=dtype, device=device
        )
        v_cache.flatten(0, 1)[slots] = torch.randn(
            n, num_kv_heads, head_dim, dtype=dtype, device=device
        )
    q = qkv_views(len(context_lens), num_heads, num_kv_heads, head_dim, dtype, device)[0]
    context = Context(
        is_prefill=False,
        slot_mapping=torch.full((len(context_lens),), -1, dtype=torch.int32, device=device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        block_tables=tables,
    )
    return q, k_cache, v_cache, context


def decode_reference(q, k_cache, v_cache, context, scale) -> torch.Tensor:
    """float32 torch attention for every row with a context; zeros for padded rows."""
    ref = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    keep = [i for i, n in enumerate(context.context_lens.tolist()) if n > 0]
    sub = Context(context_lens=context.context_lens[keep], block_tables=context.block_tables[keep])
    ref[keep] = TorchAttentionBackend().decode(
        q[keep].float(), k_cache.float(), v_cache.float(), sub, scale
    )
    return ref


def check_decode(
    backend, context_lens, *, device, dtype, head_dim, block_size, num_heads=4, num_kv_heads=2
) -> dict:
    """Relative error over the rows with a context; padded rows only need to be finite."""
    scale = head_dim**-0.5
    q, k_cache, v_cache, context = decode_inputs(
        context_lens,
        device=device,
        dtype=dtype,
        head_dim=head_dim,
        block_size=block_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
    )
    ref = decode_reference(q, k_cache, v_cache, context, scale)
    poison_next_alloc(q.shape, dtype, q.device)
    out = backend.decode(q, k_cache, v_cache, context, scale)
    keep = [i for i, n in enumerate(context_lens) if n > 0]
    return {
        "rel_err": relative_error(out[keep], ref[keep]),
        "padded_finite": bool(out.isfinite().all()),
        "shape_ok": out.shape == q.shape,
    }


def check_decode_quantized(
    backend, context_lens, *, device, dtype, head_dim, block_size, num_heads=4, num_kv_heads=2
) -> dict:
    """Decode with ``quantize=True`` (the input of an FP8 o_proj, one 128-channel group per head)
    against ``quantize_activation_groups`` of the plain decode output in the model's dtype: the same
    e4m3 bytes and scales; the rows padded to 16 with zeros of scale 1."""
    from nanovllm.quantization.fp8 import quantize_activation_groups

    q, k_cache, v_cache, context = decode_inputs(
        context_lens,
        device=device,
        dtype=dtype,
        head_dim=head_dim,
        block_size=block_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
    )
    scale = head_dim**-0.5
    out = backend.decode(q, k_cache, v_cache, context, scale)
    want_q, want_scales = quantize_activation_groups(out.flatten(1))
    n, m_out = len(context_lens), -(-len(context_lens) // 16) * 16
    poison_next_alloc(
        (num_heads, m_out), torch.float32, q.device
    )  # the scales: NaN where a kernel forgets one
    rows = backend.decode(q, k_cache, v_cache, context, scale, quantize=True)
    got_q = rows.q.view(torch.uint8)
    return {
        "layout": (rows.rows, rows.dtype, tuple(rows.q.shape), tuple(rows.scales.shape))
        == (n, dtype, (m_out, num_heads * head_dim), (num_heads, m_out)),
        "values_equal": torch.equal(got_q[:n], want_q.view(torch.uint8)),
        "scales_equal": torch.equal(rows.scales[:, :n].T, want_scales),
        "padding": bool(got_q[n:].eq(0).all() and rows.scales[:, n:].eq(1.0).all()),
        "scale_range": [want_scales.min().item(), want_scales.max().item()],
    }


def check_store(store, *, device, dtype, head_dim, block_size, num_kv_heads=2) -> dict:
    """Random distinct slots with some -1 among them: the cache ``store`` writes must equal the
    torch store's, exactly."""
    device = torch.device(device)
    num_blocks, num_tokens = 6, 40
    slots = torch.randperm(num_blocks * block_size)[:num_tokens].to(torch.int32)
    slots[torch.randperm(num_tokens)[:7]] = -1
    slots = slots.to(device)
    _, k, v = qkv_views(num_tokens, 4, num_kv_heads, head_dim, dtype, device)
    k_cache, v_cache = new_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
    ref_k_cache, ref_v_cache = k_cache.clone(), v_cache.clone()
    TorchAttentionBackend().store_kvcache(k, v, ref_k_cache, ref_v_cache, slots)
    store(k, v, k_cache, v_cache, slots)
    equal = all(
        torch.equal(a.nan_to_num(123.0), b.nan_to_num(123.0))
        for a, b in ((k_cache, ref_k_cache), (v_cache, ref_v_cache))
    )
    return {"cache_equal": equal}


# ---- CPU: the Triton kernels under the interpreter -----------------------------------------------


def small_tiles(num_splits: int):
    """The Triton backend with 16-key decode tiles, one pipeline stage."""
    from nanovllm.layers.attention.triton_backend import TritonAttentionBackend
    from nanovllm.layers.attention.triton_tiles import DecodeTile

    return TritonAttentionBackend(num_splits=num_splits, decode_tile=DecodeTile(16, 1))


CPU_DIMS = dict(device="cpu", dtype=torch.float32, head_dim=32, block_size=16)
CPU_TOL = 1e-5  # float32 on both sides
INTERPRETER_CASES = {
    "store_kvcache": lambda b: check_store(rope_store_kvcache, **CPU_DIMS),
    "prefill": lambda b: check_prefill(b, PREFILL_SEQS, **CPU_DIMS),
    "prefill_prefix": lambda b: check_prefill(b, PREFIX_SEQS, **CPU_DIMS),
    "chunked_prefill": lambda b: check_prefill(b, CHUNKED_SEQS, **CPU_DIMS),
    "prefill_mha": lambda b: check_prefill(
        b, CHUNKED_SEQS, num_heads=2, num_kv_heads=2, **CPU_DIMS
    ),
    "decode": lambda b: check_decode(b, DECODE_LENS, **CPU_DIMS),
    # 16-key tiles: several per sequence (the default tile covers these contexts at once) and per
    # split
    "decode_small_tiles": lambda b: check_decode(small_tiles(1), DECODE_LENS, **CPU_DIMS),
    "decode_split4": lambda b: check_decode(small_tiles(4), DECODE_LENS, **CPU_DIMS),
    "decode_group8": lambda b: check_decode(
        b, DECODE_LENS, num_heads=8, num_kv_heads=1, **CPU_DIMS
    ),
    # an FP8 o_proj's input: head_dim 128, one group per head; with splits the merge kernel
    # quantizes
    "decode_quantized": lambda b: check_decode_quantized(
        b, DECODE_LENS, **(CPU_DIMS | dict(head_dim=128))
    ),
    "decode_quantized_split4": lambda b: check_decode_quantized(
        small_tiles(4), DECODE_LENS, **(CPU_DIMS | dict(head_dim=128))
    ),
}


def run_interpreter_cases() -> dict:
    """Runs in the subprocess, with TRITON_INTERPRET=1 already in the environment."""
    squeeze_interpreter_loop_bounds()
    round_interpreter_casts_to_nearest()  # the quantized decode's e4m3 values, rounded as on a GPU
    from nanovllm.layers.attention.triton_backend import TritonAttentionBackend

    torch.manual_seed(0)
    return run_cases(INTERPRETER_CASES, lambda case: case(TritonAttentionBackend(num_splits=1)))


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    return results_under_interpreter(__file__)


@pytest.mark.parametrize("case", list(INTERPRETER_CASES))
def test_triton_interpreter(interpreter_results, case):
    result = interpreter_results[case]
    assert "error" not in result, result["error"]
    if "rel_err" in result:
        assert result["rel_err"] < CPU_TOL, result
        assert result["shape_ok"], result
    if "cache_equal" in result:
        assert result["cache_equal"], result
    if "padded_finite" in result:
        assert result["padded_finite"], result
    if "values_equal" in result:
        assert (
            result["layout"]
            and result["values_equal"]
            and result["scales_equal"]
            and result["padding"]
        ), result
        assert result["scale_range"][0] < result["scale_range"][1], (
            result
        )  # the groups' scales differ


def test_triton_rejects_bad_split_count():
    from nanovllm.layers.attention.triton_backend import TritonAttentionBackend

    with pytest.raises(ValueError, match="num_splits"):
        TritonAttentionBackend(num_splits=3)


def test_triton_decode_rejects_more_rows_than_a_grid_holds():
    """The decode grid's second dimension is the rows (CUDA allows 65535): a clear error, no
    launch."""
    from nanovllm.layers.attention.triton_backend import MAX_GRID_Y, TritonAttentionBackend

    rows = MAX_GRID_Y + 1
    q = torch.zeros(rows, 2, 16)
    cache = torch.zeros(1, 16, 1, 16)
    context = Context(
        context_lens=torch.zeros(rows, dtype=torch.int32),
        block_tables=torch.zeros(rows, 1, dtype=torch.int32),
    )
    with pytest.raises(ValueError, match=f"{rows} rows.*{MAX_GRID_Y}.*max_num_seqs"):
        TritonAttentionBackend(num_splits=1).decode(q, cache, cache, context, 1.0)


H100_SHARED_MEMORY = 232448  # bytes per block, also the H200's


def test_triton_tiles_fit_shared_memory():
    """float32 and head_dim 256 get tiles whose estimate fits the H100/H200 limit; 2-byte types
    with head_dim <= 128 keep the tiles they always had."""
    from nanovllm.layers.attention.triton_tiles import (
        decode_tiles,
        prefill_tiles,
        shared_memory_estimate,
    )

    # bf16's long-prefill tiles at float32: what Triton refused on an H200 ("Required: 262144")
    assert shared_memory_estimate(128, 64, 128, 3, 4) == 262144 > H100_SHARED_MEMORY
    for head_dim in (64, 128, 256):
        for itemsize in (2, 4):
            for max_seqlen_q in (1, 64, 65, 4096):
                block_m, block_n, _, num_stages = prefill_tiles(head_dim, itemsize, max_seqlen_q)
                assert (
                    shared_memory_estimate(block_m, block_n, head_dim, num_stages, itemsize)
                    <= H100_SHARED_MEMORY
                )
            for group_pad in (16, 64):
                for fp8 in (False, True):
                    block_n, num_stages = decode_tiles(head_dim, itemsize, group_pad, fp8)
                    assert (
                        shared_memory_estimate(group_pad, block_n, head_dim, num_stages, itemsize)
                        <= H100_SHARED_MEMORY
                    )
    for head_dim in (64, 128):
        assert prefill_tiles(head_dim, 2, 4096) == (128, 64, 8, 3)
        assert prefill_tiles(head_dim, 2, 64) == (64, 64, 4, 3)
        assert decode_tiles(head_dim, 2, 16) == (128, 2)
        assert decode_tiles(head_dim, 2, 16, fp8=True) == (128, 3)
    assert prefill_tiles(128, 4, 4096) != (128, 64, 8, 3)


# ---- GPU: bf16 against the torch backend in float32 ----------------------------------------------

GPU_TOL = 1e-2
GPU_BACKENDS = [
    pytest.param("triton", 16, id="triton-bs16"),
    pytest.param("triton", 256, id="triton-bs256"),
    pytest.param(
        "flash-attn",
        256,
        id="flash-attn-bs256",
        marks=pytest.mark.skipif(not HAS_FLASH_ATTN, reason="flash_attn not installed"),
    ),
]
# longer than the CPU cases: several query and key tiles, contexts across many 16- and 256-token
# blocks
GPU_PREFILL = {
    "prefill": [(0, 1), (0, 200), (0, 513), (0, 64)],
    "prefill_prefix": [(256, 5), (512, 300), (0, 77), (768, 1)],
    "chunked_prefill": [(5, 3), (300, 129), (700, 1), (0, 260), (255, 257)],
}
GPU_DECODE_LENS = [1, 16, 255, 256, 257, 1000, 0, 2049, 33, 0]

gpu = pytest.mark.gpu  # skipped without a CUDA GPU (tests/conftest.py)


def gpu_dims(block_size: int) -> dict:
    return dict(device="cuda", dtype=torch.bfloat16, head_dim=128, block_size=block_size)


def make_backend(name: str):
    from nanovllm.layers.attention import get_attention_backend

    return get_attention_backend(name)


@gpu
@pytest.mark.parametrize("name,block_size", GPU_BACKENDS)
@pytest.mark.parametrize("case", list(GPU_PREFILL))
@pytest.mark.parametrize("heads", [(16, 8), (32, 4)], ids=["gqa2", "gqa8"])
def test_gpu_prefill(name, block_size, case, heads):
    result = check_prefill(
        make_backend(name),
        GPU_PREFILL[case],
        num_heads=heads[0],
        num_kv_heads=heads[1],
        **gpu_dims(block_size),
    )
    assert result["cache_equal"] and result["shape_ok"], result
    assert result["rel_err"] < GPU_TOL, result


@gpu
@pytest.mark.parametrize("name,block_size", GPU_BACKENDS)
@pytest.mark.parametrize("heads", [(16, 8), (32, 4)], ids=["gqa2", "gqa8"])
def test_gpu_decode(name, block_size, heads):
    result = check_decode(
        make_backend(name),
        GPU_DECODE_LENS,
        num_heads=heads[0],
        num_kv_heads=heads[1],
        **gpu_dims(block_size),
    )
    assert result["shape_ok"] and result["padded_finite"], result
    assert result["rel_err"] < GPU_TOL, result


@gpu
@pytest.mark.parametrize("num_splits", [1, 2, 8, None])
@pytest.mark.parametrize("block_size", [16, 256])
def test_gpu_triton_decode_splits(num_splits, block_size):
    from nanovllm.layers.attention.triton_backend import TritonAttentionBackend

    result = check_decode(
        TritonAttentionBackend(num_splits=num_splits),
        [3000, 0, 1, 700],
        num_heads=16,
        num_kv_heads=8,
        **gpu_dims(block_size),
    )
    assert result["padded_finite"], result
    assert result["rel_err"] < GPU_TOL, result


@gpu
@pytest.mark.parametrize("num_splits", [1, 4, None])
@pytest.mark.parametrize("heads", [(16, 8), (32, 8)], ids=["gqa2", "gqa4"])
def test_gpu_triton_decode_quantized(num_splits, heads):
    """bf16: the e4m3 rows and scales equal the plain output's quantization (in bf16, then per
    group)."""
    from nanovllm.layers.attention.triton_backend import TritonAttentionBackend

    result = check_decode_quantized(
        TritonAttentionBackend(num_splits=num_splits),
        GPU_DECODE_LENS,
        num_heads=heads[0],
        num_kv_heads=heads[1],
        **gpu_dims(256),
    )
    assert (
        result["layout"] and result["values_equal"] and result["scales_equal"] and result["padding"]
    ), result


@gpu
# head_dim 256 once, with a cached prefix: its float32 kernels take ~40 s to compile per variant
@pytest.mark.parametrize(
    "case,head_dim", [(case, 128) for case in GPU_PREFILL] + [("prefill_prefix", 256)]
)
def test_gpu_triton_float32(case, head_dim):
    """float32 prefill and decode: tiles chosen for 4-byte elements fit shared memory."""
    from nanovllm.layers.attention.triton_backend import TritonAttentionBackend

    dims = dict(
        device="cuda",
        dtype=torch.float32,
        head_dim=head_dim,
        block_size=16,
        num_heads=16,
        num_kv_heads=8,
    )
    result = check_prefill(TritonAttentionBackend(), GPU_PREFILL[case], **dims)
    assert result["cache_equal"] and result["rel_err"] < GPU_TOL, result
    result = check_decode(TritonAttentionBackend(), GPU_DECODE_LENS, **dims)
    assert result["padded_finite"] and result["rel_err"] < GPU_TOL, result


@gpu
@pytest.mark.parametrize("block_size", [16, 256])
def test_gpu_store_kvcache(block_size):
    for dtype in (torch.bfloat16, torch.float32):
        result = check_store(
            rope_store_kvcache, device="cuda", dtype=dtype, head_dim=128, block_size=block_size
        )
        assert result["cache_equal"], (dtype, result)


@gpu
@pytest.mark.parametrize("name,block_size", GPU_BACKENDS)
def test_gpu_decode_cuda_graph(name, block_size):
    """Capture decode once over static buffers (wider block tables than any sequence needs), then
    replay it with new contexts written into them, as the model runner does."""
    backend = make_backend(name)
    dims = gpu_dims(block_size)
    scale = dims["head_dim"] ** -0.5
    max_seqs, max_blocks = 8, 4096 // block_size + 4
    q, k_cache, v_cache, _ = decode_inputs([4096] * max_seqs, num_heads=16, num_kv_heads=8, **dims)
    static = Context(
        context_lens=torch.zeros(max_seqs, dtype=torch.int32, device="cuda"),
        block_tables=torch.zeros(max_seqs, max_blocks, dtype=torch.int32, device="cuda"),
    )
    backend.decode(q, k_cache, v_cache, static, scale)  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.decode(q, k_cache, v_cache, static, scale)
    for lens in ([1, 300, 4096, 17, 0, 0, 0, 0], [2000, 5, 256, 257, 1023, 64, 3, 0]):
        new_q, new_k, new_v, context = decode_inputs(lens, num_heads=16, num_kv_heads=8, **dims)
        if new_k.shape[0] > k_cache.shape[0]:
            pytest.fail("the capture's cache is too small for the replayed contexts")
        q.copy_(new_q)
        k_cache.fill_(float("nan"))
        v_cache.fill_(float("nan"))
        k_cache[: new_k.shape[0]] = new_k
        v_cache[: new_v.shape[0]] = new_v
        static.context_lens.copy_(context.context_lens)
        static.block_tables.fill_(-1)
        static.block_tables[:, : context.block_tables.shape[1]] = context.block_tables
        out.fill_(float("nan"))
        graph.replay()
        ref = decode_reference(q, k_cache, v_cache, context, scale)
        keep = [i for i, n in enumerate(lens) if n > 0]
        assert out.isfinite().all()
        assert relative_error(out[keep], ref[keep]) < GPU_TOL


if __name__ == "__main__":
    print(json.dumps(run_interpreter_cases()))
