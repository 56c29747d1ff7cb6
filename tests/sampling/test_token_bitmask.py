"""The mask path of structured outputs: the rows a step's grammars constrain (``build_step``),
the bitmask applied to their logits (``torch_ops.apply_token_bitmask``, checked bit by bit against
a reference in plain Python), the sampler drawing only allowed tokens while the other rows draw as
without any grammar, and a real xgrammar matcher's masks over the Qwen3 vocabulary."""

import numpy as np
import pytest
import torch
from sampling_helpers import make_batch, seq_with, step_rows

from nanovllm.features.structured_outputs.processor import GrammarProcessor
from nanovllm.sampling import torch_ops
from nanovllm.sampling.sampler import Sampler
from nanovllm.sampling_params import SamplingParams, StructuredOutputsParams
from nanovllm.utils.checkpoint import QWEN3_VOCAB_SIZE, TOKENIZER_DIR


class FakeGrammar:
    """A matcher that allows a fixed set of tokens (the sampling side needs only this much)."""

    def __init__(self, allowed: set[int], bitmask_width: int):
        self.allowed, self.bitmask_width = allowed, bitmask_width

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        words = [0] * self.bitmask_width
        for t in self.allowed:
            words[t // 32] |= 1 << (t % 32)
        bitmask[row] = np.array(words, dtype=np.uint32).view(np.int32)


def allowed_by(bitmask_row: list[int], vocab: int) -> list[bool]:
    """Which of ``vocab`` tokens a bitmask row allows, bit by bit in Python."""
    return [
        t // 32 < len(bitmask_row) and (bitmask_row[t // 32] >> (t % 32)) & 1 == 1
        for t in range(vocab)
    ]


def test_apply_token_bitmask_matches_the_bits():
    g = torch.Generator().manual_seed(0)
    vocab = 100  # 4 words cover 128 tokens; the third row's 3 words leave tokens 96..99 uncovered
    bitmask = torch.randint(-(2**31), 2**31, (2, 4), generator=g, dtype=torch.int64).to(torch.int32)
    bitmask[1, 3] = -(2**31)  # only bit 31: token 127, past the vocabulary
    logits = torch.randn(4, vocab, generator=g)
    out = logits.clone()
    torch_ops.apply_token_bitmask(out, torch.tensor([0, 2]), bitmask)
    narrow = logits.clone()
    torch_ops.apply_token_bitmask(narrow, torch.tensor([3]), bitmask[:1, :3])
    for row, mask_row, got in [
        (0, bitmask[0], out),
        (2, bitmask[1], out),
        (3, bitmask[0, :3], narrow),
    ]:
        allowed = allowed_by(mask_row.tolist(), vocab)
        expected = torch.where(torch.tensor(allowed), logits[row], float("-inf"))
        assert torch.equal(got[row], expected), row
    assert torch.equal(out[[1, 3]], logits[[1, 3]])  # rows without a mask are untouched


def test_only_the_sampling_rows_with_a_grammar_are_masked_and_the_step_is_not_plain():
    plain = seq_with(SamplingParams(temperature=0.7))
    assert step_rows([plain]).plain
    constrained = seq_with(SamplingParams(temperature=0.7))
    constrained.processors = [GrammarProcessor(FakeGrammar({3, 40, 65}, bitmask_width=3))]
    chunk = seq_with(SamplingParams(temperature=0.7), prompt=list(range(40)))
    chunk.processors = [GrammarProcessor(FakeGrammar({5}, bitmask_width=3))]
    chunk.num_scheduled_tokens = 16  # the first of three prompt chunks: it samples nothing
    for seq in (plain, constrained):
        seq.num_cached_tokens, seq.num_scheduled_tokens = len(seq) - 1, 1
    rows = step_rows([plain, constrained, chunk])
    assert not rows.plain and rows.extra.sync
    grammar_rows, bitmask = rows.extra.bitmask_rows, np.concatenate(rows.extra.bitmasks)
    assert grammar_rows == [1] and bitmask.dtype == np.int32
    assert [t for t, ok in enumerate(allowed_by(bitmask[0].tolist(), 96)) if ok] == [3, 40, 65]


def test_the_sampler_draws_allowed_tokens_and_other_rows_as_without_a_grammar(model_logits):
    """Rows: greedy with a grammar, temperature 1 with a grammar and top-k, temperature 1 without
    one, greedy without one; 64 seeds each. The grammar rows never leave their allowed tokens,
    the greedy one takes the best of them, and the other rows draw what they draw alone."""
    logits = model_logits  # [4, 512]
    allowed = [set(range(0, 512, 7)), {1, 2, 3, 500, 511}]
    best = max(allowed[0], key=lambda t: float(logits[0, t]))
    for seed in range(64):
        params = [
            SamplingParams(temperature=0, seed=seed),
            SamplingParams(temperature=1.0, top_k=3, seed=seed),
            SamplingParams(temperature=1.0, seed=seed),
            SamplingParams(temperature=0, seed=seed),
        ]
        seqs = [seq_with(p) for p in params]
        for seq, ok in zip(seqs[:2], allowed):
            seq.processors = [GrammarProcessor(FakeGrammar(ok, bitmask_width=16))]
            seq.num_cached_tokens, seq.num_scheduled_tokens = (
                len(seq) - 1,
                1,
            )  # decoding: it samples
        tokens = Sampler()(logits, make_batch(seqs, 512)).token_ids.tolist()
        alone = Sampler()(
            logits[2:], make_batch([seq_with(p) for p in params[2:]], 512)
        ).token_ids.tolist()
        assert tokens[0] == best
        assert tokens[1] in allowed[1]
        assert tokens[2:] == alone


@pytest.fixture(scope="module")
def compiler():
    from nanovllm.features.structured_outputs.grammar import GrammarCompiler
    from nanovllm.utils.model_folder import load_tokenizer

    tokenizer = load_tokenizer(TOKENIZER_DIR)
    return GrammarCompiler(tokenizer, QWEN3_VOCAB_SIZE, [151645]), tokenizer


def test_a_real_matchers_masks_keep_a_draw_in_its_regex(compiler):
    """``[0-9]{2}`` over the whole Qwen3 vocabulary (151,936 logits, more than the tokenizer's
    151,669 tokens): every drawn token decodes to digits, and after two digits only EOS is left."""
    grammars, tokenizer = compiler
    so = StructuredOutputsParams(regex="[0-9]{2}")
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(1, QWEN3_VOCAB_SIZE, generator=g) * 3
    for seed in range(8):
        seq = seq_with(SamplingParams(temperature=1.0, seed=seed))
        grammar = grammars.matcher(so)
        seq.processors = [GrammarProcessor(grammar)]
        text = ""
        for _ in range(3):
            seq.num_cached_tokens, seq.num_scheduled_tokens = (
                len(seq) - 1,
                1,
            )  # it samples this step
            token = Sampler()(logits, make_batch([seq], QWEN3_VOCAB_SIZE)).token_ids.item()
            seq.append_placeholder(-1)
            seq.set_token(len(seq) - 1, token)
            ended = seq.processors[0].accept(seq, token)
            if token == 151645:
                break
            text += tokenizer.decode([token])
            assert text.isdigit() and len(text) <= 2, text
        assert token == 151645 and len(text) == 2 and ended and grammar.is_terminated, (text, token)
    bitmask = np.empty((1, grammar.bitmask_width), dtype=np.int32)
    fresh = grammars.matcher(so)
    fresh.fill_bitmask(bitmask, 0)
    allowed = [t for t, ok in enumerate(allowed_by(bitmask[0].tolist(), QWEN3_VOCAB_SIZE)) if ok]
    assert allowed and all(t < len(tokenizer) for t in allowed)
    assert all(tokenizer.decode([t]).isdigit() for t in allowed)
    assert grammars.compile(so) is grammars.compile(
        StructuredOutputsParams(regex="[0-9]{2}")
    )  # compiled once
