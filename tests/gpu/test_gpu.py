"""End-to-end checks on a CUDA GPU (skipped without one): every backend, with CUDA graphs on and
off, agrees with the torch reference path under greedy decoding; memory stays within
gpu_memory_utilization and is released by exit()."""

import gc
import importlib.util
import random

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.utils.checkpoint import make_random_checkpoint

pytestmark = pytest.mark.gpu  # skipped without a CUDA GPU (tests/conftest.py)

HAS_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None
# the tests run at most 10 prompts: 16 sequences a step need 5 decode graphs, not the 35 of 512
SMALL_BATCH = {"max_num_seqs": 16}
# Near-ties in bf16. Two runs that pick different tokens a and b at the same position have logit
# gaps g + e1 >= 0 >= g + e2 around the fp32 model's gap g, so |g| is within one run's error. That
# error is rounding: bf16 keeps 8 significant bits (unit roundoff u = 2^-8), and activations and the
# KV cache are rounded at every layer, so it grows with the logits' scale M = max |logit| at that
# position. On this test's checkpoint (measured on an H100, 2026-11-21: transformers in bf16 against
# float32 over make_prompts(), 240 greedy positions),
# a bf16 forward pass moves the gap between two of the top-5 candidates by up to 7.2 u*M (mean
# 1.4 u*M); M is 5 to 8 here. So a divergence is a near-tie when |g| < 8 u*M (about 0.2).
BF16_U = 2.0**-8
NEAR_TIE_UNITS = 8


def near_tie(logits: torch.Tensor) -> float:
    """The largest fp32 logit gap that bf16 rounding may flip: NEAR_TIE_UNITS * u * max |logit|."""
    return NEAR_TIE_UNITS * BF16_U * logits.abs().max().item()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # head_dim 128 (the only one the flash-attn build covers), real vocabulary, bf16
    return make_random_checkpoint(
        str(tmp_path_factory.mktemp("gpu-qwen3")),
        "tiny",
        dtype=torch.bfloat16,
        seed=1,
        std=0.1,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=128,
        num_hidden_layers=3,
        vocab_size=4096,
    )


def make_prompts() -> list[list[int]]:
    rng = random.Random(0)
    shared = [rng.randrange(4096) for _ in range(600)]
    prompts = [[rng.randrange(4096) for _ in range(n)] for n in (1, 7, 130, 255, 256, 257, 700)]
    prompts += [
        shared[:300],
        shared[:520] + [5, 6, 7],
        shared,
    ]  # prefix-cache hits across 256-token blocks
    return prompts


def run(model_dir, prompts, max_tokens=24, **kwargs) -> tuple[list[list[int]], list[list[int]]]:
    """Greedy tokens of two passes over the same prompts; the second is served partly from the
    prefix cache."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    with LLM(model_dir, max_model_len=2048, **(SMALL_BATCH | kwargs)) as llm:
        first = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
        again = llm.generate(prompts, params, use_tqdm=False)
        bs = llm.config.kvcache_block_size
        assert [o["num_cached_tokens"] for o in again] == [
            bs * ((len(p) - 1) // bs) for p in prompts
        ]
    return first, [o["token_ids"] for o in again]


@pytest.fixture(scope="module")
def reference(model_dir):
    first, again = run(
        model_dir,
        make_prompts(),
        attention_backend="torch",
        enforce_eager=True,
        kvcache_block_size=256,
    )
    assert again == first
    return first


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()


def assert_agree(hf_model, prompts, expected, got, tie=near_tie):
    """Token-for-token equality, except that a sequence may diverge once where the fp32 model's
    two candidate tokens are within ``tie(logits)`` of each other; the rest of it is then not
    compared."""
    for prompt, exp, out in zip(prompts, expected, got):
        if exp == out:
            continue
        j = next(i for i, (a, b) in enumerate(zip(exp, out)) if a != b)
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + exp[:j]], device="cuda")).logits[0, -1]
        gap, tol = (logits[exp[j]] - logits[out[j]]).abs().item(), tie(logits)
        assert gap < tol, (
            f"prompt of {len(prompt)} tokens diverges at {j} with logit gap {gap:.4f} "
            f"(near tie < {tol:.4f})"
        )


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
@pytest.mark.parametrize(
    "backend,block_size",
    [
        ("triton", 16),
        ("triton", 256),
        pytest.param(
            "flash-attn",
            256,
            marks=pytest.mark.skipif(not HAS_FLASH_ATTN, reason="flash-attn not installed"),
        ),
    ],
)
def test_backend_matches_torch_reference(
    model_dir, reference, hf_model, backend, block_size, enforce_eager
):
    prompts = make_prompts()
    got, again = run(
        model_dir,
        prompts,
        attention_backend=backend,
        kvcache_block_size=block_size,
        enforce_eager=enforce_eager,
    )
    assert_agree(hf_model, prompts, reference, got)
    assert_agree(hf_model, prompts, got, again)


@pytest.mark.parametrize(
    "backend",
    [
        "triton",
        pytest.param(
            "flash-attn",
            marks=pytest.mark.skipif(not HAS_FLASH_ATTN, reason="flash-attn not installed"),
        ),
    ],
)
def test_chunked_prefill_and_preemption(model_dir, reference, hf_model, backend):
    """A 300-token budget chunks the long prompts; 8 blocks force preemption in decode."""
    prompts = make_prompts()
    with LLM(
        model_dir,
        max_model_len=1024,
        attention_backend=backend,
        kvcache_block_size=256,
        max_num_batched_tokens=300,
        num_kvcache_blocks=8,
        **SMALL_BATCH,
    ) as llm:
        preempted = []
        original = llm.core.scheduler.preempt
        llm.core.scheduler.preempt = lambda seq: (preempted.append(seq.seq_id), original(seq))
        got = [
            o["token_ids"]
            for o in llm.generate(
                prompts, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False
            )
        ]
    assert preempted, "the small cache should have forced a preemption"
    assert_agree(hf_model, prompts, reference, got)


def test_odd_max_num_seqs_graphs(model_dir, reference, hf_model):
    """Decode graphs for a max_num_seqs that is not a multiple of 16: batches are padded."""
    prompts = make_prompts()
    got, again = run(
        model_dir, prompts, attention_backend="triton", kvcache_block_size=256, max_num_seqs=5
    )
    assert_agree(hf_model, prompts, reference, got)
    assert_agree(hf_model, prompts, got, again)


def test_memory_within_utilization_and_released(model_dir):
    torch.cuda.empty_cache()
    free0, total = torch.cuda.mem_get_info()
    baseline_allocated = torch.cuda.memory_allocated()
    util = 0.3
    llm = LLM(model_dir, max_model_len=2048, gpu_memory_utilization=util, kvcache_block_size=256)
    llm.generate(make_prompts(), SamplingParams(temperature=0.6, max_tokens=64), use_tqdm=False)
    free1, _ = torch.cuda.mem_get_info()
    peak_reserved = torch.cuda.max_memory_reserved()
    # everything on the device (this process and others) stays under the budget
    assert total - free1 <= util * total, (total - free1) / total
    assert peak_reserved <= util * total
    llm.exit()
    llm.exit()  # idempotent
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_allocated() - baseline_allocated < 64 << 20
    free2, _ = torch.cuda.mem_get_info()
    assert free2 >= free0 - (256 << 20)
    # a second engine in the same process works
    with LLM(
        model_dir, max_model_len=2048, gpu_memory_utilization=util, kvcache_block_size=256
    ) as llm2:
        out = llm2.generate(
            [[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False
        )
        assert len(out[0]["token_ids"]) == 4


# ---- sampling controls on the GPU --------------------------------------------------------------

SAMPLING_PARAMS = [
    SamplingParams(
        temperature=0,
        max_tokens=24,
        repetition_penalty=1.3,
        presence_penalty=0.4,
        frequency_penalty=0.2,
    ),
    SamplingParams(temperature=0.8, seed=11, max_tokens=24),
    SamplingParams(temperature=0.7, top_k=20, seed=12, max_tokens=24),
    SamplingParams(temperature=0, max_tokens=24, logprobs=3),
]


def penalised(
    logits: torch.Tensor, prompt: list[int], output: list[int], sp: SamplingParams
) -> torch.Tensor:
    """The penalties written out plainly, for the near-tie check."""
    logits = logits.clone()
    for t in set(prompt) | set(output):
        logits[t] = (
            logits[t] / sp.repetition_penalty
            if logits[t] > 0
            else logits[t] * sp.repetition_penalty
        )
    for t in set(output):
        logits[t] -= sp.frequency_penalty * output.count(t) + sp.presence_penalty
    return logits


def assert_sampled_agree(hf_model, prompts, params, expected, got):
    """Equal tokens, except one divergence per sequence where the fp32 model's scores of the two
    candidates (penalised logits, divided by the temperature, plus the draw's Gumbel noise) are
    within near_tie(penalised logits) / temperature; or, with top-k, where one candidate's logit is
    within near_tie of the k-th largest (it may fall in or out of the kept set)."""
    from nanovllm.engine.step import draw_seed
    from nanovllm.sampling.torch_ops import gumbel

    for prompt, sp, exp, out in zip(prompts, params, expected, got):
        if exp == out:
            continue
        j = next(i for i, (a, b) in enumerate(zip(exp, out)) if a != b)
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + exp[:j]], device="cuda")).logits[0, -1].float()
        logits = penalised(logits, prompt, exp[:j], sp) if sp.has_penalties else logits
        a, b = exp[j], out[j]
        if sp.temperature == 0:
            gap, tol = (logits[a] - logits[b]).abs().item(), near_tie(logits)
        else:
            ids = torch.arange(logits.numel(), device="cuda")
            scores = (
                logits / sp.temperature
                + gumbel(torch.tensor([draw_seed(sp.seed, j)], device="cuda"), ids)[0]
            )
            gap, tol = (scores[a] - scores[b]).abs().item(), near_tie(logits) / sp.temperature
            if sp.top_k and gap >= tol:
                kth = logits.topk(sp.top_k).values[-1]
                gap = min((logits[a] - kth).abs().item(), (logits[b] - kth).abs().item())
                tol = near_tie(logits)
        assert gap < tol, (
            f"prompt of {len(prompt)} tokens, {sp}: diverges at {j} with gap {gap:.4f}"
        )


def run_sampled(model_dir, prompts, **kwargs) -> list[dict]:
    params = [SAMPLING_PARAMS[i % len(SAMPLING_PARAMS)] for i in range(len(prompts))]
    with LLM(model_dir, max_model_len=2048, **SMALL_BATCH, **kwargs) as llm:
        return llm.generate(prompts, params, use_tqdm=False)


@pytest.fixture(scope="module")
def sampled_reference(model_dir):
    return run_sampled(
        model_dir,
        make_prompts(),
        attention_backend="torch",
        enforce_eager=True,
        kvcache_block_size=256,
    )


@pytest.mark.parametrize(
    "backend",
    [
        "triton",
        pytest.param(
            "flash-attn",
            marks=pytest.mark.skipif(not HAS_FLASH_ATTN, reason="flash-attn not installed"),
        ),
    ],
)
def test_sampling_controls_with_graphs_match_torch_reference(
    model_dir, sampled_reference, hf_model, backend
):
    """Greedy with penalties, seeded plain and top-k draws and logprobs, with CUDA graphs, agree
    with the torch reference path (near-ties aside); logprobs agree with the fp32 model's."""
    prompts = make_prompts()
    params = [SAMPLING_PARAMS[i % len(SAMPLING_PARAMS)] for i in range(len(prompts))]
    got = run_sampled(
        model_dir, prompts, attention_backend=backend, kvcache_block_size=256, enforce_eager=False
    )
    assert_sampled_agree(
        hf_model,
        prompts,
        params,
        [o["token_ids"] for o in sampled_reference],
        [o["token_ids"] for o in got],
    )
    for prompt, sp, out in zip(prompts, params, got):
        if sp.logprobs is None:
            continue
        with torch.no_grad():
            ref = torch.log_softmax(
                hf_model(torch.tensor([prompt + out["token_ids"]], device="cuda"))
                .logits[0]
                .float(),
                -1,
            )
        for j, (token, entry) in enumerate(zip(out["token_ids"], out["logprobs"])):
            row = ref[len(prompt) - 1 + j]
            assert token in entry and len(entry) >= sp.logprobs
            for t, lp in entry.items():
                assert abs(lp - row[t].item()) < 0.1, (j, t, lp, row[t].item())


def test_fused_draw_matches_torch():
    """The Triton Gumbel-max kernel draws the same tokens as the torch path on real-sized bf16
    logits (vocabulary 151936, greedy rows included), apart from score near-ties (fp32 log
    rounding)."""
    from nanovllm.sampling import torch_ops, triton_draw

    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(64, 151936, device="cuda", generator=g) * 4).to(torch.bfloat16)
    temperatures = torch.rand(64, device="cuda", generator=g) + 0.1
    temperatures[::8] = 0
    seeds = torch.randint(0, 1 << 32, (64,), device="cuda", generator=g)
    got = triton_draw.gumbel_argmax(logits, temperatures, seeds)
    ref = torch_ops.gumbel_argmax(logits, temperatures, seeds)
    differ = (got != ref).nonzero().flatten().tolist()
    ids = torch.arange(logits.size(1), device="cuda")
    for r in differ:
        scores = logits[r].float() / temperatures[r] + torch_ops.gumbel(seeds[r : r + 1], ids)[0]
        assert (scores[got[r]] - scores[ref[r]]).abs() < 1e-4 * scores[ref[r]].abs(), r
    assert len(differ) <= 2, differ


@pytest.mark.parametrize(
    "backend",
    [
        "triton",
        pytest.param(
            "flash-attn",
            marks=pytest.mark.skipif(not HAS_FLASH_ATTN, reason="flash-attn not installed"),
        ),
    ],
)
def test_async_scheduling_matches_serial(model_dir, backend):
    """With CUDA graphs, chunked prefill (512-token budget), preemption (8 blocks of 256) and prefix
    hits: async scheduling gives exactly the serial path's tokens and logprobs, greedy and seeded.
    Every request ends by length, so both paths schedule the same batches: no tolerance needed."""
    prompts = make_prompts()
    params = [
        SamplingParams(
            temperature=0, max_tokens=40, ignore_eos=True, logprobs=2 if i % 3 == 0 else None
        )
        if i % 2
        else SamplingParams(temperature=0.8, top_k=50, seed=i, max_tokens=33, ignore_eos=True)
        for i in range(len(prompts))
    ]
    results = {}
    for async_scheduling in (False, True):
        with LLM(
            model_dir,
            max_model_len=2048,
            attention_backend=backend,
            kvcache_block_size=256,
            num_kvcache_blocks=8,
            max_num_batched_tokens=512,
            async_scheduling=async_scheduling,
            **SMALL_BATCH,
        ) as llm:
            first = llm.generate(prompts, params, use_tqdm=False)
            again = llm.generate(prompts, params, use_tqdm=False)
            stats = llm.get_stats()
        assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_rate"] > 0
        results[async_scheduling] = [(o["token_ids"], o["logprobs"]) for o in first + again]
    assert results[True] == results[False]
