"""nano-vllm: a small, fast offline LLM inference engine. ``import nanovllm`` loads no torch."""

from nanovllm.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":
        from nanovllm.llm import LLM

        return LLM
    if name == "StructuredOutputsParams":
        from nanovllm.features.structured_outputs.params import StructuredOutputsParams

        return StructuredOutputsParams
    raise AttributeError(f"module 'nanovllm' has no attribute {name!r}")
