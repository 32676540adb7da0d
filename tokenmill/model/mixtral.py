"""Mixtral: Llama attention (GQA) and a sparse MoE MLP in every layer (top-k of the softmax,
renormalized). Checkpoints name the MLP `block_sparse_moe` and the experts' projections w1/w3/w2."""

from __future__ import annotations

from tokenmill.model.moe_decoder import MoECausalLM


class MixtralForCausalLM(MoECausalLM):
    renames = ((".block_sparse_moe.", ".mlp."),)
