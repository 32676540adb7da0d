"""Mixtral: Llama attention (GQA) and a sparse MoE MLP in every layer (top-k of the softmax,
renormalized). Checkpoints name the MLP `block_sparse_moe` and the experts' projections w1/w3/w2."""

from __future__ import annotations

from torch import nn

from tokenmill.layers.attention.backend import AttentionBackend
from tokenmill.model.llama import LlamaAttention
from tokenmill.model.moe_decoder import MoECausalLM, MoEDecoderLayer, make_mlp


class MixtralForCausalLM(MoECausalLM):
    renames = ((".block_sparse_moe.", ".mlp."),)

    def _make_layer(self, index: int, attn_backend_cls: type[AttentionBackend]) -> nn.Module:
        return MoEDecoderLayer(self.dims, LlamaAttention(self.dims, attn_backend_cls, self.parallel),
                               make_mlp(self.dims, self.parallel, index))
