"""Gemma 2 (Gemma2ForCausalLM), over the Llama module's shared pieces.

What differs from Llama: every layer normalizes both before and after attention and the MLP
(four norms), norms scale by (1 + weight) in float32 (`GemmaRMSNorm`), the MLP is GeGLU
(`gelu_pytorch_tanh`), embeddings are scaled by sqrt(hidden_size) in the model dtype, the
attention scale is `query_pre_attn_scalar ** -0.5`, and layers alternate a sliding window with
full attention, all with attention logit soft-capping; the final logits are soft-capped too.
The per-layer window, soft-cap and scale travel in `ModelArch` (`layer_specs`, read by
`model/arch.py`) to the attention backends; the final cap is `LlamaForCausalLM.compute_logits`'s.
Weight names, sharding (TP) and stages (PP) are Llama's.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.config import ModelArch
from tokenmill.distributed.parallel_state import ParallelContext
from tokenmill.layers import triton_ops
from tokenmill.layers.attention.backend import AttentionBackend
from tokenmill.layers.attention.metadata import AttentionMetadata
from tokenmill.layers.norm import GemmaRMSNorm
from tokenmill.layers.rotary import RotaryStep
from tokenmill.model.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel


class GemmaDecoderLayer(nn.Module):
    """Pre- and post-norms around attention and around the MLP. The residual stream follows
    `LlamaDecoderLayer`'s convention: on CUDA (fused kernels) each residual add runs inside the
    next norm's kernel and the layer returns (post-norm MLP output, residual); elsewhere it
    returns the whole stream as `hidden`, with residual None."""

    def __init__(self, dims: ModelArch, attn_backend_cls: type[AttentionBackend], parallel: ParallelContext,
                 layer: int = 0) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(dims, attn_backend_cls, parallel, layer, norm_cls=GemmaRMSNorm)
        self.mlp = LlamaMLP(dims, parallel)
        eps = dims.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(dims.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(dims.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(dims.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(dims.hidden_size, eps)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, rope: RotaryStep,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, None]:
        if triton_ops.enabled(hidden):
            if residual is None:
                residual, hidden = hidden, self.input_layernorm(hidden)
            else:
                hidden, residual = self.input_layernorm.forward_with_residual(hidden, residual)
            attn = self.post_attention_layernorm(self.self_attn(hidden, rope, kv_cache, meta))
            hidden, residual = self.pre_feedforward_layernorm.forward_with_residual(attn, residual)
            return self.post_feedforward_layernorm(self.mlp(hidden)), residual
        if residual is not None:
            hidden = hidden + residual
        attn = self.self_attn(self.input_layernorm(hidden), rope, kv_cache, meta)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp), None


class GemmaModel(LlamaModel):
    layer_cls = GemmaDecoderLayer
    norm_cls = GemmaRMSNorm

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        # HF multiplies by sqrt(hidden_size) rounded to the weights' dtype (55.5 for 3072 in bf16).
        return hidden * torch.tensor(self.embed_tokens.weight.shape[1] ** 0.5, dtype=hidden.dtype)


class Gemma2ForCausalLM(LlamaForCausalLM):
    model_cls = GemmaModel
