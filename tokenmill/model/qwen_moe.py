"""Qwen2-MoE and Qwen3-MoE: Qwen attention (Qwen2: q/k/v biases; Qwen3: per-head q/k norms) and a
sparse MoE MLP, except in `mlp_only_layers` and the layers `decoder_sparse_step` skips (dense MLPs).
Qwen2-MoE adds a shared expert scaled by sigmoid(shared_expert_gate(x)); Qwen3-MoE has none and
renormalizes the top-k weights (norm_topk_prob)."""

from __future__ import annotations

from torch import nn

from tokenmill.layers.attention.backend import AttentionBackend
from tokenmill.model.llama import LlamaAttention
from tokenmill.model.moe_decoder import MoECausalLM, MoEDecoderLayer, make_mlp


class QwenMoeForCausalLM(MoECausalLM):
    def _make_layer(self, index: int, attn_backend_cls: type[AttentionBackend]) -> nn.Module:
        return MoEDecoderLayer(self.dims, LlamaAttention(self.dims, attn_backend_cls, self.parallel),
                               make_mlp(self.dims, self.parallel, index))
