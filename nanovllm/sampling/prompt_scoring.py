import torch

from nanovllm.sampling.torch_ops import top_logprobs
from nanovllm.utils.context import Context, step_context

CHUNK = 512  # positions per LM-head pass: bounds the [positions, vocab] float32 logprobs it holds


@torch.inference_mode()
def score_prompt(model, hidden_states: torch.Tensor, scoring, vocab_size: int):
    """Each target's logprob [T], the ``scoring.num`` top [T, num] and ids; None off rank 0."""
    device = hidden_states.device
    indices = torch.tensor(scoring.indices, dtype=torch.int64, device=device)
    targets = torch.tensor(scoring.targets, dtype=torch.int64, device=device)
    num = min(vocab_size, scoring.num)
    parts = []
    with step_context(Context(is_prefill=False)):  # the head takes every row it is given
        for start in range(0, len(indices), CHUNK):
            logits = model.compute_logits(hidden_states[indices[start : start + CHUNK]])
            if logits is not None:
                parts.append(top_logprobs(logits, targets[start : start + CHUNK], num))
    if not parts:
        return None
    return tuple(torch.cat(column) for column in zip(*parts))
