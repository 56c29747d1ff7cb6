"""The FP8 KV cache in the engine: ``LLM(..., kv_cache_dtype="fp8")`` on the CPU against an engine
whose float32 cache holds each row quantized and dequantized again (the same tokens and
log-probabilities); the bytes per cache block; which backend runs, and the ValueErrors of
impossible combinations raised before any weights load. The kernels and the quantization itself:
test_fp8_kv_cache.py."""

import os
import shutil
import sys
import types
from types import SimpleNamespace

import pytest
import torch
from hf_reference import BLOCK_SIZE, random_prompts
from test_fp8_kv_cache import reference_dequantize, reference_quantize

from nanovllm.layers.attention.reference import TorchAttentionBackend

E4M3 = torch.float8_e4m3fn
E4M3_NAN = 0x7F  # the byte a cache slot holds until something is stored there

# ---- the engine on the CPU -----------------------------------------------------------------------


class RoundTripCacheBackend(TorchAttentionBackend):
    """A float32 cache holding each row quantized and dequantized by this file's reference:
    attending over it is what an FP8 cache must compute, reached without the library's FP8 code."""

    def store_kvcache(self, k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
        assert k_scale is None and k_cache.dtype == torch.float32
        k, v = (reference_dequantize(*reference_quantize(x)) for x in (k, v))
        super().store_kvcache(k, v, k_cache, v_cache, slot_mapping)


def attention_modules(llm):
    from nanovllm.layers.attention import Attention

    return [m for m in llm.core.executor.runner.model.modules() if isinstance(m, Attention)]


def generate_twice(llm, prompts):
    """Greedy tokens with log-probabilities; the second pass is served partly from the prefix
    cache, so prefill reads a cached prefix through the block tables."""
    from nanovllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=6, logprobs=1)
    first = llm.generate(prompts, params, use_tqdm=False)
    again = llm.generate(prompts, params, use_tqdm=False)
    return first + again


def test_llm_fp8_cache_matches_round_trip_reference(ckpt_tied):
    from nanovllm import LLM

    prompts = random_prompts(11, [40, 3, 21])
    prompts.append(prompts[0][:32] + [7, 8, 9])  # shares two blocks with the first prompt
    kwargs = dict(
        kvcache_block_size=BLOCK_SIZE, num_kvcache_blocks=48, max_model_len=128, device="cpu"
    )
    with LLM(ckpt_tied.path, kv_cache_dtype="auto", **kwargs) as ref_llm:
        for m in attention_modules(ref_llm):
            m.backend = RoundTripCacheBackend()
            m.k_cache.fill_(float("nan"))
            m.v_cache.fill_(float("nan"))
        expected = generate_twice(ref_llm, prompts)
        ref_caches = [(m.k_cache.clone(), m.v_cache.clone()) for m in attention_modules(ref_llm)]
    with LLM(ckpt_tied.path, kv_cache_dtype="fp8", **kwargs) as llm:
        modules = attention_modules(llm)
        for m in modules:
            for cache in (m.k_cache, m.v_cache):
                cache.view(torch.uint8).fill_(E4M3_NAN)
            for scale in (m.k_scale, m.v_scale):
                scale.fill_(float("nan"))
        got = generate_twice(llm, prompts)
        caches = [(m.k_cache, m.v_cache, m.k_scale, m.v_scale) for m in modules]

        assert modules[0].k_cache.dtype == E4M3 and modules[0].k_scale.dtype == torch.float32
        assert modules[0].k_scale.shape == modules[0].k_cache.shape[:3] == (48, BLOCK_SIZE, 2)
        assert any(o["num_cached_tokens"] > 0 for o in got[len(prompts) :]), (
            "no prefix-cache hit: paged prefill untested"
        )
        for e, o in zip(expected, got):
            assert o["token_ids"] == e["token_ids"]
            assert len(o["logprobs"]) == len(e["logprobs"]) == len(e["token_ids"])
            for entry, ref_entry in zip(o["logprobs"], e["logprobs"]):
                assert entry.keys() == ref_entry.keys()
                assert all(abs(entry[t] - ref_entry[t]) < 1e-5 for t in entry), (entry, ref_entry)
        written = 0
        for (k_cache, v_cache, k_scale, v_scale), (ref_k, ref_v) in zip(caches, ref_caches):
            for cache, scale, ref in ((k_cache, k_scale, ref_k), (v_cache, v_scale, ref_v)):
                stored = ~ref.isnan().any(-1)  # [blocks, block_size, kv_heads]
                assert torch.equal(reference_dequantize(cache, scale)[stored], ref[stored])
                assert (
                    cache.view(torch.uint8)[~stored] == E4M3_NAN
                ).all()  # nothing else was written
                written += int(stored.sum())
        assert written > 0


def test_block_bytes_count_the_scales():
    """A bf16 Qwen3-0.6B-shaped cache (28 layers, 8 KV heads, head_dim 128): e4m3 plus a float32
    scale per row takes 132 bytes a row instead of 256, so the same memory holds 1.94x the
    blocks."""
    from nanovllm.runner import kv_cache

    def block_bytes(kv_cache_dtype):
        config = SimpleNamespace(
            hf_config=SimpleNamespace(num_hidden_layers=28),
            kv_cache_dtype=kv_cache_dtype,
            kvcache_block_size=256,
        )
        return kv_cache.block_bytes(config, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)

    auto, fp8 = block_bytes("auto"), block_bytes("fp8")
    assert auto == 2 * 28 * 256 * 8 * 128 * 2
    assert fp8 == block_bytes("fp8_e4m3") == 2 * 28 * 256 * 8 * (128 + 4)
    assert auto / fp8 == 256 / 132
    budget = 40 * 2**30  # what one GPU might leave for the cache
    assert (budget // fp8) / (budget // auto) > 1.93


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_allocated_cache_matches_block_bytes(ckpt_tied, kv_cache_dtype):
    from nanovllm import LLM

    with LLM(
        ckpt_tied.path,
        kvcache_block_size=BLOCK_SIZE,
        num_kvcache_blocks=5,
        max_model_len=64,
        kv_cache_dtype=kv_cache_dtype,
    ) as llm:
        from nanovllm.runner import kv_cache

        runner = llm.core.executor.runner
        scale_bytes = sum(
            m.k_scale.nbytes + m.v_scale.nbytes
            for m in attention_modules(llm)
            if m.k_scale is not None
        )
        one_block = kv_cache.block_bytes(
            llm.config, runner.num_kv_heads, runner.head_dim, runner.dtype
        )
        assert runner.kv_cache.nbytes + scale_bytes == 5 * one_block
        assert (scale_bytes > 0) == (kv_cache_dtype == "fp8")


# ---- which backend, and what is refused before anything loads ------------------------------------


@pytest.fixture
def fake_gpu(monkeypatch):
    """Resolution as on one GPU of compute capability 9.0 with flash-attn importable."""
    from nanovllm.config import Config

    monkeypatch.setattr(Config, "resolved_device", lambda self: "cuda")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))


def test_auto_backend_resolution(fake_gpu, monkeypatch):
    from nanovllm.layers.attention import resolve_backend_name as resolve

    assert resolve("auto", "cuda", 256, torch.bfloat16, "auto") == "flash-attn"
    assert resolve("auto", "cuda", 16, torch.bfloat16, "auto") == "triton"
    assert resolve("auto", "cuda", 256, torch.float32, "auto") == "triton"
    assert resolve("auto", "cuda", 256, torch.bfloat16, "fp8") == "triton"
    assert resolve("auto", "cuda", 256, torch.float16, "fp8_e4m3") == "triton"
    assert resolve("auto", "cuda", 256, torch.bfloat16, "auto", "fp8") == "triton"  # FP8 weights
    assert (
        resolve("flash-attn", "cuda", 256, torch.bfloat16, "auto", "fp8") == "flash-attn"
    )  # asked for
    assert resolve("auto", "cpu", 256, torch.bfloat16, "auto", "fp8") == "torch"
    assert resolve("auto", "cpu", 256, torch.float32, "fp8") == "torch"
    assert resolve("triton", "cuda", 16, torch.float32, "fp8") == "triton"
    assert resolve("torch", "cuda", 16, torch.bfloat16, "fp8") == "torch"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    with pytest.raises(ValueError, match="8.9") as e:
        resolve("auto", "cuda", 256, torch.bfloat16, "fp8")
    assert "kv_cache_dtype" in str(e.value) and "8.0" in str(e.value)


@pytest.mark.parametrize("value", ["int8", "fp8_e5m2", "FP8", "", None, 8])
def test_bad_kv_cache_dtype(ckpt_tied, value):
    from nanovllm.config import Config

    with pytest.raises(ValueError) as e:
        Config(ckpt_tied.path, kv_cache_dtype=value)
    message = str(e.value)
    assert (
        "kv_cache_dtype" in message
        and repr(value) in message
        and "'fp8'" in message
        and "'auto'" in message
    )


def test_fp8_with_flash_attn_is_refused(ckpt_tied):
    from nanovllm.config import Config

    for kv in ("fp8", "fp8_e4m3"):
        with pytest.raises(ValueError) as e:
            Config(ckpt_tied.path, attention_backend="flash-attn", kv_cache_dtype=kv)
        assert (
            "flash-attn" in str(e.value) and repr(kv) in str(e.value) and "triton" in str(e.value)
        )


def test_float32_with_flash_attn_is_refused_on_gpu(ckpt_tied, fake_gpu):
    """The tiny checkpoint is float32, so dtype "auto" is float32 on the GPU too."""
    from nanovllm.config import Config

    for dtype in ("float32", "auto"):
        with pytest.raises(ValueError, match="float32") as e:
            Config(
                ckpt_tied.path, attention_backend="flash-attn", kvcache_block_size=256, dtype=dtype
            )
        assert "flash-attn" in str(e.value)
    Config(
        ckpt_tied.path, attention_backend="flash-attn", kvcache_block_size=256, dtype="bfloat16"
    )  # accepted
    Config(
        ckpt_tied.path, attention_backend="auto", kvcache_block_size=256, dtype="float32"
    )  # resolves to triton


@pytest.fixture(scope="module")
def broken_ckpt(ckpt_tied, tmp_path_factory) -> str:
    """The tiny checkpoint with an unreadable weights file: anything that gets to loading fails."""
    path = tmp_path_factory.mktemp("qwen3-broken")
    for name in os.listdir(ckpt_tied.path):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(ckpt_tied.path, name), path / name)
    (path / "model.safetensors").write_bytes(b"not a safetensors file")
    return str(path)


def test_refused_before_weights_load(broken_ckpt):
    from nanovllm import LLM

    with pytest.raises(ValueError, match="FP8"):
        LLM(broken_ckpt, attention_backend="flash-attn", kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(broken_ckpt, kv_cache_dtype="int4")
    with pytest.raises(Exception) as e:  # valid settings reach the weights, which fail
        LLM(broken_ckpt, kv_cache_dtype="fp8", num_kvcache_blocks=4, max_model_len=64)
    assert "kv_cache_dtype" not in str(e.value)
