"""A model folder's tokenizer and JSON files, checked at start-up (a ValueError names the file)."""

import json
import os

from nanovllm.sampling_params import SamplingParams

# files one of which a Hugging Face tokenizer is built from
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
TOKENIZER_FILES += ("sentencepiece.bpe.model",)
# generation_config.json key -> the SamplingParams field it sets a default for (as vLLM reads them)
GENERATION_CONFIG_FIELDS = {
    **{key: key for key in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")},
    "max_new_tokens": "max_tokens",
}


def read_json(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def load_tokenizer(model_dir: str):
    present = [name for name in TOKENIZER_FILES if os.path.isfile(os.path.join(model_dir, name))]
    if not present:
        msg = f"has no tokenizer: none of {', '.join(TOKENIZER_FILES)} is there"
        raise ValueError(f"model folder {model_dir!r} {msg}")
    from transformers import AutoTokenizer

    files = ", ".join(present)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except OSError:
        raise
    except Exception as e:  # tokenizers' own errors name no file
        raise ValueError(f"cannot load the tokenizer of {model_dir!r} (from {files}): {e}") from e
    if not tokenizer.encode("hello", add_special_tokens=False):
        raise ValueError(f"the tokenizer of {model_dir!r} (from {files}) encodes text to no tokens")
    return tokenizer


def read_generation_config(model_dir: str) -> dict:
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    config = read_json(path)
    for key, name in GENERATION_CONFIG_FIELDS.items():
        if config.get(key) is not None:
            _check_defaults(path, key, {name: config[key]})
    _check_defaults(path, ", ".join(GENERATION_CONFIG_FIELDS), sampling_defaults(config))
    eos = config.get("eos_token_id")
    ids = eos if isinstance(eos, list) else [eos]
    if eos is not None and not all(type(t) is int and t >= 0 for t in ids):
        msg = f"must be a token id >= 0 or a list of them, got {json.dumps(eos)}"
        raise ValueError(f"{path}: eos_token_id {msg}")
    return config


def sampling_defaults(generation_config: dict) -> dict:
    fields = GENERATION_CONFIG_FIELDS.items()
    return {
        name: generation_config[k] for k, name in fields if generation_config.get(k) is not None
    }


def _check_defaults(path: str, key: str, kwargs: dict) -> None:
    try:
        SamplingParams(**kwargs)
    except (TypeError, ValueError) as e:
        value = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        raise ValueError(f"{path}: {key} is not a valid default ({value}): {e}") from None
