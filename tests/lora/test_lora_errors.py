"""Bad adapters and bad LoRA calls: a ValueError or TypeError naming the adapter, the tensor or
key and the value; nothing of the call is queued and the engine keeps serving."""

import json
import os
import shutil

import pytest
import torch
from lora_helpers import adapter_tensors, build_base, make_llm, peft_model, prompts, save_adapter

from nanovllm import SamplingParams
from nanovllm.lora.request import LoRARequest

NAME = "base_model.model.model.layers.{}.self_attn.q_proj.lora_{}.weight"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-errors")
    base = build_base(str(root / "base"), "qwen3", seed=5)
    model = peft_model(base, 31, targets=["q_proj", "v_proj"])
    good = save_adapter(model, str(root / "good"))
    llm = make_llm(base, max_loras=2, max_lora_rank=8)
    yield llm, root, good, adapter_tensors(model)
    llm.exit()


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def folder_with(root, good: str, name: str, config=None, drop=None, raw=None) -> str:
    path = str(root / name)
    shutil.copytree(good, path, dirs_exist_ok=True)
    config_file = os.path.join(path, "adapter_config.json")
    if config is not None:
        data = json.load(open(config_file)) | config
        json.dump(data, open(config_file, "w"))
    if raw is not None:
        open(config_file, "w").write(raw)
    if drop is not None:
        os.remove(os.path.join(path, drop))
    return path


def tensor_cases(tensors: dict) -> list:
    a0, b0 = NAME.format(0, "A"), NAME.format(0, "B")
    return [
        (
            {a0: tensors[a0][:, :63]},
            r"tensor '.*q_proj.lora_A.weight' has shape \(8, 63\), the "
            r"base model's q_proj needs \(8, 64\) \(r=8\)",
        ),
        ({a0: tensors[a0]}, r"layer 0 q_proj has no lora_B weight"),
        (
            {NAME.format(5, "A"): tensors[a0], NAME.format(5, "B"): tensors[b0]},
            r"layer 5, the model has 2",
        ),
        (
            {"model.embed_tokens.weight": torch.zeros(512, 64)},
            r"'model.embed_tokens.weight' is "
            "not a LoRA A/B weight",
        ),
        ({a0: [[0.0]], b0: tensors[b0]}, r"must be a 2-D torch.Tensor"),
        ({a0.replace("q_proj", "lm_head"): tensors[a0]}, r"module 'lm_head' is not supported"),
    ]


def config_cases() -> list:
    return [
        (
            dict(target_modules=["q_proj", "embed_tokens"]),
            r"target module 'embed_tokens' is not "
            r"supported; supported: q_proj",
        ),
        (dict(r=32), r"r=32 is above max_lora_rank=8"),
        (dict(bias="all"), r"bias='all' is not supported \(only 'none'\)"),
        (dict(use_dora=True), r"use_dora=True is not supported"),
        (dict(peft_type="IA3"), r"peft_type 'IA3' is not supported"),
    ]


def assert_serving(llm, good: str) -> None:
    assert llm.core.requests == {} and llm.core.scheduler.is_finished()
    lora = LoRARequest("good", 1, good)
    outs = llm.generate(prompts()[:2], greedy(), False, [lora, None])
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4]


def test_bad_folders_are_refused(setup):
    llm, root, good, _ = setup
    cases = [(str(root / "missing"), r"adapter_config.json does not exist")]
    cases.append((folder_with(root, good, "nojson", raw="{"), r"cannot read"))
    no_weights = folder_with(root, good, "noweights", drop="adapter_model.safetensors")
    cases.append((no_weights, r"adapter_model.safetensors does not exist"))
    for i, (config, match) in enumerate(config_cases()):
        cases.append((folder_with(root, good, f"config{i}", config=config), match))
    for i, (path, match) in enumerate(cases):
        bad = LoRARequest(f"bad{i}", 10 + i, path)
        with pytest.raises(ValueError, match=rf"LoRA adapter 'bad{i}': .*{match}"):
            llm.generate(prompts()[:2], greedy(), False, [None, bad])  # all or nothing
        assert_serving(llm, good)


def test_bad_tensors_are_refused(setup):
    llm, _, good, (tensors, config) = setup
    for i, (bad, match) in enumerate(tensor_cases(tensors)):
        request = LoRARequest(f"t{i}", 20 + i, lora_tensors=bad, peft_config=config)
        with pytest.raises(ValueError, match=rf"LoRA adapter 't{i}': .*{match}"):
            llm.add_lora(request)
        assert 20 + i not in llm.list_loras()
    assert_serving(llm, good)


def test_bad_requests_and_calls(setup, tmp_path):
    llm, _, good, (tensors, config) = setup
    with pytest.raises(ValueError, match=r"lora_int_id must be an int >= 1, got 0"):
        LoRARequest("x", 0, good)
    with pytest.raises(ValueError, match=r"lora_path .* or lora_tensors with peft_config"):
        LoRARequest("x", 1)
    with pytest.raises(ValueError, match=r"give lora_tensors and peft_config together"):
        LoRARequest("x", 1, lora_tensors=tensors)
    with pytest.raises(ValueError, match=r"lora_request has 1 entries for 2 prompts"):
        llm.generate(prompts()[:2], greedy(), False, [LoRARequest("good", 1, good)])
    with pytest.raises(TypeError, match=r"lora_request must be a LoRARequest.*got str"):
        llm.generate(prompts()[:1], greedy(), False, good)
    # an adapter cannot be replaced while a request runs with it; the request is not disturbed
    request_id = llm.add_request(prompts()[0], greedy(), LoRARequest("good", 1, good))
    replace = LoRARequest("good", 1, lora_tensors=tensors, peft_config=config, load_inplace=True)
    for _ in range(2):  # queued, then running
        with pytest.raises(ValueError, match=r"adapter 1 \('good'\) cannot be replaced while"):
            llm.add_lora(replace)
        llm.step()
    with pytest.raises(ValueError, match=r"adapter 1 is in use by queued or running requests"):
        llm.remove_lora(1)
    done = {}
    while not llm.is_finished():
        done.update(llm.step()[0])
    assert len(done[request_id]) == 4
    assert llm.add_lora(replace) and llm.remove_lora(1)
    assert_serving(llm, good)


def test_lora_off_fp8_weights_and_exit(setup, tmp_path):
    llm, root, good, _ = setup
    from nanovllm import LLM

    base = os.path.dirname(good.rstrip("/")) + "/base"
    plain = LLM(base, device="cpu", num_kvcache_blocks=16, kvcache_block_size=16, max_model_len=64)
    with pytest.raises(ValueError, match=r"a lora_request was given but LoRA is off"):
        plain.generate(prompts()[:1], greedy(), False, LoRARequest("good", 1, good))
    assert len(plain.generate(prompts()[:1], greedy(), False)[0].outputs[0].token_ids) == 4
    plain.exit()
    with pytest.raises(RuntimeError, match="has exited"):
        plain.add_lora(LoRARequest("good", 1, good))
    with pytest.raises(ValueError, match=r"enable_lora=True with FP8 weights is not supported"):
        make_llm(base, quantization="fp8")
