"""The decode roofline of MoE and MLA models, by hand: a step reads only the experts its rows
activate (top-k at batch 1, nearly all at batch 256), and an MLA cache's bytes per token."""

from __future__ import annotations

import pytest
from transformers import DeepseekV2Config, Qwen3MoeConfig

from tokenmill.benchmarks.roofline import active_experts, kv_bytes_per_token, weight_bytes_read_per_step
from tokenmill.model.arch import model_arch


def _arch(config):
    config.architectures = [type(config).__name__.removesuffix("Config") + "ForCausalLM"]
    return model_arch(config)


def test_moe_step_reads_the_active_experts():
    # Qwen3-30B-A3B's shape.
    arch = _arch(Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                                num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                                num_experts=128, num_experts_per_tok=8))
    h, i = 2048, 768
    attn = h * (32 * 128 + 2 * 4 * 128) + 32 * 128 * h
    non_expert = 48 * (attn + h * 128 + 2 * h) + h + 151936 * h
    assert weight_bytes_read_per_step(arch, "bfloat16", 1) == 2 * (non_expert + 48 * 8 * 3 * h * i)
    assert active_experts(128, 8, 256) == pytest.approx(128, rel=1e-6)
    assert weight_bytes_read_per_step(arch, "bfloat16", 256) == pytest.approx(2 * (non_expert + 48 * 128 * 3 * h * i),
                                                                             rel=1e-6)


def test_mla_kv_bytes_are_the_latent():
    arch = _arch(DeepseekV2Config(vocab_size=102400, hidden_size=2048, num_hidden_layers=27, num_attention_heads=16,
                                  kv_lora_rank=512, qk_rope_head_dim=64, q_lora_rank=None, n_routed_experts=64,
                                  num_experts_per_tok=6, moe_intermediate_size=1408, first_k_dense_replace=1))
    assert kv_bytes_per_token(arch, "bfloat16") == 27 * (512 + 64) * 2
