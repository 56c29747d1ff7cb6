"""nano-vllm: a small, fast offline LLM inference engine. ``import nanovllm`` loads no torch."""

from importlib import import_module

from nanovllm.sampling_params import RequestOutputKind, SamplingParams

__version__ = "0.1.0"
LAZY = {  # name: the module that defines it, imported on first use
    "LLM": "nanovllm.llm",
    "AsyncLLM": "nanovllm.entrypoints.async_llm",
    "StructuredOutputsParams": "nanovllm.features.structured_outputs.params",
    "RequestOutput": "nanovllm.outputs",
    "CompletionOutput": "nanovllm.outputs",
    "Logprob": "nanovllm.logprobs",
    "TextPrompt": "nanovllm.entrypoints.prompts",
    "TokensPrompt": "nanovllm.entrypoints.prompts",
    "EngineArgs": "nanovllm.engine.arg_utils",
    "AsyncEngineArgs": "nanovllm.engine.arg_utils",
    "LLMEngine": "nanovllm.entrypoints.llm_engine",
}
__all__ = ["RequestOutputKind", "SamplingParams", *LAZY]


def __getattr__(name: str):
    if name in LAZY:
        return getattr(import_module(LAZY[name]), name)
    raise AttributeError(f"module 'nanovllm' has no attribute {name!r}")
