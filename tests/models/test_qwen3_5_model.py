"""Qwen3.5's hybrid text model (nanovllm/models/qwen3_5.py) against transformers'
Qwen3_5ForCausalLM, float32 on the CPU, from a tiny random checkpoint read by nano-vllm's loader:
one prompt standalone (temporary states, no KV cache); two prompts packed in one step with the
runner's states and a paged KV cache, then a decode step continuing both; and one Gated DeltaNet
layer fed in pieces; and the whole engine's greedy output."""

import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig
from transformers.models.qwen3_5 import modeling_qwen3_5 as ref
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

from nanovllm import LLM, SamplingParams
from nanovllm.layers.attention import Attention
from nanovllm.layers.attention.reference import TorchAttentionBackend
from nanovllm.layers.linear_attention.layer import GatedDeltaNet
from nanovllm.layers.linear_attention.states import StateBatch, state_batch
from nanovllm.models.registry import build_model
from nanovllm.utils.checkpoint import TOKENIZER_DIR
from nanovllm.utils.context import Context, step_context
from nanovllm.utils.loader import load_model

VOCAB, BLOCK = 512, 16
ATOL = 1e-4
ROT = 0.25  # 8 of each head's 32 dims rotate


def tiny_config(tie: bool) -> Qwen3_5TextConfig:
    return Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, partial_rotary_factor=ROT,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": ROT},
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, max_position_embeddings=512,
        tie_word_embeddings=tie, architectures=["Qwen3_5ForCausalLM"],
    )  # fmt: skip


def randomise(module: torch.nn.Module, seed: int, std: float = 0.3) -> None:
    """Large random weights (norm weights included) so logits stand apart and every part counts."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * std)


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def models(request, tmp_path_factory):
    config = tiny_config(request.param)
    hf = ref.Qwen3_5ForCausalLM(config).eval()
    randomise(hf, seed=3)
    path = str(tmp_path_factory.mktemp("qwen3_5"))
    hf.save_pretrained(path)
    hf_config = AutoConfig.from_pretrained(path)
    ours = build_model(hf_config)
    load_model(ours, path, hf_config)
    backend = TorchAttentionBackend()
    for m in ours.modules():
        if isinstance(m, Attention):
            m.backend = backend
    return hf, ours


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def prompt(seed: int, n: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def all_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    return F.linear(hidden, model.lm_head.weight)


def test_layers_and_weights(models):
    hf, ours = models
    kinds = [type(m) for m in ours.modules() if isinstance(m, (Attention, GatedDeltaNet))]
    assert kinds == [GatedDeltaNet] * 3 + [Attention]
    lin = ours.model.layers[0].linear_attn
    assert lin.state_shapes() == ((2 * 32 + 64, 3), (4, 16, 16))
    want = hf.model.layers[0].linear_attn.conv1d.weight
    assert torch.equal(lin.conv1d.weight, want)
    tied = ours.lm_head.weight is ours.model.embed_tokens.weight
    assert tied == hf.config.tie_word_embeddings
    assert torch.equal(ours.lm_head.weight, hf.lm_head.weight)


def test_one_prompt_standalone_matches_transformers(models):
    hf, ours = models
    ids = prompt(1, 77)  # longer than one 64-token chunk of the delta rule
    want = hf_logits(hf, ids)
    cu = torch.tensor([0, len(ids)], dtype=torch.int32)
    ctx = Context(True, cu, cu, len(ids), len(ids))
    with torch.no_grad(), step_context(ctx):
        hidden = ours(torch.tensor(ids), torch.arange(len(ids)))
        last = ours.compute_logits(hidden)
    torch.testing.assert_close(all_logits(ours, hidden), want, atol=ATOL, rtol=0)
    torch.testing.assert_close(last, want[-1:], atol=ATOL, rtol=0)
    assert (want.topk(2).values.diff(dim=-1).abs() > 1e-2).float().mean() > 0.9


def bind_states(model, slots: int) -> list[GatedDeltaNet]:
    """As the runner does: NaN-filled states (``fresh`` must ignore them) and a paged KV cache."""
    layers = [m for m in model.modules() if isinstance(m, GatedDeltaNet)]
    for m in layers:
        conv, rec = m.state_shapes()
        m.conv_states = torch.full((slots, *conv), float("nan"))
        m.recurrent_states = torch.full((slots, *rec), float("nan"))
    for m in model.modules():
        if isinstance(m, Attention):
            shape = (8, BLOCK, m.num_kv_heads, m.head_dim)
            m.k_cache, m.v_cache = torch.zeros(shape), torch.zeros(shape)
    return layers


def test_packed_prefill_then_decode_with_states(models):
    hf, ours = models
    prompts = [prompt(2, 21), prompt(3, 40)]
    nexts = [7, 301]
    layers = bind_states(ours, slots=3)
    slots, tables = [2, 0], torch.tensor([[5, 1, 6], [0, 3, 4]], dtype=torch.int32)
    try:
        # prefill: both prompts in one step
        ids = torch.tensor(prompts[0] + prompts[1])
        positions = torch.cat([torch.arange(len(p)) for p in prompts])
        lens = [len(p) for p in prompts]
        cu = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32)
        mapping = torch.cat(
            [tables[i][torch.arange(n) // BLOCK] * BLOCK + torch.arange(n) % BLOCK
             for i, n in enumerate(lens)]
        )  # fmt: skip
        ctx = Context(True, cu, cu, max(lens), max(lens), mapping)
        batch = StateBatch([0, lens[0]], lens, slots, [True, True])
        with torch.no_grad(), step_context(ctx), state_batch(batch):
            hidden = ours(ids, positions)
        got = all_logits(ours, hidden)
        torch.testing.assert_close(got[: lens[0]], hf_logits(hf, prompts[0]), atol=ATOL, rtol=0)
        torch.testing.assert_close(got[lens[0] :], hf_logits(hf, prompts[1]), atol=ATOL, rtol=0)
        for m in layers:  # slot 1 is no sequence's
            assert m.recurrent_states[1].isnan().all() and m.conv_states[1].isnan().all()
            assert m.recurrent_states[slots].isfinite().all()
        # decode: one more token each, states and KV cache carried
        positions = torch.tensor(lens)
        mapping = torch.stack(
            [tables[i][n // BLOCK] * BLOCK + n % BLOCK for i, n in enumerate(lens)]
        )
        ctx = Context(False, slot_mapping=mapping, context_lens=positions + 1, block_tables=tables)
        batch = StateBatch([0, 1], [1, 1], slots, [False, False])
        with torch.no_grad(), step_context(ctx), state_batch(batch):
            hidden = ours(torch.tensor(nexts), positions)
            got = ours.compute_logits(hidden)
        for i in range(2):
            want = hf_logits(hf, prompts[i] + [nexts[i]])[-1]
            torch.testing.assert_close(got[i], want, atol=ATOL, rtol=0)
    finally:
        for m in ours.modules():
            if isinstance(m, Attention):
                m.k_cache = m.v_cache = torch.tensor([])
            if isinstance(m, GatedDeltaNet):
                m.conv_states = m.recurrent_states = torch.tensor([])


def test_deltanet_layer_in_pieces_with_slots():
    """Two sequences sharing steps, each in uneven pieces, against the reference layer on each
    whole sequence; a slot no sequence names is left untouched."""
    config = tiny_config(False)
    hf_layer = ref.Qwen3_5GatedDeltaNet(config, 0).eval()
    randomise(hf_layer, seed=4)
    layer = GatedDeltaNet(config)
    layer.load_state_dict(hf_layer.state_dict())  # strict: the same names and shapes
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randn(n, 64, generator=gen) for n in (90, 33)]
    conv, rec = layer.state_shapes()
    layer.conv_states, layer.recurrent_states = torch.full((3, *conv), 9.0), torch.randn(3, *rec)
    untouched = layer.recurrent_states[1].clone()
    outs, done = [[], []], [0, 0]
    for pieces in [(70, 5), (1, 20), (19, 1), (0, 7)]:
        rows = [s[d : d + n] for s, d, n in zip(seqs, done, pieces)]
        starts = [0, pieces[0]]
        batch = StateBatch(starts, list(pieces), [2, 0], [d == 0 for d in done])
        with torch.no_grad(), state_batch(batch):
            out = layer(torch.cat(rows))
        for i in range(2):
            outs[i].append(out[starts[i] : starts[i] + pieces[i]])
            done[i] += pieces[i]
    with torch.no_grad():
        for i, x in enumerate(seqs):
            torch.testing.assert_close(torch.cat(outs[i]), hf_layer(x[None])[0], atol=ATOL, rtol=0)
    assert torch.equal(layer.recurrent_states[1], untouched)


def test_engine_greedy_matches_transformers(tmp_path):
    """The whole engine on the CPU (state slots, chunked prefill of the 90-token prompt, decode)
    against a transformers greedy loop that recomputes every sequence in full."""
    config = tiny_config(False)
    config.bos_token_id, config.eos_token_id = 0, 1  # EOS ignored below
    hf = ref.Qwen3_5ForCausalLM(config).eval()
    randomise(hf, seed=3)
    hf.save_pretrained(str(tmp_path))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(TOKENIZER_DIR, name), tmp_path)
    prompts = [prompt(10 + n, n) for n in (5, 40, 90, 17)]
    kwargs = dict(max_model_len=256, num_kvcache_blocks=64, kvcache_block_size=BLOCK)
    llm = LLM(str(tmp_path), enforce_eager=True, device="cpu", max_num_batched_tokens=64, **kwargs)
    try:
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.exit()
    for p, out in zip(prompts, outs):
        ids = list(p)
        for _ in range(12):
            ids.append(int(hf_logits(hf, ids)[-1].argmax()))
        assert out["token_ids"] == ids[len(p) :]
