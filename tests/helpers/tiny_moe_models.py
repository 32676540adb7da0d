"""Tiny random mixture-of-experts and MLA models of each real architecture, saved as HF folders.

Every config has several experts and top-2 or more, shared experts where the family has them,
dense layers where it has those (mlp_only_layers / decoder_sparse_step / first_k_dense_replace).
Router weights are drawn wide (std 0.5) so that experts' scores are well apart and no top-k
choice hangs on float rounding; everything else as `tiny_models.make_tiny_hf_model` does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import (DeepseekV2Config, DeepseekV3Config, GptOssConfig, MixtralConfig, OlmoeConfig,
                          PretrainedConfig, Qwen2MoeConfig, Qwen3MoeConfig)

from tests.helpers.tiny_models import BOS_ID, EOS_ID, PAD_ID, TINY_VOCAB_SIZE, make_tiny_hf_model, make_tiny_tokenizer

MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
GPT_OSS_ARCHS = ("gpt_oss",)  # attention sinks, sliding + full layers, biased experts (own GPU part)
MLA_ARCHS = ("deepseek_v2", "deepseek_v3")

_COMMON = dict(vocab_size=TINY_VOCAB_SIZE, hidden_size=64, num_attention_heads=4, max_position_embeddings=256,
               rms_norm_eps=1e-5, pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
               tie_word_embeddings=False)
_MLA = dict(kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24, num_key_value_heads=4,
            intermediate_size=96, moe_intermediate_size=32, n_shared_experts=2, first_k_dense_replace=1,
            routed_scaling_factor=1.5)


def make_moe_config(arch: str, **overrides: Any) -> PretrainedConfig:
    kwargs: dict[str, Any] = dict(_COMMON)
    if arch == "mixtral":
        cls = MixtralConfig
        kwargs.update(num_hidden_layers=2, num_key_value_heads=2, intermediate_size=48, num_local_experts=6,
                      num_experts_per_tok=2)
    elif arch == "qwen2_moe":
        cls = Qwen2MoeConfig
        # Layer 1 of 3 is dense (mlp_only_layers).
        kwargs.update(num_hidden_layers=3, num_key_value_heads=2, intermediate_size=96, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=3, norm_topk_prob=False,
                      mlp_only_layers=[1], decoder_sparse_step=1)
    elif arch == "qwen3_moe":
        cls = Qwen3MoeConfig
        # decoder_sparse_step 2: layers 1 and 3 are sparse, 0 and 2 dense.
        kwargs.update(num_hidden_layers=4, num_key_value_heads=2, head_dim=32, intermediate_size=96,
                      moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                      decoder_sparse_step=2)
    elif arch == "olmoe":
        cls = OlmoeConfig
        kwargs.update(num_hidden_layers=2, num_key_value_heads=4, intermediate_size=32, num_experts=8,
                      num_experts_per_tok=3)
    elif arch == "gpt_oss":
        # Layers slide, attend fully, slide (HF's default alternation) with a window of 8; YaRN rope;
        # a swiglu_limit the tiny experts' projections reach (see make_tiny_moe_model_dir).
        cls = GptOssConfig
        # Older transformers (the GPU machine's 5.17) hard-code the limit at 7.0 and would ignore ours.
        if hasattr(GptOssConfig(), "swiglu_limit"):
            kwargs["swiglu_limit"] = 1.5
        kwargs.update(num_hidden_layers=3, num_key_value_heads=2, head_dim=16, intermediate_size=32,
                      num_local_experts=6, num_experts_per_tok=3, sliding_window=8,
                      rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                       "original_max_position_embeddings": 64, "beta_fast": 32.0,
                                       "beta_slow": 1.0, "truncate": False})
    elif arch == "deepseek_v2":
        cls = DeepseekV2Config
        kwargs.update(_MLA, num_hidden_layers=3, q_lora_rank=None, n_routed_experts=8, num_experts_per_tok=3,
                      topk_method="group_limited_greedy", n_group=4, topk_group=2,
                      rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                       "original_max_position_embeddings": 64, "mscale": 1.0,
                                       "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1})
    elif arch == "deepseek_v3":
        cls = DeepseekV3Config
        kwargs.update(_MLA, num_hidden_layers=3, q_lora_rank=24, n_routed_experts=8, num_experts_per_tok=2,
                      n_group=4, topk_group=2, norm_topk_prob=True,
                      rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                       "original_max_position_embeddings": 64, "mscale": 1.0,
                                       "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1})
    else:
        raise ValueError(arch)
    kwargs.update(overrides)
    config = cls(**kwargs)
    config.architectures = [f"{type(config).__name__.removesuffix('Config')}ForCausalLM"]
    return config


def make_tiny_moe_model_dir(arch: str, tmp_path: str | Path, seed: int = 0, **overrides: Any) -> str:
    config = make_moe_config(arch, **overrides)
    model = make_tiny_hf_model(config, seed)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(seed + 1)
        for name, param in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "mlp.router.weight", "mlp.router.bias")):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
            elif name.endswith("self_attn.sinks"):  # gpt-oss: sinks that matter (HF draws them at 0.02)
                param.copy_(torch.randn(param.shape, generator=generator))
            elif name.endswith("experts.gate_up_proj"):  # gpt-oss: projections past swiglu_limit
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
            elif name.endswith(("experts.gate_up_proj_bias", "experts.down_proj_bias")):  # HF inits them at 0
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=generator) * 0.1)
    out = Path(tmp_path) / arch
    model.save_pretrained(out, safe_serialization=True)
    make_tiny_tokenizer().save_pretrained(out)
    return str(out)
