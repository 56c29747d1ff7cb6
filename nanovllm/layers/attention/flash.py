"""The flash-attn backend (block size a multiple of 256; no float32, no FP8 cache). A decode of
at most SMALL_DECODE sequences runs the Triton kernel on the same cache instead: one kernel per
layer fewer than flash-attn's split and combine, and faster there (BENCHMARKS.md, "Decode at
batch 1")."""

from nanovllm.layers.attention.interface import AttentionBackend
from nanovllm.utils.context import Context

SMALL_DECODE = 4


class FlashAttentionBackend(AttentionBackend):
    name = "flash-attn"

    def __init__(self):
        try:
            from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
        except ImportError as e:
            raise ImportError(
                "attention_backend 'flash-attn' needs the flash-attn package "
                "(pip install flash-attn); use attention_backend='triton' or 'auto' without it"
            ) from e
        from nanovllm.layers.attention.triton_backend import TritonAttentionBackend

        self._varlen = flash_attn_varlen_func
        self._with_kvcache = flash_attn_with_kvcache
        self._small_decode = TritonAttentionBackend().decode

    def prefill(
        self, q, k, v, k_cache, v_cache, context: Context, scale, k_scale=None, v_scale=None
    ):
        if context.block_tables is not None:  # keys (prefix and new tokens) from the cache
            k, v = k_cache, v_cache
        return self._varlen(
            q,
            k,
            v,
            max_seqlen_q=context.max_seqlen_q,
            cu_seqlens_q=context.cu_seqlens_q,
            max_seqlen_k=context.max_seqlen_k,
            cu_seqlens_k=context.cu_seqlens_k,
            softmax_scale=scale,
            causal=True,
            block_table=context.block_tables,
        )

    def decode(self, q, k_cache, v_cache, context: Context, scale, k_scale=None, v_scale=None):
        if q.shape[0] <= SMALL_DECODE:
            return self._small_decode(q, k_cache, v_cache, context, scale)
        out = self._with_kvcache(
            q.unsqueeze(1),
            k_cache,
            v_cache,
            cache_seqlens=context.context_lens,
            block_table=context.block_tables,
            softmax_scale=scale,
            causal=True,
        )  # [num_seqs, 1, num_heads, head_dim]
        return out.squeeze(1)
