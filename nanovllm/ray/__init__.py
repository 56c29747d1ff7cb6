# Ray Data batch inference (docs/parallel.md); importing this package imports Ray

from nanovllm.ray.data import ProcessorConfig, build_llm_processor
from nanovllm.ray.processor_config import vLLMEngineProcessorConfig

__all__ = ["ProcessorConfig", "build_llm_processor", "vLLMEngineProcessorConfig"]
