from nanovllm.features.structured_outputs.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
