"""The next-token logits of the tiny tied checkpoint that the sampling tests draw from."""

import pytest
import torch
from hf_reference import random_prompts


@pytest.fixture(scope="module")
def model_logits(ckpt_tied, hf_ref) -> torch.Tensor:
    """Next-token logits [4, 512] of the tiny tied checkpoint after four random prompts
    (transformers)."""
    model = hf_ref.model(ckpt_tied.path)
    with torch.no_grad():
        rows = [model(torch.tensor([p])).logits[0, -1] for p in random_prompts(3, [5, 9, 17, 30])]
    return torch.stack(rows).float()
