"""FP8 weights end to end on the CPU: a tiny checkpoint in Qwen's FP8 format (128x128 blocks) gives
the greedy tokens and log-probabilities of an independent reference (``fp8_reference``:
transformers on the dequantized weights with per-token, per-128-channel activation quantization),
which a weight-only reference misses by far more; ``quantization="fp8"`` on a float checkpoint
equals the FP8 checkpoint written from it; two ranks equal one, and ``update_weights`` takes float
or float8+scale tensors on both; Qwen3-MoE; bad formats and combinations fail before any weight
loads."""

import os
import statistics

import pytest
import torch
from fp8_reference import load_reference, reference_logprobs, write_dequantized, write_fp8_from
from hf_reference import VOCAB_SIZE, edit_json, random_prompts
from safetensors.torch import load_file

from nanovllm import LLM, SamplingParams
from nanovllm.utils.checkpoint import make_random_checkpoint

TINY = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=256,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=128,
    num_hidden_layers=2,
    max_position_embeddings=512,
    bos_token_id=0,
    eos_token_id=VOCAB_SIZE + 1,
    tie_word_embeddings=False,
)
MOE = dict(
    TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128, mlp_only_layers=[1]
)
CPU = dict(device="cpu", kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=256)
PROMPTS = random_prompts(11, [5, 20, 37])
GREEDY = SamplingParams(temperature=0, max_tokens=8, logprobs=0)
TIE = 1e-4  # reference top-2 logits closer than this: either token is right
# MEDIAN_ONLY: an activation value within float32 rounding of an e4m3 rounding boundary may round
# the other way in the reference; with these large random weights one such flip moves later
# log-probabilities by up to ~0.2 (perturbing the reference's own activations by 3e-7 does the
# same to most positions). So the log-probabilities are compared by their median error.


def write(root, name: str, seed: int, quantization=None, shape="tiny", config=TINY) -> str:
    return make_random_checkpoint(
        str(root / name),
        shape,
        dtype=torch.bfloat16,
        seed=seed,
        std=0.3,
        quantization=quantization,
        **config,
    )


def generate(llm: LLM) -> tuple[list[list[int]], list[list[float]]]:
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return (
        [o["token_ids"] for o in outputs],
        [[entry[t] for entry, t in zip(o["logprobs"], o["token_ids"])] for o in outputs],
    )


def logprob_errors(model, tokens, logprobs) -> list[float]:
    """|engine - reference| log-probability of each generated token; the tokens must be the
    reference's argmax (up to a tie, after which the sequence is not compared further)."""
    errors = []
    for prompt, toks, lps in zip(PROMPTS, tokens, logprobs):
        ref, argmax, gaps = reference_logprobs(model, prompt, toks)
        for j, tok in enumerate(toks):
            if tok != argmax[j]:
                assert gaps[j] < TIE, (
                    f"token {j} of prompt {prompt}: {tok}, reference {argmax[j]} "
                    f"(gap {gaps[j]:.3g})"
                )
                break
            errors.append(abs(lps[j] - ref[j]))
    return errors


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """(bf16 checkpoint, the FP8 checkpoint written from it here, its outputs on one rank)."""
    root = tmp_path_factory.mktemp("fp8-dense")
    bf16 = write(root, "bf16", seed=3)
    fp8 = write_fp8_from(bf16, str(root / "fp8"))
    with LLM(fp8, **CPU) as llm:
        assert llm.config.weight_quantization == "fp8"  # from config.json, with quantization=None
        out = generate(llm)
    return bf16, fp8, out


def assert_matches_w8a8_reference(fp8: str, dequantized: str, tokens, logprobs) -> None:
    """The engine's tokens and logprobs against the W8A8 reference (median error, see MEDIAN_ONLY),
    which weight-only dequantization (activations in float32) misses by far more."""
    dequantized = write_dequantized(fp8, dequantized)
    errors = logprob_errors(load_reference(dequantized), tokens, logprobs)
    assert len(errors) >= 20
    assert statistics.median(errors) < 1e-4, errors
    weight_only = logprob_errors_unchecked(
        load_reference(dequantized, activations=False), tokens, logprobs
    )
    assert statistics.median(weight_only) > 1e-2, weight_only


def test_fp8_checkpoint_matches_the_w8a8_reference(dense, tmp_path):
    _, fp8, (tokens, logprobs) = dense
    assert_matches_w8a8_reference(fp8, str(tmp_path / "dequantized"), tokens, logprobs)


def logprob_errors_unchecked(model, tokens, logprobs) -> list[float]:
    return [
        abs(a - b)
        for prompt, toks, lps in zip(PROMPTS, tokens, logprobs)
        for a, b in zip(lps, reference_logprobs(model, prompt, toks)[0])
    ]


def test_quantize_at_load_equals_the_written_fp8_checkpoint(dense, tmp_path):
    bf16, fp8, expected = dense
    # make_random_checkpoint(quantization="fp8") writes the same bytes as this file's quantizer
    library = load_file(
        os.path.join(write(tmp_path, "lib-fp8", seed=3, quantization="fp8"), "model.safetensors")
    )
    ours = load_file(os.path.join(fp8, "model.safetensors"))
    assert library.keys() == ours.keys()
    for name, t in ours.items():
        assert library[name].dtype == t.dtype and torch.equal(
            library[name].view(torch.uint8), t.view(torch.uint8)
        ), name
    with LLM(bf16, quantization="fp8", **CPU) as llm:
        assert generate(llm) == expected
    with LLM(fp8, quantization="fp8", **CPU) as llm:  # asking for what the checkpoint is: fine
        assert generate(llm) == expected


def assert_same(got, expected, tol: float = 1e-4) -> None:
    assert got[0] == expected[0]
    for a, b in zip(got[1], expected[1]):
        assert a == pytest.approx(b, abs=tol)


def test_two_ranks_equal_one_and_update_weights(dense, tmp_path):
    _, fp8, expected = dense
    other_bf16 = write(tmp_path, "other-bf16", seed=4)
    other_fp8 = write_fp8_from(other_bf16, str(tmp_path / "other-fp8"))
    with LLM(other_fp8, **CPU) as llm:
        other = generate(llm)
    assert other[0] != expected[0]
    with LLM(fp8, tensor_parallel_size=2, **CPU) as llm:
        assert_same(generate(llm), expected)
        llm.update_weights(
            load_file(os.path.join(other_fp8, "model.safetensors"))
        )  # float8 weights + scales
        assert_same(generate(llm), other)
        llm.update_weights(load_file(os.path.join(fp8, "model.safetensors")).items())
        assert_same(generate(llm), expected)
        llm.update_weights(
            load_file(os.path.join(other_bf16, "model.safetensors"))
        )  # bf16: quantized on load
        assert_same(generate(llm), other)


def test_update_weights_refuses_float8_without_scales(dense, tmp_path):
    _, fp8, expected = dense
    tensors = load_file(os.path.join(fp8, "model.safetensors"))
    name = "model.layers.0.self_attn.k_proj.weight"
    with LLM(fp8, **CPU) as llm:
        with pytest.raises(ValueError, match=rf"{name}.*without its scales.*{name}_scale_inv"):
            llm.update_weights({name: torch.zeros_like(tensors[name])})
        with pytest.raises(
            ValueError, match=rf"scale '{name}_scale_inv'.* without its float8_e4m3fn weight"
        ):
            llm.update_weights({name + "_scale_inv": tensors[name + "_scale_inv"] * 2})
        embed = "model.embed_tokens.weight"
        with pytest.raises(TypeError, match=rf"{embed}.*float8_e4m3fn.*parameter"):
            llm.update_weights({embed: tensors[embed].to(torch.float8_e4m3fn)})
        assert generate(llm) == expected  # nothing was written


def test_qwen3_moe_fp8_matches_the_w8a8_reference(tmp_path):
    fp8 = write(tmp_path, "moe-fp8", seed=5, quantization="fp8", shape="qwen3-30b-a3b", config=MOE)
    with LLM(fp8, **CPU) as llm:
        tokens, logprobs = generate(llm)
    assert_matches_w8a8_reference(fp8, str(tmp_path / "moe-dequantized"), tokens, logprobs)


@pytest.fixture(scope="module")
def fp8_folder(tmp_path_factory):
    return write(tmp_path_factory.mktemp("fp8-config"), "fp8", seed=6, quantization="fp8")


def with_config(src: str, dst, **changes) -> str:
    """A copy of ``src``'s config.json (and tokenizer; no weights) with ``changes``: anything that
    fails must fail before weights load."""
    os.makedirs(dst, exist_ok=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        with open(os.path.join(src, name), "rb") as f, open(os.path.join(dst, name), "wb") as g:
            g.write(f.read())
    edit_json(str(dst), **changes)
    return str(dst)


QUANT = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            dict(quantization_config=QUANT | {"weight_block_size": [64, 64]}),
            r"weight_block_size \[64, 64\].*\[128, 128\]",
        ),
        (
            dict(quantization_config=QUANT | {"quant_method": "awq"}),
            r"quant_method 'awq' is not supported",
        ),
        (
            dict(quantization_config=QUANT | {"activation_scheme": "static"}),
            r"activation_scheme 'static'",
        ),
        (
            dict(
                quantization_config=QUANT
                | {"modules_to_not_convert": ["model.layers.0.mlp.down_proj"]}
            ),
            r"modules_to_not_convert.*down_proj",
        ),
        (
            dict(head_dim=64, num_key_value_heads=1),
            r"k_proj/v_proj output \(num_key_value_heads \* head_dim\) is 64, "
            r"not a multiple of 128",
        ),
    ],
)
def test_bad_fp8_formats_fail_before_weights_load(fp8_folder, tmp_path, changes, message):
    folder = with_config(fp8_folder, tmp_path / "bad", **changes)
    with pytest.raises(ValueError, match=message):
        LLM(folder, **CPU)


def test_whole_blocks_are_accepted(fp8_folder, tmp_path):
    from nanovllm.config import Config

    for i, changes in enumerate(
        [dict(num_key_value_heads=1), dict(head_dim=64, hidden_size=128)]
    ):  # k/v 128, q 256
        assert (
            Config(with_config(fp8_folder, tmp_path / str(i), **changes), **CPU).weight_quantization
            == "fp8"
        )


def test_tp_shard_inside_a_block_and_bad_quantization_values(fp8_folder, tmp_path):
    folder = with_config(fp8_folder, tmp_path / "inter384", intermediate_size=384)
    with pytest.raises(
        ValueError, match=r"intermediate_size\) is 384, split over tensor_parallel_size=2 into 192"
    ):
        LLM(folder, tensor_parallel_size=2, **CPU)
    bf16 = with_config(fp8_folder, tmp_path / "bf16", quantization_config=None)
    with pytest.raises(ValueError, match=r"Config.quantization must be None or 'fp8', got 'int8'"):
        LLM(bf16, quantization="int8", **CPU)
    with pytest.raises(
        ValueError, match=r"weight_block_size \[64, 64\]"
    ):  # the checkpoint's format wins
        LLM(
            with_config(
                fp8_folder,
                tmp_path / "b64",
                quantization_config=QUANT | {"weight_block_size": [64, 64]},
            ),
            quantization="fp8",
            **CPU,
        )


def test_old_gpus_are_refused(fp8_folder, monkeypatch):
    from transformers import AutoConfig

    from nanovllm.quantization import resolve_quantization

    hf_config = AutoConfig.from_pretrained(fp8_folder)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match=r"compute capability 8.9 or newer, this one has 8.0"):
        resolve_quantization(None, hf_config, 1, "cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert resolve_quantization(None, hf_config, 1, "cuda") == "fp8"


@pytest.mark.parametrize(
    "shape", ["llama3.2-1b", "qwen2.5-0.5b"]
)  # Qwen2: biases on q/k/v stay in float
def test_llama_and_qwen2_quantized_at_load_match_the_reference(tmp_path, shape):
    bf16 = make_random_checkpoint(
        str(tmp_path / shape),
        shape,
        dtype=torch.bfloat16,
        seed=7,
        std=0.3,
        **(TINY | dict(tie_word_embeddings=True)),
    )
    with LLM(bf16, quantization="fp8", **CPU) as llm:
        tokens, logprobs = generate(llm)
    dequantized = write_dequantized(
        write_fp8_from(bf16, str(tmp_path / "fp8")), str(tmp_path / "dequantized")
    )
    errors = logprob_errors(load_reference(dequantized), tokens, logprobs)
    assert len(errors) >= 20 and statistics.median(errors) < 1e-4, errors  # see MEDIAN_ONLY


def test_a_float8_weight_and_its_scales_come_as_a_pair(fp8_folder, tmp_path):
    """Checked over the headers of every file before any weight loads: a float8 weight without its
    scales, or scales beside a float weight (which would be quantized with scales of its own, and
    one of the two would be silently lost), are errors naming both tensors; a weight and its scales
    in two different files load."""
    from safetensors.torch import save_file

    tensors = load_file(os.path.join(fp8_folder, "model.safetensors"))
    name = "model.layers.1.self_attn.v_proj.weight"
    cases = {
        "no-scale": (
            {k: v for k, v in tensors.items() if k != name + "_scale_inv"},
            rf"weight '{name}' in .*no-scale is float8_e4m3fn "
            rf"without its scales '{name}_scale_inv'",
        ),
        "float-weight": (
            tensors | {name: tensors[name].float()},
            rf"scale '{name}_scale_inv' in .*float-weight comes without its float8_e4m3fn "
            rf"weight '{name}'",
        ),
    }
    for case, (changed, message) in cases.items():
        folder = with_config(fp8_folder, tmp_path / case)
        save_file(changed, os.path.join(folder, "model.safetensors"))
        with pytest.raises(ValueError, match=message):
            LLM(folder, **CPU)
    folder = with_config(fp8_folder, tmp_path / "two-files")
    save_file(
        {k: v for k, v in tensors.items() if k != name + "_scale_inv"},
        os.path.join(folder, "a.safetensors"),
    )
    save_file(
        {name + "_scale_inv": tensors[name + "_scale_inv"]}, os.path.join(folder, "b.safetensors")
    )
    with LLM(folder, **CPU) as split:
        got = generate(split)
    with LLM(fp8_folder, **CPU) as whole:
        assert got == generate(whole)


@pytest.mark.parametrize(
    "quantization, changes, want",
    [
        # (input norm, post-attention norm, SiLU-and-mul, attention output) of layer 0 / layer 1
        ("fp8", {}, [(True, True, True, True)] * 2),
        (
            "fp8",
            dict(head_dim=64, hidden_size=128),
            [(True, True, True, False)] * 2,
        ),  # a group spans 2 heads
        (None, {}, [(False, False, False, False)] * 2),
        (
            "fp8",
            MOE,
            [(True, False, None, True), (True, True, True, True)],
        ),  # the router reads bf16 rows
    ],
)
def test_which_ops_hand_the_next_fp8_linear_its_input_quantized(quantization, changes, want):
    """The norms, SiLU-and-mul and the attention's decode output are asked to quantize exactly where
    an FP8 linear reads them: in front of q/k/v, gate/up, down and o (head_dim 128), not in front of
    a MoE block, and never in a float model."""
    import transformers

    from nanovllm.models.registry import build_model
    from nanovllm.quantization.fp8_fused import QuantizedRMSNorm, QuantizedSiluAndMul

    arch, config_class = (
        ("Qwen3MoeForCausalLM", transformers.Qwen3MoeConfig)
        if "num_experts" in changes
        else ("Qwen3ForCausalLM", transformers.Qwen3Config)
    )
    hf_config = config_class(**(TINY | changes), architectures=[arch])
    model = build_model(hf_config, quantization)
    got = [
        (
            isinstance(layer.input_layernorm, QuantizedRMSNorm),
            isinstance(layer.post_attention_layernorm, QuantizedRMSNorm),
            isinstance(layer.mlp.act_fn, QuantizedSiluAndMul)
            if hasattr(layer.mlp, "act_fn")
            else None,
            layer.self_attn.attn.quantize_output,
        )
        for layer in model.model.layers
    ]
    assert got == want
