"""Sampling: the ``Sampler`` module and the per-step settings it reads (``sampler``), the sampling
math in torch (``torch_ops``: the CPU path and the filtered rows on the GPU), and the fused Triton
draw (``triton_draw``, imported only on the GPU); ``batch`` turns a step's sampling rows into a
``SamplingBatch``. Importing this package does not import triton."""

from nanovllm.sampling.sampler import Filters, Penalties, Sampler, SamplerOutput, SamplingBatch

__all__ = ["Filters", "Penalties", "Sampler", "SamplerOutput", "SamplingBatch"]
