"""``EngineArgs`` and its flags (vLLM's spelling, ``FlexibleArgumentParser``'s underscores),
``LLM(**vars(args))`` and ``LLM.from_engine_args``, and vLLM's option names: aliases, options
that change nothing, options refused at any other value, unknown keys."""

import argparse
import dataclasses

import pytest
from api_helpers import make_llm

import nanovllm
from nanovllm import LLM, EngineArgs, SamplingParams
from nanovllm.config import Config
from nanovllm.entrypoints.options import config_kwargs

GREEDY = SamplingParams(temperature=0, max_tokens=6)
PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42]]


def parser():
    from nanovllm.utils.argparse_utils import FlexibleArgumentParser

    p = FlexibleArgumentParser()
    assert EngineArgs.add_cli_args(p) is p
    p.add_argument("--max-tokens", type=int)  # a script's own flag
    return p


def test_vllm_module_paths_and_exports():
    from nanovllm.engine.arg_utils import AsyncEngineArgs
    from nanovllm.entrypoints.llm_engine import LLMEngine
    from nanovllm.utils.argparse_utils import FlexibleArgumentParser

    assert nanovllm.AsyncEngineArgs is AsyncEngineArgs and issubclass(AsyncEngineArgs, EngineArgs)
    assert nanovllm.LLMEngine is LLMEngine
    assert issubclass(FlexibleArgumentParser, argparse.ArgumentParser)
    names = [f.name for f in dataclasses.fields(EngineArgs)]
    assert names[: len(Config.field_names())] == Config.field_names()
    assert {"block_size", "enable_chunked_prefill", "trust_remote_code"} <= set(names)


def test_defaults_round_trip():
    args = parser().parse_args(["--model", "m"])
    assert EngineArgs.from_cli_args(args) == EngineArgs("m")
    kwargs = EngineArgs("m").llm_kwargs()  # options at their defaults are left out
    assert kwargs == {name: getattr(EngineArgs("m"), name) for name in Config.field_names()}


def test_flags_in_vllm_spelling_and_underscores():
    argv = "--max_model_len 128 --no-enable-prefix-caching --seed None --block-size 16"
    argv += " --enforce-eager --tokenizer /tok --max-logprobs=-1 --no-async_scheduling"
    argv += ' --hf-overrides {"a":1} --profiler-config {"profiler":"torch"} --dtype float32'
    args = EngineArgs.from_cli_args(parser().parse_args(argv.split()))
    assert (args.max_model_len, args.enable_prefix_caching, args.seed) == (128, False, None)
    assert (args.block_size, args.enforce_eager, args.tokenizer) == (16, True, "/tok")
    assert (args.max_logprobs, args.async_scheduling) == (-1, False)
    assert args.hf_overrides == {"a": 1} and args.profiler_config == {"profiler": "torch"}
    args = parser().parse_args(["--enable-chunked-prefill"])
    assert args.enable_chunked_prefill is True
    assert parser().parse_args([]).enable_chunked_prefill is None
    with pytest.raises(SystemExit):
        parser().parse_args(["--dtype", "half8"])  # choices are the Config's


def test_llm_from_parsed_flags_and_from_engine_args(ckpt_tied):
    p = parser()
    p.set_defaults(model=ckpt_tied.path)
    argv = "--device cpu --kvcache-block-size 16 --num-kvcache-blocks 64 --max-model-len 128"
    args = vars(p.parse_args(argv.split() + ["--max-tokens", "6", "--trust-remote-code"]))
    args.pop("max_tokens")
    with LLM(**args) as llm:
        first = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    engine_args = EngineArgs(ckpt_tied.path, device="cpu", block_size=16, num_kvcache_blocks=64)
    with LLM.from_engine_args(engine_args) as llm:
        assert llm.config.kvcache_block_size == 16
        again = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    with make_llm(ckpt_tied.path, device="cpu") as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == first == again
    with pytest.raises(TypeError, match="from_engine_args takes an EngineArgs, got dict"):
        LLM.from_engine_args({"model": ckpt_tied.path})


def test_vllm_options_mapped_dropped_or_refused():
    assert config_kwargs({"block_size": 32, "disable_log_stats": True, "seed": 3}) == {
        "kvcache_block_size": 32,
        "seed": 3,
    }
    assert config_kwargs({"num_gpu_blocks_override": None, "enable_chunked_prefill": True}) == {}
    assert config_kwargs({"tokenizer_mode": "auto", "swap_space": 16, "revision": "main"}) == {}
    with pytest.raises(
        ValueError, match=r"enable_chunked_prefill=False is not supported.*None or True"
    ):
        config_kwargs({"enable_chunked_prefill": False})
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=2 is not supported.*accepts 1"):
        config_kwargs({"pipeline_parallel_size": 2})
    with pytest.raises(ValueError, match=r"enable_lora must be a bool, got 1"):
        config_kwargs({"enable_lora": 1})
    assert config_kwargs({"max_loras": 3}) == {}  # LoRA off: its limits change nothing
    lora = config_kwargs({"enable_lora": True, "max_loras": 3, "max_lora_rank": 8})["lora_config"]
    assert (lora.max_loras, lora.max_lora_rank, lora.max_cpu_loras) == (3, 8, 3)
    with pytest.raises(ValueError, match=r"max_cpu_loras must be >= max_loras \(3\), got 2"):
        config_kwargs({"enable_lora": True, "max_loras": 3, "max_cpu_loras": 2})
    with pytest.raises(ValueError, match=r"max_lora_rank must be an int >= 1, got 0"):
        config_kwargs({"enable_lora": True, "max_lora_rank": 0})
    with pytest.raises(ValueError, match=r"block_size=16 and kvcache_block_size=32 disagree"):
        config_kwargs({"block_size": 16, "kvcache_block_size": 32})
    assert config_kwargs({"block_size": 16, "kvcache_block_size": 256}) == {
        "kvcache_block_size": 16
    }


def test_unknown_and_refused_options_through_llm(ckpt_tied):
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'no_such'; accepted: .*seed"):
        LLM(ckpt_tied.path, no_such=1)
    with pytest.raises(ValueError, match=r"LLM\(\) option tokenizer_mode='mistral' is not"):
        LLM(ckpt_tied.path, tokenizer_mode="mistral")
    with LLM(
        ckpt_tied.path,
        device="cpu",
        block_size=16,
        num_gpu_blocks_override=40,
        disable_log_stats=True,
        trust_remote_code=True,
        enable_chunked_prefill=True,
    ) as llm:
        assert (llm.config.kvcache_block_size, llm.num_kvcache_blocks) == (16, 40)
