"""Ray integrations (the optional extra: ``pip install -e ".[ray]"``). Importing this package
imports Ray; ``import nanovllm`` never does.

``ProcessorConfig`` and ``build_llm_processor``: batch inference over a Ray Data dataset, with the
column names of Ray Data's own LLM processors (``ray.data.llm``)."""

from nanovllm.ray.data import ProcessorConfig, build_llm_processor

__all__ = ["ProcessorConfig", "build_llm_processor"]
