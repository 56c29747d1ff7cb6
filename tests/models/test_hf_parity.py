"""Greedy generation must match Hugging Face transformers token for token (CPU, float32).

The reference is an independent plain transformers loop (hf_reference.HFReference). Checkpoints are
tiny random Qwen3 models covering a non-default rope theta in both config styles, an explicit
head_dim != hidden / heads, and tied and untied LM heads.
"""

import shutil

import pytest
import torch
from hf_reference import BLOCK_SIZE, TIE_GAP, assert_greedy_match, edit_json, mixed_prompts

from nanovllm import LLM, SamplingParams

CHECKPOINTS = ["ckpt_tied", "ckpt_untied"]
MAX_TOKENS = [12, 20, 16, 24, 9, 20, 17, 20, 14, 20, 20, 18, 20, 11, 20]  # one per mixed prompt


def make_llm(path: str, **kwargs) -> LLM:
    kwargs = dict(kvcache_block_size=BLOCK_SIZE, num_kvcache_blocks=256, max_model_len=256) | kwargs
    return LLM(path, **kwargs)


def copy_with_config(src: str, dst: str, **changes) -> str:
    """A copy of checkpoint ``src`` whose config.json has ``changes`` (None removes a key)."""
    shutil.copytree(src, dst, dirs_exist_ok=True)
    edit_json(dst, **changes)
    return dst


def greedy_params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=n) for n in MAX_TOKENS]


def check_outputs(outputs, prompts, refs, what):
    assert len(outputs) == len(prompts)
    for i, (out, prompt, ref) in enumerate(zip(outputs, prompts, refs)):
        assert out["prompt_token_ids"] == prompt, f"{what}: prompts[{i}] prompt_token_ids"
        assert_greedy_match(out["token_ids"], ref, f"{what}: prompts[{i}] ({len(prompt)} tokens)")


@pytest.fixture(scope="module", params=CHECKPOINTS)
def ckpt(request):
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def llm(ckpt):
    engine = make_llm(ckpt.path)
    yield engine
    engine.exit()


@pytest.fixture(scope="module")
def refs(ckpt, hf_ref):
    prompts = mixed_prompts()
    return [hf_ref.greedy(ckpt.path, p, n) for p, n in zip(prompts, MAX_TOKENS)]


def test_transformers_reads_checkpoint_config(ckpt, hf_ref):
    """The reference itself must see the variant: theta in either config style, head_dim, tying."""
    model = hf_ref.model(ckpt.path)
    config = model.config
    assert config.rope_parameters["rope_theta"] == ckpt.rope_theta
    head_dim = ckpt.head_dim
    expected = 1.0 / ckpt.rope_theta ** (
        torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    )
    torch.testing.assert_close(
        model.model.rotary_emb.inv_freq.double(), expected, rtol=1e-6, atol=0
    )
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.shape == (4 * head_dim, 64) and head_dim != config.hidden_size // 4
    assert attn.k_proj.weight.shape == (2 * head_dim, 64)
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tied == ckpt.tie_word_embeddings


def test_rope_theta_changes_reference(ckpt, hf_ref, refs, tmp_path):
    """The parity test would notice a wrong rope theta: with the usual 1e6 the reference differs."""
    other = copy_with_config(
        ckpt.path, str(tmp_path / "theta"), rope_parameters=None, rope_theta=1e6
    )
    prompts = mixed_prompts()
    changed = [
        i
        for i in (8, 9, 10)
        if hf_ref.greedy(other, prompts[i], MAX_TOKENS[i]).tokens != refs[i].tokens
    ]
    assert changed


def test_greedy_batch_matches_transformers(llm, refs):
    prompts = mixed_prompts()
    params = greedy_params()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    check_outputs(outputs, prompts, refs, "first generate")
    for i, (out, n) in enumerate(zip(outputs, MAX_TOKENS)):
        assert out["finish_reason"] == "length" and len(out["token_ids"]) == n, f"prompts[{i}]"
        assert out["text"] == llm.tokenizer.decode(out["token_ids"], skip_special_tokens=True)

    # Same prompts again: every full prompt block except the one holding the last token is cached.
    again = llm.generate(prompts, params, use_tqdm=False)
    cached = [out["num_cached_tokens"] for out in again]
    assert cached == [BLOCK_SIZE * ((len(p) - 1) // BLOCK_SIZE) for p in prompts]
    assert [out["token_ids"] for out in again] == [out["token_ids"] for out in outputs]
    check_outputs(again, prompts, refs, "second generate (prefix cache)")


def test_chunked_prefill_matches_transformers(ckpt_tied, hf_ref):
    prompts = mixed_prompts()
    refs = [hf_ref.greedy(ckpt_tied.path, p, n) for p, n in zip(prompts, MAX_TOKENS)]
    llm = make_llm(ckpt_tied.path, max_num_batched_tokens=64)
    chunks = []
    schedule = llm.core.scheduler.schedule

    def recording_schedule():
        seqs, is_prefill = schedule()
        if is_prefill:
            assert sum(s.num_scheduled_tokens for s in seqs) <= 64
            chunks.extend(
                s.seq_id for s in seqs if s.num_cached_tokens + s.num_scheduled_tokens < len(s)
            )
        return seqs, is_prefill

    llm.core.scheduler.schedule = recording_schedule
    try:
        outputs = llm.generate(prompts, greedy_params(), use_tqdm=False)
    finally:
        llm.exit()
    assert len(set(chunks)) >= 2, (
        "max_num_batched_tokens=64 should split the 90- and 120-token prompts"
    )
    check_outputs(outputs, prompts, refs, "chunked prefill")


def test_preemption_matches_transformers(ckpt_untied, hf_ref):
    prompts = mixed_prompts()
    refs = [hf_ref.greedy(ckpt_untied.path, p, n) for p, n in zip(prompts, MAX_TOKENS)]
    # the largest request (120 + 20 tokens) needs 9 blocks; the batch needs far more
    llm = make_llm(ckpt_untied.path, num_kvcache_blocks=12)
    preempted = []
    preempt = llm.core.scheduler.preempt

    def counting_preempt(seq):
        preempted.append(seq.seq_id)
        preempt(seq)

    llm.core.scheduler.preempt = counting_preempt
    try:
        outputs = llm.generate(prompts, greedy_params(), use_tqdm=False)
    finally:
        llm.exit()
    assert preempted, "num_kvcache_blocks=12 should force preemption"
    check_outputs(outputs, prompts, refs, "with preemption")


def test_eos_stops_like_transformers(ckpt_tied, hf_ref, tmp_path_factory):
    prompts = mixed_prompts()
    max_tokens = 20
    plain = [hf_ref.greedy(ckpt_tied.path, p, max_tokens) for p in prompts]
    # An EOS the model really produces: a token first generated at step k >= 3 of some prompt,
    # with no near-tie up to there.
    choice = None
    for i, ref in enumerate(plain):
        for k in range(3, max_tokens - 2):
            if ref.tokens[k] not in ref.tokens[:k] and min(ref.gaps[: k + 1]) > 100 * TIE_GAP:
                choice = i, k, ref.tokens[k]
                break
        if choice:
            break
    assert choice, "no usable EOS candidate in the reference output"
    index, stop_at, eos = choice
    path = copy_with_config(
        ckpt_tied.path, str(tmp_path_factory.mktemp("qwen3-eos")), eos_token_id=eos
    )
    refs = [hf_ref.greedy(path, p, max_tokens, stop_on_eos=True) for p in prompts]
    assert (
        refs[index].stopped and len(refs[index].tokens) == stop_at + 1
    )  # the reference stops there too
    assert refs[index].tokens == plain[index].tokens[: stop_at + 1]

    llm = make_llm(path)
    try:
        outputs = llm.generate(
            prompts, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False
        )
        check_outputs(outputs, prompts, refs, f"eos={eos}")
        out = outputs[index]
        assert out["finish_reason"] == "stop" and out["token_ids"][-1] == eos
        assert len(out["token_ids"]) == stop_at + 1
        for i, (o, ref) in enumerate(zip(outputs, refs)):
            if o["token_ids"] == ref.tokens:
                assert o["finish_reason"] == ("stop" if ref.stopped else "length"), f"prompts[{i}]"

        ignoring = llm.generate(
            prompts,
            SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
            use_tqdm=False,
        )
        check_outputs(ignoring, prompts, plain, "ignore_eos")
        assert (
            ignoring[index]["finish_reason"] == "length"
            and len(ignoring[index]["token_ids"]) == max_tokens
        )
        assert ignoring[index]["token_ids"][stop_at] == eos
    finally:
        llm.exit()
