"""Adapters against PEFT (float32, CPU): each adapter's greedy tokens and log-probabilities for
tiny Qwen3, Qwen2 and Llama models, alone and in one batch with the base model and the others."""

import pytest
from hf_reference import assert_greedy_match, greedy_logprobs
from lora_helpers import build_base, make_llm, peft_model, prompts, save_adapter

from nanovllm import SamplingParams
from nanovllm.lora.request import LoRARequest

MAX_TOKENS = 8
ADAPTERS = {  # name: (seed, PEFT options)
    "all": (11, dict(r=8, alpha=16)),
    "qv-rslora": (12, dict(targets=["q_proj", "v_proj"], r=4, alpha=8, use_rslora=True)),
    "mlp-o": (13, dict(targets=["o_proj", "gate_proj", "down_proj"], r=16, alpha=8)),
}


@pytest.fixture(scope="module", params=["qwen3", "qwen2", "llama"])
def setup(request, tmp_path_factory):
    """The base model, its adapters' folders, and PEFT's greedy reference for each."""
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    base = build_base(str(root / "base"), request.param)
    folders, refs = {}, {}
    for i, (name, (seed, options)) in enumerate(ADAPTERS.items()):
        model = peft_model(base, seed, **options)
        folders[name] = save_adapter(model, str(root / name))
        refs[name] = [greedy_logprobs(model, p, MAX_TOKENS) for p in prompts()]
        if i == 0:
            with model.disable_adapter():
                refs[None] = [greedy_logprobs(model, p, MAX_TOKENS) for p in prompts()]
    llm = make_llm(base)
    yield llm, folders, refs
    llm.exit()


def requests(folders: dict) -> dict:
    return {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(folders.items())}


def params() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)


def check(out, ref, what: str) -> None:
    greedy, logprobs = ref
    tokens = out.outputs[0].token_ids
    assert_greedy_match(tokens, greedy, what)
    same = next((i for i, (a, b) in enumerate(zip(tokens, greedy.tokens)) if a != b), len(tokens))
    got = [entry[t].logprob for entry, t in zip(out.outputs[0].logprobs, tokens)][:same]
    assert got == pytest.approx(logprobs[:same], abs=1e-4), what


def test_each_adapter_alone_matches_peft(setup):
    llm, folders, refs = setup
    for name, lora in requests(folders).items():
        outs = llm.generate(prompts(), params(), use_tqdm=False, lora_request=lora)
        for i, (out, ref) in enumerate(zip(outs, refs[name])):
            check(out, ref, f"adapter {name}, prompt {i}")
    outs = llm.generate(prompts(), params(), use_tqdm=False)
    for i, (out, ref) in enumerate(zip(outs, refs[None])):
        check(out, ref, f"base model, prompt {i}")


def test_a_batch_mixing_the_base_and_three_adapters(setup):
    """Every prompt under every adapter and the base model, in one call and shuffled: each row
    gets exactly what its adapter gives alone."""
    llm, folders, refs = setup
    loras = [None, *requests(folders).values()]
    rows = [(p, lora) for lora in loras for p in range(len(prompts()))]
    rows = rows[1::2] + rows[::2]
    outs = llm.generate(
        [prompts()[p] for p, _ in rows],
        params(),
        use_tqdm=False,
        lora_request=[lora for _, lora in rows],
    )
    for out, (p, lora) in zip(outs, rows):
        assert out.lora_request == lora
        name = None if lora is None else lora.lora_name
        check(out, refs[name][p], f"adapter {name}, prompt {p}, mixed batch")
    assert llm.list_loras() == {1, 2, 3}
