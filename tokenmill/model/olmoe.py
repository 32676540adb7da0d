"""OLMoE: MHA whose q and k are RMS-normalized over the whole projection (all heads at once, as
HF does), not per head; a sparse MoE MLP in every layer (softmax top-k, not renormalized).

Under tensor parallelism a rank holds some heads of q and k: the mean square over the whole
projection is its partial sum of squares all-reduced over the TP group."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.config import ModelArch
from tokenmill.distributed.parallel_state import ParallelContext
from tokenmill.layers import triton_ops
from tokenmill.layers.attention.backend import AttentionBackend
from tokenmill.layers.attention.metadata import AttentionMetadata
from tokenmill.layers.rotary import RotaryStep
from tokenmill.model.llama import LlamaAttention
from tokenmill.model.moe_decoder import MoECausalLM, MoEDecoderLayer, MoEModel


class ShardedRMSNorm(nn.Module):
    """RMSNorm over a dimension split across the TP group; `weight` is this rank's slice."""

    def __init__(self, local_size: int, full_size: int, eps: float, parallel: ParallelContext) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(local_size))
        self.full_size, self.eps, self.parallel = full_size, eps, parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size == 1 and triton_ops.enabled(x):  # the whole row is here: one fused kernel
            from tokenmill.layers.triton_ops.rms_norm import rms_norm
            return rms_norm(x, self.weight, self.eps)
        square_sum = x.float().square().sum(dim=-1, keepdim=True)
        square_sum = self.parallel.all_reduce(square_sum)
        rstd = torch.rsqrt(square_sum / self.full_size + self.eps)
        return self.weight * (x.float() * rstd).to(x.dtype)


class OlmoeAttention(LlamaAttention):
    def __init__(self, dims: ModelArch, attn_backend_cls: type[AttentionBackend], parallel: ParallelContext,
                 layer: int = 0) -> None:
        super().__init__(dims, attn_backend_cls, parallel, layer)
        if dims.num_kv_heads < parallel.tp_size:
            raise ValueError(f"OLMoE's k norm spans every KV head: tensor_parallel_size {parallel.tp_size} must "
                             f"be at most num_key_value_heads ({dims.num_kv_heads})")
        eps = dims.rms_norm_eps
        self.q_norm = ShardedRMSNorm(self.q_size, dims.num_heads * dims.head_dim, eps, parallel)
        self.k_norm = ShardedRMSNorm(self.kv_size, dims.num_kv_heads * dims.head_dim, eps, parallel)

    def forward(self, hidden: torch.Tensor, rope: RotaryStep, kv_cache: torch.Tensor, meta: AttentionMetadata,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        t = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q).view(t, self.num_heads, self.head_dim)
        k = self.k_norm(k).view(t, self.num_kv_heads, self.head_dim)
        q, k = rope.rotate_pair(q, k)
        out = self.attn.forward(q, k, v.view(t, self.num_kv_heads, self.head_dim), kv_cache, meta)
        out = out.reshape(-1, self.q_size)
        return self.o_proj(out) if residual is None else self.o_proj.forward_add(out, residual)


class OlmoeDecoderLayer(MoEDecoderLayer):
    attention_cls = OlmoeAttention


class OlmoeModel(MoEModel):
    layer_cls = OlmoeDecoderLayer


class OlmoeForCausalLM(MoECausalLM):
    model_cls = OlmoeModel

    def _source_slice(self, name: str, shard: int | None) -> tuple[int, int, int] | None:
        """The q/k norm weights are split like the heads they scale."""
        layout, d = self.layout, self.dims
        if layout.tp_size > 1 and name.endswith(("q_norm.weight", "k_norm.weight")):
            heads, start = ((layout.num_heads, layout.tp_rank * layout.num_heads) if "q_norm" in name
                            else (layout.num_kv_heads, layout.kv_head_start))
            return 0, start * d.head_dim, heads * d.head_dim
        return super()._source_slice(name, shard)

    def _checkpoint_shape(self, name: str, shard: int | None, local: tuple[int, ...]) -> tuple[int, ...]:
        if self.layout.tp_size > 1 and name.endswith(("q_norm.weight", "k_norm.weight")):
            heads = self.dims.num_heads if "q_norm" in name else self.dims.num_kv_heads
            return (heads * self.dims.head_dim,)
        return super()._checkpoint_shape(name, shard, local)
