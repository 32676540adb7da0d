"""Qwen2-MoE and Qwen3-MoE: Qwen attention (Qwen2: q/k/v biases; Qwen3: per-head q/k norms) and a
sparse MoE MLP, except in `mlp_only_layers` and the layers `decoder_sparse_step` skips (dense MLPs).
Qwen2-MoE adds a shared expert scaled by sigmoid(shared_expert_gate(x)); Qwen3-MoE has none and
renormalizes the top-k weights (norm_topk_prob). Everything is the shared MoE decoder's."""

from __future__ import annotations

from tokenmill.model.moe_decoder import MoECausalLM


class QwenMoeForCausalLM(MoECausalLM):
    pass
