"""DeepSeek-V2 / V3: multi-head latent attention and a sparse MoE MLP (grouped top-k, shared
experts, the first `first_k_dense_replace` layers dense).

Attention (`MLAttention`): q from the hidden state (q_proj, or q_a_proj -> norm -> q_b_proj); the
joint KV projection gives a latent c (kv_lora_rank, normalized) and one rope key k_pe shared by
all heads; only [c | k_pe] is cached (`layers/attention/mla.py`). kv_b_proj's key part is absorbed
into the query (q_lat = q_nope W_UK) and its value part applied to the latent output
(o = o_lat W_UV), so no per-head K or V is ever built, in prefill or decode.

DeepSeek rotates interleaved pairs (x0, x1), (x2, x3), ...; the rope rows of q_(b_)proj and
kv_a_proj_with_mqa are de-interleaved at load (evens, then odds) so the shared neox rotary applies:
q and k are permuted alike, and their dot products are unchanged. YaRN scaling (with mscale) is
the shared rotary's (`layers/rotary.py`) and the softmax scale's (`moe_arch.mla_arch`).

Tensor parallelism: each rank holds its heads' rows of q_(b_)proj and kv_b_proj and columns of
o_proj; q_a_proj and kv_a_proj_with_mqa (and so the latent cache) are replicated.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from tokenmill.config import ModelArch
from tokenmill.distributed.parallel_state import ParallelContext
from tokenmill.layers.attention.metadata import AttentionMetadata
from tokenmill.layers.attention.mla import mla_backend_class
from tokenmill.layers.linear import Linear
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.parallel_linear import RowParallelLinear
from tokenmill.layers.rotary import RotaryStep
from tokenmill.model.moe_decoder import MoECausalLM, MoEDecoderLayer, MoEModel
from tokenmill.model.weight_source import LazyTensor


class MLAttention(nn.Module):
    def __init__(self, dims: ModelArch, attn_backend_cls: type, parallel: ParallelContext, layer: int = 0) -> None:
        super().__init__()
        if dims.layer_spec(layer) != type(dims.layer_spec(layer))():
            raise ValueError(f"layer {layer}: sliding windows / soft-caps are not supported with latent attention")
        mla = dims.mla
        assert mla is not None
        self.mla = mla
        self.num_heads = parallel.layout.num_heads
        self.qk_head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        q_out = self.num_heads * self.qk_head_dim
        if mla.q_lora_rank:
            self.q_a_proj = Linear(dims.hidden_size, mla.q_lora_rank, bias=dims.qkv_bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, 1e-6)
            self.q_b_proj = Linear(mla.q_lora_rank, q_out, bias=False)
        else:
            self.q_proj = Linear(dims.hidden_size, q_out, bias=False)
        self.kv_a_proj_with_mqa = Linear(dims.hidden_size, mla.latent_dim, bias=dims.qkv_bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, 1e-6)
        self.kv_b_proj = Linear(mla.kv_lora_rank, self.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False)
        self.o_proj = RowParallelLinear(self.num_heads * mla.v_head_dim, dims.hidden_size, dims.o_bias, parallel)
        self.attn = mla_backend_class(attn_backend_cls)(self.num_heads, mla.kv_lora_rank, mla.qk_rope_head_dim,
                                                        mla.softmax_scale)

    def forward(self, hidden: torch.Tensor, rope: RotaryStep, kv_cache: torch.Tensor, meta: AttentionMetadata,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        mla, h = self.mla, self.num_heads
        t = hidden.shape[0]
        if mla.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        else:
            q = self.q_proj(hidden)
        q = q.view(t, h, self.qk_head_dim)
        q_nope, q_pe = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(hidden).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        q_pe, k_pe = rope.rotate_pair(q_pe.contiguous(), k_pe.contiguous().view(t, 1, mla.qk_rope_head_dim))
        w_kv = self.kv_b_proj.weight.view(h, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
        w_uk, w_uv = w_kv.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=1)
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, L]
        o_lat = self.attn.forward(q_lat, q_pe, latent, k_pe.view(t, mla.qk_rope_head_dim), kv_cache, meta)
        out = torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1).reshape(t, h * mla.v_head_dim)
        return self.o_proj(out) if residual is None else self.o_proj.forward_add(out, residual)


def _deinterleave(rows: torch.Tensor) -> torch.Tensor:
    """Rope rows (x0, x1, x2, x3, ...) -> (x0, x2, ..., x1, x3, ...), along dim 0."""
    return torch.cat([rows[0::2], rows[1::2]], dim=0)


class DeepseekDecoderLayer(MoEDecoderLayer):
    attention_cls = MLAttention


class DeepseekModel(MoEModel):
    layer_cls = DeepseekDecoderLayer


class DeepseekForCausalLM(MoECausalLM):
    model_cls = DeepseekModel

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | LazyTensor]]) -> None:
        super().load_weights(weights)
        if self.dims.mla.rope_interleave:
            self._deinterleave_rope_rows()

    @torch.no_grad()
    def _deinterleave_rope_rows(self) -> None:
        mla = self.dims.mla
        for layer in self.model.layers:
            if not isinstance(layer, MoEDecoderLayer):
                continue
            attn = layer.self_attn
            q = attn.q_b_proj if mla.q_lora_rank else attn.q_proj
            w = q.weight.view(attn.num_heads, attn.qk_head_dim, -1)
            for head in w:
                head[mla.qk_nope_head_dim:] = _deinterleave(head[mla.qk_nope_head_dim:])
            kv = attn.kv_a_proj_with_mqa
            kv.weight[mla.kv_lora_rank:] = _deinterleave(kv.weight[mla.kv_lora_rank:])
            if kv.bias is not None:
                kv.bias[mla.kv_lora_rank:] = _deinterleave(kv.bias[mla.kv_lora_rank:])

    @staticmethod
    def _map_name(hf_name: str) -> tuple[str, int | None]:
        """q_proj is MLA's own (never fused with k/v); the dense MLPs' gate/up fuse as Llama's."""
        if hf_name.endswith(".q_proj.weight"):
            return hf_name, None
        return MoECausalLM._map_name(hf_name)

    def _source_slice(self, name: str, shard: int | None) -> tuple[int, int, int] | None:
        """Heads split q_(b_)proj and kv_b_proj by rows (and o_proj by columns, as Llama's)."""
        layout, mla = self.layout, self.dims.mla
        if layout.tp_size > 1 and name.endswith(("q_proj.weight", "q_b_proj.weight", "kv_b_proj.weight")):
            per_head = (mla.qk_nope_head_dim + mla.v_head_dim if "kv_b_proj" in name
                        else mla.qk_nope_head_dim + mla.qk_rope_head_dim)
            return 0, layout.tp_rank * layout.num_heads * per_head, layout.num_heads * per_head
        if layout.tp_size > 1 and name.endswith("o_proj.weight"):
            size = layout.num_heads * mla.v_head_dim
            return 1, layout.tp_rank * size, size
        return super()._source_slice(name, shard)

    def _checkpoint_shape(self, name: str, shard: int | None, local: tuple[int, ...]) -> tuple[int, ...]:
        layout, d = self.layout, self.dims
        if layout.tp_size > 1 and name.endswith(("q_proj.weight", "q_b_proj.weight", "kv_b_proj.weight")):
            return (local[0] // layout.num_heads * d.num_heads, local[1])
        if layout.tp_size > 1 and name.endswith("o_proj.weight"):
            return (local[0], local[1] // layout.num_heads * d.num_heads)
        return super()._checkpoint_shape(name, shard, local)
