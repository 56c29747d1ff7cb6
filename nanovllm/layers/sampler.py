import torch
from torch import nn

from nanovllm.utils.compile import compile_on_gpu


@compile_on_gpu
def sample(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    logits = logits.float()
    greedy = temperatures == 0
    probs = torch.softmax(logits / torch.where(greedy, 1.0, temperatures).unsqueeze(1), dim=-1)
    noise = torch.empty_like(probs).exponential_(1).clamp_min_(1e-10)
    return torch.where(greedy, logits.argmax(dim=-1), (probs / noise).argmax(dim=-1))


class Sampler(nn.Module):
    """Gumbel-max sampling: argmax(softmax(logits / T) / E) with E ~ Exponential(1) draws a token
    with probability softmax(logits / T). Rows with temperature 0 take the argmax (greedy)."""

    def forward(self, logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
        return sample(logits, temperatures)
