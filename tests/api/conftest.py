"""Fixtures of the offline-API tests: one engine per test module on the tied checkpoint, the
reference tokenizer, a continuation with stop strings in it, a checkpoint whose EOS the greedy
continuation produces, and a tiny model with the whole Qwen3 vocabulary (for chat templates).
"""

from types import SimpleNamespace

import pytest
import torch
from api_helpers import (
    STOP_MAX_TOKENS,
    STOP_PROMPT,
    boundary_stop,
    copy_checkpoint,
    first_new_token,
    make_llm,
    run_to_completion,
)
from hf_reference import TIE_GAP
from transformers import AutoTokenizer

from nanovllm.utils.checkpoint import make_random_checkpoint


@pytest.fixture(scope="module")
def engine(ckpt_tied):
    engine = make_llm(ckpt_tied.path)
    yield engine
    engine.exit()


@pytest.fixture
def llm(engine):
    """The module's engine; what a failed test leaves queued is run off, not left to the next
    test."""
    yield engine
    run_to_completion(engine)


@pytest.fixture(scope="module")
def tokenizer(ckpt_tied):
    """The reference tokenizer: loaded here, not the engine's."""
    return AutoTokenizer.from_pretrained(ckpt_tied.path)


@pytest.fixture(scope="module")
def stop_case(ckpt_tied, hf_ref, tokenizer):
    """STOP_PROMPT's greedy continuation, a stop string spanning tokens ``k - 1`` and ``k``, a
    second one spanning ``k2 - 1`` and ``k2`` (later), and ``j``, the first position (from 3)
    whose token does not occur before it (a stop token id)."""
    ref = hf_ref.greedy(ckpt_tied.path, STOP_PROMPT, STOP_MAX_TOKENS)
    assert min(ref.gaps) > 100 * TIE_GAP, "the reference continuation must have no near-tie"
    k, stop = boundary_stop(tokenizer, ref.tokens, first=2)
    k2, stop2 = boundary_stop(tokenizer, ref.tokens, first=k + 1)
    text = tokenizer.decode(ref.tokens[: k + 1])
    at = text.find(stop)
    # the stop string starts in an earlier token and ends in token k
    assert at < len(tokenizer.decode(ref.tokens[:k])) < at + len(stop) < len(text), (text, stop)
    return SimpleNamespace(
        tokens=ref.tokens,
        k=k,
        stop=stop,
        k2=k2,
        stop2=stop2,
        text=text,
        at=at,
        j=first_new_token(ref),
    )


@pytest.fixture(scope="module")
def eos_case(ckpt_tied, hf_ref, tmp_path_factory):
    """A copy of ckpt_tied whose eos_token_id is the token STOP_PROMPT's greedy continuation
    produces first at position ``k``, and an engine on it."""
    ref = hf_ref.greedy(ckpt_tied.path, STOP_PROMPT, 20)
    k = first_new_token(ref)
    eos = ref.tokens[k]
    path = copy_checkpoint(
        ckpt_tied.path, str(tmp_path_factory.mktemp("qwen3-eos")), {"eos_token_id": eos}
    )
    engine = make_llm(path, num_kvcache_blocks=32)
    yield SimpleNamespace(path=path, llm=engine, eos=eos, k=k, tokens=ref.tokens)
    engine.exit()


@pytest.fixture(scope="module")
def full_vocab(tmp_path_factory):
    """A tiny random Qwen3 with the whole Qwen3 vocabulary, so that chat templates' special tokens
    are in it."""
    path = str(tmp_path_factory.mktemp("qwen3-full-vocab"))
    make_random_checkpoint(path, dtype=torch.float32, seed=3, std=0.3)
    engine = make_llm(path, num_kvcache_blocks=32, max_num_seqs=8)
    yield SimpleNamespace(path=path, llm=engine, tokenizer=AutoTokenizer.from_pretrained(path))
    engine.exit()
