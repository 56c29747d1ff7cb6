import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanovllm.layers import small_batch
from nanovllm.parallel.distributed import all_reduce, get_tp_rank, get_tp_size
from nanovllm.utils.context import get_context


class VocabParallelEmbedding(nn.Module):
    """A vocabulary slice per rank; other ids embed to zero, an all-reduce sums the slices."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_size()
        assert num_embeddings % self.tp_size == 0, "vocab size must divide by tensor_parallel_size"
        self.num_embeddings = num_embeddings
        self.num_embeddings_per_rank = num_embeddings // self.tp_size
        self.vocab_start = self.tp_rank * self.num_embeddings_per_rank
        self.vocab_end = self.vocab_start + self.num_embeddings_per_rank
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_rank, embedding_dim))
        self.weight.weight_loader = self.weight_loader

    def checkpoint_shape(self, param: nn.Parameter) -> tuple[int, int]:
        return self.num_embeddings, param.shape[1]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        param.data.copy_(loaded.narrow(0, self.vocab_start, self.num_embeddings_per_rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(x, self.weight)
        mask = (x >= self.vocab_start) & (x < self.vocab_end)
        y = F.embedding((x - self.vocab_start) * mask, self.weight) * mask.unsqueeze(-1)
        all_reduce(y)
        return y


class ParallelLMHead(VocabParallelEmbedding):
    """Logits of each sequence's last position, gathered on rank 0 (None elsewhere) unless
    ``gather=False``."""

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None, gather: bool = True):
        # out: where this rank's logits go (not gathered)
        context = get_context()
        if context.is_prefill:
            x = x[context.cu_seqlens_q[1:] - 1].contiguous()
        if small_batch.takes(x):
            from nanovllm.layers.rows_gemm import linear

            logits = linear(x, self.weight, None, out)
        else:
            logits = (
                F.linear(x, self.weight) if out is None else torch.mm(x, self.weight.t(), out=out)
            )
        return self.gather(logits) if gather else logits

    def gather(self, logits: torch.Tensor) -> torch.Tensor | None:
        if self.tp_size == 1:
            return logits
        parts = None
        if self.tp_rank == 0:
            parts = [torch.empty_like(logits) for _ in range(self.tp_size)]
        dist.gather(logits, parts, dst=0)
        return torch.cat(parts, dim=-1) if self.tp_rank == 0 else None
