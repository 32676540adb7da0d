"""Each MoE / MLA family's HF config normalized into `MoEArch` / `MLAArch` (see tokenmill.config)."""

from __future__ import annotations

import math
from typing import Any

from tokenmill.config import MLAArch, MoEArch, RopeConfig


def moe_arch(hf_config: Any, model_type: str) -> MoEArch | None:
    """None for dense families; ValueError naming the field when the routing is not one we run."""
    if model_type == "mixtral":
        return MoEArch(num_experts=hf_config.num_local_experts, top_k=hf_config.num_experts_per_tok,
                       intermediate_size=hf_config.intermediate_size, renormalize=True)
    if model_type in ("qwen2_moe", "qwen3_moe"):
        n = hf_config.num_hidden_layers
        step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
        only_mlp = set(getattr(hf_config, "mlp_only_layers", None) or [])
        dense = tuple(i for i in range(n) if i in only_mlp or (i + 1) % step != 0)
        shared = int(getattr(hf_config, "shared_expert_intermediate_size", 0) or 0) if model_type == "qwen2_moe" else 0
        return MoEArch(num_experts=hf_config.num_experts, top_k=hf_config.num_experts_per_tok,
                       intermediate_size=hf_config.moe_intermediate_size,
                       renormalize=bool(getattr(hf_config, "norm_topk_prob", False)),
                       shared_intermediate_size=shared, shared_expert_gate=shared > 0, dense_layers=dense)
    if model_type == "olmoe":
        return MoEArch(num_experts=hf_config.num_experts, top_k=hf_config.num_experts_per_tok,
                       intermediate_size=hf_config.intermediate_size,
                       renormalize=bool(getattr(hf_config, "norm_topk_prob", False)))
    if model_type in ("deepseek_v2", "deepseek_v3"):
        return _deepseek_moe(hf_config, model_type)
    if model_type == "gpt_oss":
        # HF: top-k of the (biased) logits, then a softmax over those k = renormalized top-k of the softmax.
        return MoEArch(num_experts=hf_config.num_local_experts, top_k=hf_config.num_experts_per_tok,
                       intermediate_size=hf_config.intermediate_size, renormalize=True, router_bias=True,
                       expert_bias=True, activation="swiglu_clamped",
                       # transformers before 5.2x hard-codes them (its config has no such fields).
                       swiglu_alpha=float(getattr(hf_config, "swiglu_alpha", 1.702)),
                       swiglu_limit=float(getattr(hf_config, "swiglu_limit", 7.0)))
    return None


def _deepseek_moe(c: Any, model_type: str) -> MoEArch:
    v3 = model_type == "deepseek_v3"
    num_experts = getattr(c, "n_routed_experts", None) or getattr(c, "num_local_experts", None) \
        or getattr(c, "num_experts")
    groups = int(getattr(c, "n_group", None) or 1)
    topk_groups = int(getattr(c, "topk_group", None) or 1)
    if v3:
        scoring = getattr(c, "scoring_func", "sigmoid") or "sigmoid"
        grouped = groups > 1
    else:
        scoring = "softmax"
        method = getattr(c, "topk_method", "greedy") or "greedy"
        if method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"topk_method {method!r} is not supported (greedy, group_limited_greedy)")
        grouped = method == "group_limited_greedy"
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"scoring_func {scoring!r} is not supported (softmax, sigmoid)")
    if grouped and num_experts % groups:
        raise ValueError(f"n_group={groups} must divide the {num_experts} routed experts")
    first_dense = int(getattr(c, "first_k_dense_replace", 0) or 0)
    freq = int(getattr(c, "moe_layer_freq", 1) or 1)
    dense = tuple(i for i in range(c.num_hidden_layers) if i < first_dense or i % freq)
    return MoEArch(num_experts=num_experts, top_k=c.num_experts_per_tok, intermediate_size=c.moe_intermediate_size,
                   scoring=scoring,
                   # HF's DeepSeek-V2 never renormalizes (norm_topk_prob is ignored there); V3 does when asked.
                   renormalize=v3 and bool(getattr(c, "norm_topk_prob", False)),
                   num_groups=groups if grouped else 1, topk_groups=topk_groups if grouped else 1,
                   group_score="top2_sum" if v3 else "max",
                   routed_scaling_factor=float(getattr(c, "routed_scaling_factor", 1.0) or 1.0),
                   score_correction_bias=v3,
                   shared_intermediate_size=c.moe_intermediate_size * int(getattr(c, "n_shared_experts", 0) or 0),
                   dense_layers=dense)


def mla_arch(hf_config: Any, model_type: str, rope: RopeConfig) -> MLAArch | None:
    if model_type not in ("deepseek_v2", "deepseek_v3"):
        return None
    c = hf_config
    qk_head_dim = c.qk_nope_head_dim + c.qk_rope_head_dim
    scale = qk_head_dim ** -0.5
    if rope.rope_type != "default" and rope.mscale_all_dim:
        m = yarn_mscale(rope.factor, rope.mscale_all_dim)
        scale *= m * m
    return MLAArch(q_lora_rank=int(c.q_lora_rank or 0), kv_lora_rank=c.kv_lora_rank,
                   qk_nope_head_dim=c.qk_nope_head_dim, qk_rope_head_dim=c.qk_rope_head_dim,
                   v_head_dim=c.v_head_dim,
                   # V2 rotates interleaved pairs (complex form); V3 as its rope_interleave says.
                   rope_interleave=bool(getattr(c, "rope_interleave", True)) if model_type == "deepseek_v3" else True,
                   softmax_scale=scale)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
