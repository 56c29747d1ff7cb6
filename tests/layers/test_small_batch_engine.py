"""A bf16 engine with the few-rows kernels (``layers/small_batch.py``) against the same engine
without them, under the Triton interpreter on the CPU (one subprocess: this file run as a script;
``small_batch.takes`` is widened to CPU tensors there). Decode steps of at most 8 sequences then
run the linears, the LM head, the norms and SiLU-and-mul through the few-rows kernels, also with a
LoRA adapter on every row. Greedy tokens must be equal, and each kernel must have been called; the
down projection (K of 512: two ranges) leaves its ranges to the norm behind, except under LoRA."""

import pytest
import torch
from triton_interpreter import (
    multiply_bf16_as_floats,
    results_under_interpreter,
    round_interpreter_casts_to_nearest,
    squeeze_interpreter_loop_bounds,
)


def engine_tokens(tmp: str, lora: bool) -> dict:
    from transformers import AutoConfig

    from nanovllm import LLM, SamplingParams
    from nanovllm.layers import few_rows, rows_gemm, small_batch
    from nanovllm.lora.random_adapter import random_adapter
    from nanovllm.lora.request import LoRARequest
    from nanovllm.utils.checkpoint import make_random_checkpoint

    path = make_random_checkpoint(
        tmp, "tiny", dtype=torch.bfloat16, vocab_size=512, std=0.3, intermediate_size=512
    )
    request, options = None, {}
    if lora:
        tensors, config = random_adapter(AutoConfig.from_pretrained(path), rank=8, std=0.5)
        request = LoRARequest("a", 1, lora_tensors=tensors, peft_config=config)
        options = dict(enable_lora=True, max_lora_rank=8)
    calls, saved = {}, {}
    counted_calls = (rows_gemm, "rows_linear"), (few_rows, "rms_norm"), (few_rows, "silu_and_mul")
    for module, name in counted_calls:
        saved[module, name] = kernel = getattr(module, name)

        def counted(*args, _kernel=kernel, _name=name, **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            result = _kernel(*args, **kwargs)
            if isinstance(result, rows_gemm.RangeSums):
                calls["ranges_left"] = calls.get("ranges_left", 0) + 1
            return result

        setattr(module, name, counted)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [[1 + i, 2 + i, 3 + i] * (i + 1) for i in range(3)]
    tokens, saved[small_batch, "takes"] = {}, small_batch.takes
    try:
        for on in (False, True):
            if on:
                small_batch.takes = lambda x: x.dim() == 2 and 0 < x.shape[0] <= 8
            with LLM(
                path, max_model_len=256, dtype="bfloat16", enforce_eager=True, **options
            ) as llm:
                out = llm.generate(prompts, params, use_tqdm=False, lora_request=request)
            tokens[on] = [o.outputs[0].token_ids for o in out]
    finally:
        for (module, name), value in saved.items():
            setattr(module, name, value)
    return {"with": tokens[True], "without": tokens[False], "calls": calls}


CASES = {"plain": False, "lora": True}


def run_interpreter_cases() -> dict:
    """Runs in the subprocess, with TRITON_INTERPRET=1 already in the environment."""
    import tempfile

    squeeze_interpreter_loop_bounds()
    round_interpreter_casts_to_nearest()
    multiply_bf16_as_floats()
    with tempfile.TemporaryDirectory() as tmp:
        return {name: engine_tokens(f"{tmp}/{name}", lora) for name, lora in CASES.items()}


@pytest.fixture(scope="module")
def results() -> dict:
    return results_under_interpreter(__file__)


@pytest.mark.parametrize("case", list(CASES))
def test_tokens_with_the_few_rows_kernels_equal_those_without(results, case):
    r = results[case]
    # 7 decode steps x 2 layers: 4 linears (with an adapter: the base's product), 2 norms,
    # SiLU-and-mul; and the final norm and the LM head (also after the prefill: 3 rows)
    want = {"rows_linear": 7 * (2 * 4 + 1) + 1, "rms_norm": 7 * (2 * 2 + 1), "silu_and_mul": 7 * 2}
    if case == "plain":  # each layer's down projection; under LoRA the adapters add to it
        want["ranges_left"] = 7 * 2
    assert r["calls"] == want, r["calls"]
    assert r["with"] == r["without"], r
    assert len({t for seq in r["without"] for t in seq}) > 6, r  # not one repeated token


if __name__ == "__main__":
    import json

    print(json.dumps(run_interpreter_cases()))
