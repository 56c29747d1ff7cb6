"""A broken model folder is a ValueError naming the file, key, tensor or value, raised before any
weight loads where it can be: missing tokenizer files, config.json without a key the model reads,
weights whose shapes disagree with config.json, a truncated safetensors file, a KV cache larger
than the machine, generation_config.json values SamplingParams rejects, and a prompt that cannot
be encoded."""

import json
import os
import re
import shutil

import pytest
import torch
from hf_reference import build_checkpoint, edit_json
from safetensors.torch import load_file, save_file

from nanovllm.config import Config
from nanovllm.engine.input_processor import prompt_token_ids
from nanovllm.models.registry import model_class
from nanovllm.utils.loader import load_model
from nanovllm.utils.model_folder import (
    TOKENIZER_FILES,
    load_tokenizer,
    read_generation_config,
    sampling_defaults,
)

# the tiny checkpoint of build_checkpoint: float32, 2 layers, 2 KV heads of 32, vocab 512
LAYERS, KV_HEADS, HEAD_DIM, VOCAB = 2, 2, 32, 512


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("good-folder"))
    build_checkpoint(
        path, seed=5, rope_theta=10000.0, rope_style="top-level", tie_word_embeddings=True
    )
    return path


@pytest.fixture
def folder(base, tmp_path) -> str:
    """A copy of the good folder, for a test to break."""
    path = str(tmp_path / "model")
    shutil.copytree(base, path)
    return path


def build_model(path: str):
    hf_config = Config(path, device="cpu", kvcache_block_size=16).hf_config
    model = model_class(hf_config)(hf_config)
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(float("nan"))  # a sentinel: no weight may load before the checks
    return model


def assert_nothing_loaded(model) -> None:
    assert all(torch.isnan(p).all() for p in model.parameters())


# ---- tokenizer ----------------------------------------------------------------------------------


def test_good_folder_loads(base):
    tokenizer = load_tokenizer(base)
    assert tokenizer.encode("hello world")
    load_model(build_model(base), base)
    assert read_generation_config(base)["temperature"] == 0.6  # Qwen3's recommended settings


def test_folder_without_tokenizer_files(folder):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        os.remove(os.path.join(folder, name))
    with pytest.raises(ValueError) as e:
        load_tokenizer(folder)
    message = str(e.value)
    assert folder in message and "tokenizer.json" in message and "tokenizer.model" in message, (
        message
    )
    assert "tokenizer.json" in TOKENIZER_FILES


def test_unreadable_tokenizer_json_names_the_folder(folder):
    with open(os.path.join(folder, "tokenizer.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(ValueError, match="tokenizer") as e:
        load_tokenizer(folder)
    assert folder in str(e.value)


# ---- config.json --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key",
    ["num_attention_heads", "hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size"],
)
def test_config_without_a_required_key(folder, key):
    edit_json(folder, "config.json", **{key: None})
    with pytest.raises(ValueError) as e:
        Config(folder, device="cpu", kvcache_block_size=16)
    message = str(e.value)
    assert "config.json" in message and key in message, message


@pytest.mark.parametrize(
    "changes, words",
    [
        (dict(hidden_size=0), ["hidden_size", "0"]),
        (dict(num_hidden_layers="2"), ["num_hidden_layers", "'2'"]),
        (dict(num_attention_heads=3), ["num_attention_heads", "3", "num_key_value_heads", "2"]),
        (dict(head_dim=None, hidden_size=66), ["hidden_size", "66", "num_attention_heads"]),
    ],
)
def test_config_with_a_bad_value(folder, changes, words):
    edit_json(folder, "config.json", **changes)
    with pytest.raises(ValueError) as e:
        Config(folder, device="cpu", kvcache_block_size=16)
    message = str(e.value)
    assert "config.json" in message and all(w in message for w in words), message


def test_config_json_that_is_not_json(folder):
    with open(os.path.join(folder, "config.json"), "w") as f:
        f.write('{"hidden_size": 64,')
    with pytest.raises(ValueError, match="config.json"):
        Config(folder, device="cpu", kvcache_block_size=16)


# ---- weights ------------------------------------------------------------------------------------


def test_intermediate_size_that_does_not_match_the_weights(folder):
    edit_json(folder, "config.json", intermediate_size=1024)
    model = build_model(folder)
    with pytest.raises(ValueError) as e:
        load_model(model, folder)
    message = str(e.value)
    pattern = (
        r"'model\.layers\.\d\.mlp\.\w+_proj\.weight'.*model\.safetensors"
        r".*\((128, 64|64, 128)\).*\((1024, 64|64, 1024)\)"
    )
    assert re.search(pattern, message), message
    assert_nothing_loaded(model)


def rewrite_weights(folder: str, **tensors) -> None:
    path = os.path.join(folder, "model.safetensors")
    weights = load_file(path)
    weights.update(tensors)
    save_file(weights, path)


def test_tensor_that_would_broadcast_silently(folder):
    rewrite_weights(folder, **{"model.norm.weight": torch.ones(1)})
    model = build_model(folder)
    with pytest.raises(ValueError) as e:
        load_model(model, folder)
    message = str(e.value)
    for word in ("model.norm.weight", "model.safetensors", "(1,)", "(64,)"):
        assert word in message, message
    assert_nothing_loaded(model)


def test_tensor_larger_than_the_model_is_not_cut(folder):
    weights = load_file(os.path.join(folder, "model.safetensors"))
    wider = torch.zeros(
        64, 256
    )  # o_proj's input would silently be narrowed to its first 128 columns
    rewrite_weights(folder, **{"model.layers.1.self_attn.o_proj.weight": wider})
    assert weights["model.layers.1.self_attn.o_proj.weight"].shape == (64, 128)
    model = build_model(folder)
    with pytest.raises(ValueError, match=r"o_proj.weight.*\(64, 256\).*\(64, 128\)"):
        load_model(model, folder)


def test_tensor_the_model_does_not_have(folder):
    rewrite_weights(folder, **{"model.layers.0.mlp.extra.weight": torch.zeros(3)})
    model = build_model(folder)
    with pytest.raises(ValueError, match="model.layers.0.mlp.extra.weight.*model.safetensors"):
        load_model(model, folder)
    assert_nothing_loaded(model)


@pytest.mark.parametrize("keep", [0.5, 5 / 1e9])
def test_truncated_safetensors(folder, keep):
    path = os.path.join(folder, "model.safetensors")
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[: max(5, int(len(data) * keep))])
    model = build_model(folder)
    with pytest.raises(ValueError) as e:
        load_model(model, folder)
    assert path in str(e.value), str(e.value)
    assert_nothing_loaded(model)


# ---- KV cache size ------------------------------------------------------------------------------


def machine_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@pytest.mark.parametrize(
    "kv_cache_dtype, row_bytes", [("auto", HEAD_DIM * 4), ("fp8", HEAD_DIM + 4)]
)
def test_kv_cache_larger_than_the_machine(base, kv_cache_dtype, row_bytes):
    block_bytes = (
        2 * LAYERS * 16 * KV_HEADS * row_bytes
    )  # float32 on the CPU; fp8 adds a float32 scale per row
    with pytest.raises(ValueError) as e:
        Config(
            base,
            device="cpu",
            kvcache_block_size=16,
            num_kvcache_blocks=10**9,
            kv_cache_dtype=kv_cache_dtype,
        )
    message = str(e.value)
    for word in (
        "num_kvcache_blocks",
        "1000000000",
        str(machine_memory() // block_bytes),
        str(block_bytes),
    ):
        assert word in message, message
    fits = machine_memory() // block_bytes
    Config(
        base,
        device="cpu",
        kvcache_block_size=16,
        num_kvcache_blocks=fits,
        kv_cache_dtype=kv_cache_dtype,
    )
    with pytest.raises(ValueError, match="num_kvcache_blocks"):
        Config(
            base,
            device="cpu",
            kvcache_block_size=16,
            num_kvcache_blocks=fits + 1,
            kv_cache_dtype=kv_cache_dtype,
        )


def test_kv_cache_of_several_cpu_ranks_shares_the_machine(base):
    """Each of two CPU ranks holds one KV head of two: together they need what one rank would."""
    fits = machine_memory() // (2 * LAYERS * 16 * KV_HEADS * HEAD_DIM * 4)
    Config(
        base, device="cpu", kvcache_block_size=16, num_kvcache_blocks=fits, tensor_parallel_size=2
    )
    with pytest.raises(ValueError, match=f"at most {fits} "):
        Config(
            base,
            device="cpu",
            kvcache_block_size=16,
            num_kvcache_blocks=fits + 1,
            tensor_parallel_size=2,
        )


# ---- generation_config.json ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "key, value",
    [
        ("temperature", -1),
        ("top_p", 1.5),
        ("top_k", "20"),
        ("max_new_tokens", 0),
        ("repetition_penalty", 0),
        ("eos_token_id", -3),
        ("eos_token_id", [1, "2"]),
    ],
)
def test_generation_config_value_that_sampling_params_rejects(folder, key, value):
    edit_json(folder, "generation_config.json", **{key: value})
    with pytest.raises(ValueError) as e:
        read_generation_config(folder)
    message = str(e.value)
    for word in (
        "generation_config.json",
        key,
        json.dumps(value) if isinstance(value, list) else repr(value),
    ):
        assert word in message, message


def test_generation_config_that_is_not_an_object(folder):
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        f.write("[1, 2]")
    with pytest.raises(ValueError, match="generation_config.json"):
        read_generation_config(folder)


def test_generation_config_defaults(folder):
    edit_json(
        folder, "generation_config.json", max_new_tokens=12, top_k=None, temperature=0.0, min_p=None
    )
    config = read_generation_config(folder)
    assert sampling_defaults(config) == dict(temperature=0.0, top_p=0.95, max_tokens=12)
    os.remove(os.path.join(folder, "generation_config.json"))
    assert read_generation_config(folder) == {} and sampling_defaults({}) == {}


# ---- prompts ------------------------------------------------------------------------------------


def test_prompt_with_a_lone_surrogate(base):
    tokenizer = load_tokenizer(base)
    with pytest.raises(ValueError) as e:
        prompt_token_ids("ab\ud800c", tokenizer, VOCAB, "prompt 3")
    message = str(e.value)
    assert "prompt 3" in message and "character 2" in message and "\\ud800" in message, message
    assert prompt_token_ids("abc", tokenizer, 200_000, "prompt 0") == tokenizer.encode("abc")
