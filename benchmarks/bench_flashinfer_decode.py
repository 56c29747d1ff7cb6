"""FlashInfer's paged decode over an FP8 (e4m3, one scale per tensor) cache at
``bench_attention.py --cache fp8``'s step: 256 sequences of 100-1,600 keys (the same lengths, seed
0), 16 query and 8 KV heads, head_dim 128. Each layout is checked against float32 torch over the
dequantized cache first (every 17th sequence), then timed as a CUDA graph (median of 30 replays).
"TB/s" counts the K and V bytes only. GPU only; needs ``flashinfer`` (not a dependency of this
project: BENCHMARKS.md, "The FP8 decode attention", says what it took to install and what it gave).

    python benchmarks/bench_flashinfer_decode.py
"""

import time

import torch
from bench_attention import median_ms  # the engine's kernels are timed the same way

NUM_SEQS, HEADS, KV_HEADS, HEAD_DIM = 256, 16, 8, 128
LAYOUTS = [(16, "NHD", False), (256, "NHD", False), (16, "HND", False), (16, "NHD", True)]


def reference_error(out, q, k8, v8, ks, vs, ids, indptr, lens, layout) -> float:
    """Largest relative error of ``out`` against float32 attention over the dequantized cache."""
    err = 0.0
    for i in range(0, NUM_SEQS, 17):
        pages = ids[indptr[i] : indptr[i + 1]].long().cuda()
        k, v = k8[pages].float() * ks, v8[pages].float() * vs
        if layout == "HND":
            k, v = k.transpose(1, 2), v.transpose(1, 2)
        k = k.reshape(-1, KV_HEADS, HEAD_DIM)[: lens[i]]
        v = v.reshape(-1, KV_HEADS, HEAD_DIM)[: lens[i]]
        qq = q[i].float().view(KV_HEADS, HEADS // KV_HEADS, HEAD_DIM)
        p = torch.softmax(torch.einsum("ghd,tgd->ght", qq, k) * HEAD_DIM**-0.5, -1)
        ref = torch.einsum("ght,tgd->ghd", p, v).reshape(HEADS, HEAD_DIM)
        err = max(err, ((out[i].float() - ref).abs().max() / ref.abs().max()).item())
    return err


def measure(flashinfer, q, lens, page, layout, tensor_cores, gen) -> str:
    """One layout's line: time, bandwidth, error against float32 torch, time to plan and build."""
    pages = (-(-lens // page)).tolist()
    ids = torch.randperm(sum(pages), generator=gen).int()
    indptr = torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()], dtype=torch.int32)
    last = ((lens - 1) % page + 1).int()
    shape = (sum(pages), page, KV_HEADS, HEAD_DIM)
    if layout == "HND":
        shape = (sum(pages), KV_HEADS, page, HEAD_DIM)
    k, v = (torch.randn(shape, generator=gen).cuda() for _ in range(2))
    ks, vs = k.abs().amax().item() / 448, v.abs().amax().item() / 448
    k8, v8 = (k / ks).to(torch.float8_e4m3fn), (v / vs).to(torch.float8_e4m3fn)
    workspace = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace, layout, use_tensor_cores=tensor_cores
    )
    started = time.time()
    wrapper.plan(
        indptr.cuda(), ids.cuda(), last.cuda(), HEADS, KV_HEADS, HEAD_DIM, page,
        q_data_type=torch.bfloat16, kv_data_type=torch.float8_e4m3fn,
    )  # fmt: skip
    out = wrapper.run(q, (k8, v8), k_scale=ks, v_scale=vs)
    torch.cuda.synchronize()
    built = time.time() - started
    err = reference_error(out, q, k8, v8, ks, vs, ids, indptr, lens, layout)
    ms = median_ms(lambda: wrapper.run(q, (k8, v8), k_scale=ks, v_scale=vs, out=out), 30)
    nbytes = int(lens.sum()) * KV_HEADS * HEAD_DIM * 2
    return (
        f"page {page} {layout} tensor_cores={tensor_cores}: {ms * 1e3:.1f} us, "
        f"{nbytes / ms / 1e9:.2f} TB/s, rel err {err:.4f}, plan + first run {built:.0f} s"
    )


def main() -> None:
    try:
        import flashinfer
    except ImportError as e:
        raise SystemExit(f"this script needs flashinfer ({e})") from None
    print(f"flashinfer {flashinfer.__version__}, {torch.cuda.get_device_name()}")
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(100, 1601, (NUM_SEQS,), generator=gen)
    q = torch.randn(NUM_SEQS, HEADS, HEAD_DIM, generator=gen).to("cuda", torch.bfloat16)
    for page, layout, tensor_cores in LAYOUTS:
        print(measure(flashinfer, q, lens, page, layout, tensor_cores, gen), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
