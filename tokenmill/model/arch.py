"""A Hugging Face config normalized into a `ModelArch`: the only description of a model's shape
that the engine passes around (the front-end resolves it once; workers never read HF configs)."""

from __future__ import annotations

from typing import Any

from tokenmill.config import AttentionSpec, ModelArch, RopeConfig
from tokenmill.model.moe_arch import mla_arch, moe_arch
from tokenmill.model.registry import check_architecture

_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")
_SUPPORTED_ACTS = ("silu", "gelu_pytorch_tanh")
_QK_NORM_TYPES = ("qwen3", "gemma3_text", "gemma3")


def model_arch(hf_config: Any) -> ModelArch:
    """Raises ValueError naming the field when the model is not one tokenmill can run."""
    architectures = getattr(hf_config, "architectures", None) or []
    architecture = check_architecture(architectures[0] if architectures else None)
    outer = hf_config
    hf_config = getattr(hf_config, "text_config", None) or hf_config  # multimodal: the language model's
    model_type = getattr(hf_config, "model_type", "llama")
    num_heads = hf_config.num_attention_heads
    attention_bias = bool(getattr(hf_config, "attention_bias", False))
    hidden_act = getattr(hf_config, "hidden_activation", None) or getattr(hf_config, "hidden_act", "silu")
    if hidden_act not in _SUPPORTED_ACTS:
        raise ValueError(f"hidden_act {hidden_act!r} is not supported; supported: {', '.join(_SUPPORTED_ACTS)}")
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    if num_heads % num_kv_heads:
        raise ValueError(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}")
    if getattr(hf_config, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention=True (an embedding model) is not supported")
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    num_layers = hf_config.num_hidden_layers
    query_pre_attn_scalar = getattr(hf_config, "query_pre_attn_scalar", None)
    final_softcap = getattr(hf_config, "final_logit_softcapping", None)
    rope = rope_config(hf_config)
    if model_type == "olmoe" and getattr(hf_config, "clip_qkv", None) is not None:
        raise ValueError(f"clip_qkv={hf_config.clip_qkv} is not supported (only null)")
    return ModelArch(
        architecture=architecture,
        model_type=model_type,
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(hf_config.rms_norm_eps),
        max_position=int(getattr(hf_config, "max_position_embeddings", None) or 2048),
        # Qwen2 always has q/k/v biases (and never an o_proj bias).
        qkv_bias=attention_bias or model_type == "qwen2" or (
            model_type == "qwen2_moe" and bool(getattr(hf_config, "qkv_bias", True))),
        o_bias=attention_bias and model_type not in ("qwen2", "qwen2_moe"),
        mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
        qk_norm=model_type in _QK_NORM_TYPES or model_type == "qwen3_moe",
        # A multimodal model ties its LM head by its own (outer) config.
        tie_word_embeddings=bool(getattr(outer, "tie_word_embeddings", None)
                                 if outer is not hf_config and hasattr(outer, "tie_word_embeddings")
                                 else getattr(hf_config, "tie_word_embeddings", False)),
        rope=rope,
        layer_specs=layer_specs(hf_config, num_layers),
        hidden_act=hidden_act,
        query_pre_attn_scalar=float(query_pre_attn_scalar) if query_pre_attn_scalar is not None else None,
        final_logit_softcap=float(final_softcap) if final_softcap else None,
        moe=moe_arch(hf_config, model_type),
        mla=mla_arch(hf_config, model_type, rope),
        qk_norm_full=model_type == "olmoe",
    )


def layer_types(hf_config: Any, num_layers: int) -> list[str]:
    """Each layer's "full_attention" or "sliding_attention", as transformers decides it:
    `layer_types` where the config has it, else Gemma 3's `sliding_window_pattern` (every
    pattern-th layer global), Gemma 2's alternation (even layers slide), Qwen2's
    `use_sliding_window` from `max_window_layers` on, or every layer when `sliding_window` is set
    (Mistral, Phi-3)."""
    types = getattr(hf_config, "layer_types", None)
    window = getattr(hf_config, "sliding_window", None)
    if getattr(hf_config, "use_sliding_window", True) is False:
        window = None
    if types is not None:
        if len(types) != num_layers:
            raise ValueError(f"layer_types has {len(types)} entries for num_hidden_layers={num_layers}")
        unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise ValueError(f"layer_types {unknown} are not supported (only full_attention, sliding_attention)")
        return list(types) if window else ["full_attention"] * num_layers
    if not window:
        return ["full_attention"] * num_layers
    pattern = getattr(hf_config, "sliding_window_pattern", None)
    model_type = getattr(hf_config, "model_type", "")
    if pattern:
        return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    if model_type == "gemma2":
        return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    if hasattr(hf_config, "max_window_layers"):
        start = hf_config.max_window_layers
        return ["sliding_attention" if i >= start else "full_attention" for i in range(num_layers)]
    return ["sliding_attention"] * num_layers


def layer_specs(hf_config: Any, num_layers: int) -> tuple[AttentionSpec, ...]:
    """One `AttentionSpec` per layer; () when every layer is plain full attention (the common case)."""
    types = layer_types(hf_config, num_layers)
    softcap = getattr(hf_config, "attn_logit_softcapping", None) or None
    window = getattr(hf_config, "sliding_window", None)
    # Qwen2-MoE sets sliding_window 0 when use_sliding_window is off: only a window in use must be >= 1.
    if window is not None and window < 1 and "sliding_attention" in types:
        raise ValueError(f"sliding_window={window} must be at least 1")
    ropes = _ropes_by_layer_type(hf_config)
    sinks = getattr(hf_config, "model_type", "") == "gpt_oss"  # a learned sink logit per head, every layer
    specs = tuple(AttentionSpec(sliding_window=int(window) if kind == "sliding_attention" else None,
                                rope=ropes.get(kind), logit_softcap=float(softcap) if softcap else None,
                                sinks=sinks)
                  for kind in types)
    return () if all(s == AttentionSpec() for s in specs) else specs


def _ropes_by_layer_type(hf_config: Any) -> dict[str, RopeConfig]:
    """Per-layer-type rotary settings where the config has them (Gemma 3: `rope_parameters` keyed
    by layer type, or the legacy `rope_local_base_freq` for the sliding layers)."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        return {kind: rope_config(hf_config, dict(p)) for kind, p in params.items()}
    local_base = getattr(hf_config, "rope_local_base_freq", None)
    if local_base is not None:
        return {"sliding_attention": RopeConfig(theta=float(local_base))}
    return {}


def rope_config(hf_config: Any, params: dict[str, Any] | None = None) -> RopeConfig:
    """Reads `rope_parameters` (transformers 5) or legacy `rope_theta` / `rope_scaling`; `params`:
    one layer type's entry of a per-layer-type `rope_parameters`."""
    if params is None:
        params = dict(getattr(hf_config, "rope_parameters", None) or {})
        if params and all(isinstance(v, dict) for v in params.values()):  # per layer type: the global one
            params = dict(params.get("full_attention") or {})
        legacy_scaling = getattr(hf_config, "rope_scaling", None)
        if isinstance(legacy_scaling, dict):
            params = {**legacy_scaling, **params}
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        theta = 10000.0
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "su":  # Phi-3's older name for LongRoPE
        rope_type = "longrope"
    if rope_type not in _SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {', '.join(_SUPPORTED_ROPE_TYPES)}")
    partial = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None))
    original_max = params.get("original_max_position_embeddings",
                              getattr(hf_config, "original_max_position_embeddings", None)
                              if rope_type == "longrope" else None)
    factor = params.get("factor")
    if rope_type == "longrope":
        if original_max is None:
            raise ValueError("rope_scaling of type longrope needs original_max_position_embeddings")
        if factor is None:  # HF: the ratio of the context lengths
            factor = hf_config.max_position_embeddings / original_max
    attention_factor = params.get("attention_factor")
    yarn = {}
    if rope_type == "yarn":
        original_max = params.get("original_max_position_embeddings")
        if original_max is None:
            raise ValueError("rope_parameters: yarn needs original_max_position_embeddings")
        if factor is None:  # HF (DeepSeek-V3): the ratio of the context lengths
            factor = hf_config.max_position_embeddings / original_max
        yarn = dict(beta_fast=float(params.get("beta_fast") or 32.0),
                    beta_slow=float(params.get("beta_slow") or 1.0),
                    mscale=float(params.get("mscale") or 0.0),
                    mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
                    truncate=bool(params.get("truncate", True)))
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(factor or 1.0),
        low_freq_factor=float(params.get("low_freq_factor") or 1.0),
        high_freq_factor=float(params.get("high_freq_factor") or 4.0),
        original_max_position_embeddings=int(original_max) if original_max is not None else None,
        partial_rotary_factor=float(partial) if partial is not None else 1.0,
        short_factor=tuple(float(x) for x in params.get("short_factor") or ()),
        long_factor=tuple(float(x) for x in params.get("long_factor") or ()),
        attention_factor=float(attention_factor) if attention_factor is not None else None,
        **yarn,
    )
