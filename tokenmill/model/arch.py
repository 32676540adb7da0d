"""A Hugging Face config normalized into a `ModelArch`: the only description of a model's shape
that the engine passes around (the front-end resolves it once; workers never read HF configs)."""

from __future__ import annotations

from typing import Any

from tokenmill.config import ModelArch, RopeConfig
from tokenmill.model.moe_arch import mla_arch, moe_arch
from tokenmill.model.registry import check_architecture

_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def model_arch(hf_config: Any) -> ModelArch:
    """Raises ValueError naming the field when the model is not one tokenmill can run."""
    architectures = getattr(hf_config, "architectures", None) or []
    architecture = check_architecture(architectures[0] if architectures else None)
    model_type = getattr(hf_config, "model_type", "llama")
    num_heads = hf_config.num_attention_heads
    attention_bias = bool(getattr(hf_config, "attention_bias", False))
    hidden_act = getattr(hf_config, "hidden_act", "silu")
    if hidden_act != "silu":
        raise ValueError(f"hidden_act {hidden_act!r} is not supported (only 'silu')")
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    if num_heads % num_kv_heads:
        raise ValueError(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}")
    rope = rope_config(hf_config)
    if model_type == "olmoe" and getattr(hf_config, "clip_qkv", None) is not None:
        raise ValueError(f"clip_qkv={hf_config.clip_qkv} is not supported (only null)")
    return ModelArch(
        architecture=architecture,
        model_type=model_type,
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads,
        rms_norm_eps=float(hf_config.rms_norm_eps),
        max_position=int(getattr(hf_config, "max_position_embeddings", None) or 2048),
        # Qwen2 always has q/k/v biases (and never an o_proj bias).
        qkv_bias=attention_bias or model_type == "qwen2" or (
            model_type == "qwen2_moe" and bool(getattr(hf_config, "qkv_bias", True))),
        o_bias=attention_bias and model_type not in ("qwen2", "qwen2_moe"),
        mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        rope=rope,
        moe=moe_arch(hf_config, model_type),
        mla=mla_arch(hf_config, model_type, rope),
        qk_norm_full=model_type == "olmoe",
    )


def rope_config(hf_config: Any) -> RopeConfig:
    """Reads `rope_parameters` (transformers 5) or legacy `rope_theta` / `rope_scaling`."""
    params: dict[str, Any] = dict(getattr(hf_config, "rope_parameters", None) or {})
    legacy_scaling = getattr(hf_config, "rope_scaling", None)
    if isinstance(legacy_scaling, dict):
        params = {**legacy_scaling, **params}
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        theta = 10000.0
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in _SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {', '.join(_SUPPORTED_ROPE_TYPES)}")
    partial = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None))
    original_max = params.get("original_max_position_embeddings")
    yarn = {}
    if rope_type == "yarn":
        if original_max is None:
            raise ValueError("rope_parameters: yarn needs original_max_position_embeddings")
        factor = params.get("factor") or (hf_config.max_position_embeddings / original_max)
        yarn = dict(beta_fast=float(params.get("beta_fast") or 32.0), beta_slow=float(params.get("beta_slow") or 1.0),
                    mscale=float(params.get("mscale") or 0.0), mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
                    attention_factor=(float(params["attention_factor"]) if params.get("attention_factor") is not None
                                      else None),
                    truncate=bool(params.get("truncate", True)))
        params = {**params, "factor": factor}
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(params.get("factor") or 1.0),
        low_freq_factor=float(params.get("low_freq_factor") or 1.0),
        high_freq_factor=float(params.get("high_freq_factor") or 4.0),
        original_max_position_embeddings=int(original_max) if original_max is not None else None,
        partial_rotary_factor=float(partial) if partial is not None else 1.0,
        **yarn,
    )
