"""nano-vllm: a small, fast offline LLM inference engine.

``LLM`` is imported lazily so that ``import nanovllm`` (and the engine core) stays free of torch.
"""

from nanovllm.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":
        from nanovllm.llm import LLM

        return LLM
    raise AttributeError(f"module 'nanovllm' has no attribute {name!r}")
