"""Qwen3-Next: Qwen3.5-MoE's hybrid stack with Gated DeltaNet projections interleaved per key-head
group (``in_proj_qkvz``, ``in_proj_ba``) and MoE layers chosen as Qwen3-MoE chooses them."""

import torch
from torch import nn

from nanovllm.layers.linear import ColumnParallelLinear
from nanovllm.layers.linear_attention.layer import GatedDeltaNet
from nanovllm.models.llama import GatedMLP
from nanovllm.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, SharedExpertMoeBlock
from nanovllm.models.qwen3_moe import is_sparse_layer


class GroupedGatedDeltaNet(GatedDeltaNet):
    """``in_proj_qkvz`` rows are, per key head, [q (Dk) | k (Dk) | v (r*Dv) | z (r*Dv)] and
    ``in_proj_ba`` rows [b (r) | a (r)], r = Hv / Hk. A rank's contiguous slice of rows is whole
    key-head groups, so a plain column split divides the heads as the conv and A_log expect."""

    def __init__(self, config):
        super().__init__(config)
        del self.in_proj_qkv, self.in_proj_z, self.in_proj_a, self.in_proj_b
        hidden, hk, hv = (
            config.hidden_size,
            config.linear_num_key_heads,
            config.linear_num_value_heads,
        )
        qkvz = 2 * hk * self.head_k_dim + 2 * hv * self.head_v_dim
        self.in_proj_qkvz = ColumnParallelLinear(hidden, qkvz)
        self.in_proj_ba = ColumnParallelLinear(hidden, 2 * hv)

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        t, hk, dk, dv = hidden.shape[0], self.num_k_heads, self.head_k_dim, self.head_v_dim
        r = self.num_v_heads // hk
        qkvz = self.in_proj_qkvz(hidden).view(t, hk, 2 * dk + 2 * r * dv)
        q, k, v, z = qkvz.split([dk, dk, r * dv, r * dv], dim=-1)
        b, a = self.in_proj_ba(hidden).view(t, hk, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat((q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)), dim=-1)
        return mixed, z.reshape(t, -1), a.reshape(t, -1), b.reshape(t, -1)


class Qwen3NextForCausalLM(Qwen3_5MoeForCausalLM):
    """Hugging Face's ``Qwen3NextForCausalLM`` names; a layer is sparse unless ``mlp_only_layers``
    or ``decoder_sparse_step`` says otherwise (then a dense ``intermediate_size`` MLP)."""

    linear_attention = GroupedGatedDeltaNet

    def make_mlp(self, config, layer_idx: int) -> nn.Module:
        if is_sparse_layer(config, layer_idx):
            return SharedExpertMoeBlock(config, config.norm_topk_prob)
        return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
