"""The sparse MoE block: a softmax top-k router and SwiGLU experts (docs/moe.md)."""

import re

import torch
from torch import nn

from nanovllm.layers.linear import ReplicatedLinear
from nanovllm.layers.moe.fused import fused_moe, fused_moe_torch
from nanovllm.layers.moe.fused_fp8 import fused_moe_fp8, fused_moe_torch_fp8
from nanovllm.parallel.distributed import all_reduce, get_tp_rank, get_tp_size
from nanovllm.quantization.fp8 import BLOCK, FP8_DTYPE, quantize_weight_blocks

# one expert's checkpoint tensor: "...experts.<id>.<gate_proj|up_proj|down_proj>.weight"
EXPERT_TENSOR = re.compile(
    r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight(_scale_inv)?$"
)


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 softmax weights and int64 ids [num_tokens, top_k] of the largest logits, equal
    logits by ascending id (a stable sort, unlike ``torch.topk``)."""
    logits = router_logits.float()
    ids = logits.sort(dim=-1, descending=True, stable=True).indices[..., :top_k]
    weights = torch.softmax(logits, dim=-1).gather(-1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    from nanovllm.layers.moe.routing import MAX_ROUTED_EXPERTS, select_experts_triton

    if router_logits.shape[-1] <= MAX_ROUTED_EXPERTS:
        return select_experts_triton(router_logits, top_k, renormalize)
    return select_experts(router_logits, top_k, renormalize)


class Experts(nn.Module):
    """``gate_up_proj`` [num_experts, 2 * inter, hidden] and ``down_proj`` [num_experts, hidden,
    inter], inter this rank's slice; with ``fp8`` e4m3 plus ``*_scale_inv`` block scales."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, fp8: bool):
        super().__init__()
        tp_size = get_tp_size()
        # the group's, when built: an engine of one rank may live beside a group
        self.tp_rank = get_tp_rank()
        if intermediate_size % tp_size:
            raise ValueError(
                f"moe_intermediate_size ({intermediate_size}) must be divisible by "
                f"tensor_parallel_size ({tp_size})"
            )
        self.num_experts = num_experts
        self.hidden_size, self.full_inter = hidden_size, intermediate_size
        self.inter = intermediate_size // tp_size
        self.fp8 = fp8
        dtype = FP8_DTYPE if self.fp8 else None
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * self.inter, hidden_size, dtype=dtype),
            requires_grad=not self.fp8,
        )
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden_size, self.inter, dtype=dtype),
            requires_grad=not self.fp8,
        )
        self.gate_up_proj.weight_loader = self.load_gate_up
        self.down_proj.weight_loader = self.load_down
        if self.fp8:
            hidden_blocks, inter_blocks = -(-hidden_size // BLOCK), self.inter // BLOCK
            self.gate_up_proj_scale_inv = nn.Parameter(
                torch.ones(num_experts, 2 * inter_blocks, hidden_blocks), requires_grad=False
            )
            self.down_proj_scale_inv = nn.Parameter(
                torch.ones(num_experts, hidden_blocks, inter_blocks), requires_grad=False
            )
            self.gate_up_proj_scale_inv.weight_loader = self.load_gate_up
            self.down_proj_scale_inv.weight_loader = self.load_down
            self.gate_up_proj_scale_inv.derived = self.down_proj_scale_inv.derived = True
        # (parameter, expert, shard) whose weights / scales are loaded
        self.loaded: set[tuple[str, int, int]] = set()
        self.scaled: set[tuple[str, int, int]] = set()

    def _scale_of(self, param: nn.Parameter) -> nn.Parameter | None:
        if not self.fp8:
            return None
        return {
            id(self.gate_up_proj): self.gate_up_proj_scale_inv,
            id(self.down_proj): self.down_proj_scale_inv,
        }.get(id(param))

    def _load(
        self, param: nn.Parameter, loaded: torch.Tensor, place, keys: list[tuple[str, int, int]]
    ) -> None:
        # place(param, loaded, block) copies in block-row units of inter; FP8 from float: quantized
        if self.fp8:
            scale = self._scale_of(param)
            if scale is None:  # ``param`` is a scale tensor
                place(param, loaded, BLOCK)
                self.scaled.update(keys)
                return
            if loaded.dtype != FP8_DTYPE:
                loaded, scales = quantize_weight_blocks(loaded.to(param.device))
                place(scale, scales, BLOCK)
                self.scaled.update(keys)
        place(param, loaded, 1)
        self.loaded.update(keys)

    def _slice(self, loaded: torch.Tensor, dim: int, block: int = 1) -> torch.Tensor:
        size = self.inter // block
        return loaded.narrow(dim, self.tp_rank * size, size)

    def load_gate_up(
        self,
        param: nn.Parameter,
        loaded: torch.Tensor,
        expert: int | None = None,
        shard: int | None = None,
    ) -> None:
        """One expert's gate (shard 0) or up (shard 1), or with no expert the fused tensor."""
        if expert is None:

            def place(p, t, block):
                gate, up = t.chunk(2, dim=1)
                p.data.copy_(
                    torch.cat((self._slice(gate, 1, block), self._slice(up, 1, block)), dim=1)
                )

            keys = [("gate_up_proj", e, s) for e in range(self.num_experts) for s in (0, 1)]
        else:

            def place(p, t, block):
                size = self.inter // block
                p.data[expert, shard * size : (shard + 1) * size].copy_(self._slice(t, 0, block))

            keys = [("gate_up_proj", expert, shard)]
        self._load(param, loaded, place, keys)

    def load_down(
        self, param: nn.Parameter, loaded: torch.Tensor, expert: int | None = None
    ) -> None:
        if expert is None:

            def place(p, t, block):
                p.data.copy_(self._slice(t, 2, block))

            keys = [("down_proj", e, 0) for e in range(self.num_experts)]
        else:

            def place(p, t, block):
                p.data[expert].copy_(self._slice(t, 1, block))

            keys = [("down_proj", expert, 0)]
        self._load(param, loaded, place, keys)

    def checkpoint_shape(self, param: nn.Parameter, expert=None, shard=None) -> tuple[int, ...]:
        """The full checkpoint shape loading into ``param`` (no expert: transformers 5's fused)."""
        inter, hidden = self.full_inter, self.hidden_size
        if param is self.gate_up_proj or param is getattr(self, "gate_up_proj_scale_inv", None):
            shape = (inter if expert is not None else 2 * inter, hidden)
        else:
            shape = (hidden, inter)
        if self.fp8 and self._scale_of(param) is None:  # a scale tensor
            shape = tuple(-(-n // BLOCK) for n in shape)
        return shape if expert is not None else (self.num_experts, *shape)

    def missing(self) -> list[str]:
        """Checkpoint names (after ``experts.``) not loaded yet."""
        want = [("gate_up_proj", e, s) for e in range(self.num_experts) for s in (0, 1)]
        want += [("down_proj", e, 0) for e in range(self.num_experts)]
        names = {
            ("gate_up_proj", 0): "gate_proj",
            ("gate_up_proj", 1): "up_proj",
            ("down_proj", 0): "down_proj",
        }
        missing = [f"{e}.{names[p, s]}.weight" for p, e, s in want if (p, e, s) not in self.loaded]
        if self.fp8:
            missing += [
                f"{e}.{names[p, s]}.weight_scale_inv"
                for p, e, s in want
                if (p, e, s) not in self.scaled
            ]
        return missing


def map_expert_tensor(name: str) -> tuple[str, tuple] | None:
    """(fused parameter name, loader arguments) of a per-expert checkpoint name, else None."""
    match = EXPERT_TENSOR.match(name)
    if match is None:
        return None
    prefix, expert, proj, scale = match[1], int(match[2]), match[3], match[4] or ""
    if proj == "down_proj":
        return f"{prefix}.down_proj{scale}", (expert,)
    return f"{prefix}.gate_up_proj{scale}", (expert, 0 if proj == "gate_proj" else 1)


class SparseMoeBlock(nn.Module):
    """Router ``gate`` (replicated) and ``experts``: each token's ``top_k`` experts, weighted."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        renormalize: bool,
        fp8: bool = False,
        reduce_results: bool = True,
    ):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(
                f"num_experts_per_tok must be in [1, num_experts={num_experts}], got {top_k}"
            )
        self.top_k = top_k
        self.renormalize = renormalize
        self.tp_size = get_tp_size()
        self.gate = ReplicatedLinear(hidden_size, num_experts)  # never quantized
        self.experts = Experts(num_experts, hidden_size, intermediate_size, fp8)
        self.reduce_results = reduce_results  # False: left to the norm behind (RowParallelLinear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        router_logits = self.gate(x)
        experts = self.experts
        if x.is_cuda:  # Triton routing and grouping, without host synchronisation
            weights, ids = route(router_logits, self.top_k, self.renormalize)
        else:
            weights, ids = select_experts(router_logits, self.top_k, self.renormalize)
        if experts.fp8:
            moe_fp8 = fused_moe_fp8 if x.is_cuda else fused_moe_torch_fp8
            out = moe_fp8(
                x,
                experts.gate_up_proj,
                experts.gate_up_proj_scale_inv,
                experts.down_proj,
                experts.down_proj_scale_inv,
                weights,
                ids,
            )
        elif x.is_cuda:  # the grouped GEMMs
            out = fused_moe(x, experts.gate_up_proj, experts.down_proj, weights, ids)
        else:
            out = fused_moe_torch(x, experts.gate_up_proj, experts.down_proj, weights, ids)
        if self.tp_size > 1 and self.reduce_results:
            all_reduce(out)
        return out
