"""Decode at small batch on a GPU: the layers hand at most ``MAX_ROWS`` rows to the few-rows
kernels (``rows_gemm.py``: the linears and the LM head; ``few_rows.py``: RMSNorm, SiLU-and-mul).
No Triton import here: the plain path asks ``takes`` before it loads a kernel module."""

import os

import torch

MAX_ROWS = 8  # from 16 rows cuBLAS is as fast or faster (BENCHMARKS.md, "Decode at batch 1")
# NANOVLLM_ROWS_GEMM=0 turns every few-rows kernel off (benchmarks compare the two)
ENABLED = os.environ.get("NANOVLLM_ROWS_GEMM", "1") != "0"


def takes(x: torch.Tensor) -> bool:
    """Whether ``x`` [rows, features] (features of unit stride) goes to the few-rows kernels."""
    return (
        ENABLED and x.is_cuda and x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.stride(1) == 1
    )
