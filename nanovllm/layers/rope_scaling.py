"""Llama 3's RoPE scaling: long wavelengths stretched by ``factor``, short ones kept."""

import math

import torch


def llama3_parameters(params: dict) -> dict:
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keys if k not in params]
    if missing:
        msg = f"needs {', '.join(keys)}; the config lacks {', '.join(missing)}"
        raise ValueError(f"rope scaling 'llama3' {msg}")
    return {k: float(params[k]) for k in keys}


def llama3_inv_freq(
    inv_freq, factor, low_freq_factor, high_freq_factor, original_max_position_embeddings
) -> torch.Tensor:
    """Short wavelengths kept, long ones divided by ``factor``, those between blended."""
    wavelen = 2 * math.pi / inv_freq
    ratio = original_max_position_embeddings / wavelen  # the context holds this many wavelengths
    smooth = ((ratio - low_freq_factor) / (high_freq_factor - low_freq_factor)).clamp(0.0, 1.0)
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq
