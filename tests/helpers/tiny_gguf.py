"""Writes a tiny llama as a GGUF file the way llama.cpp's converter would (q/k rows permuted)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
from transformers import PretrainedConfig, PreTrainedModel

from tests.helpers.tiny_models import make_tiny_config, make_tiny_hf_model

Q = gguf.GGMLQuantizationType
# HF name suffix -> llama.cpp block tensor name.
_BLOCK = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "input_layernorm": "attn_norm",
          "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down"}
_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
# Which stored type each tensor gets: every supported kind appears at least once.
DEFAULT_TYPES = {"blk.0.ffn_down.weight": Q.Q8_0, "blk.0.ffn_up.weight": Q.Q4_0, "blk.0.ffn_gate.weight": Q.Q4_1,
                 "blk.0.attn_v.weight": Q.F16, "blk.1.attn_output.weight": Q.BF16}
EOT_ID = 0  # an extra end-of-generation id, to check eot ids are collected


def gguf_name(hf_name: str) -> str:
    base, suffix = hf_name.rsplit(".", 1)
    if base in _TOP:
        return f"{_TOP[base]}.{suffix}"
    _, _, layer, rest = base.split(".", 3)
    return f"blk.{layer}.{_BLOCK[rest]}.{suffix}"


def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter permutation of q/k rows, for interleaved rope."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def quantized_roundtrip(w: np.ndarray, qtype: Q) -> np.ndarray:
    return gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype).reshape(w.shape)


def write_tiny_llama_gguf(path: str | Path, tie_word_embeddings: bool = False, seed: int = 0,
                          types: dict[str, Q] | None = None) -> tuple[PretrainedConfig, PreTrainedModel]:
    """Writes the GGUF; returns the HF config and the HF model whose weights it holds, with every
    quantized tensor replaced by its dequantized value (so logits can be compared exactly)."""
    types = DEFAULT_TYPES if types is None else types
    config = make_tiny_config("llama", tie_word_embeddings)
    model = make_tiny_hf_model(config, seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_eos_token_id(config.eos_token_id)
    writer.add_eot_token_id(EOT_ID)
    with torch.no_grad():
        for hf_name, param in model.state_dict().items():
            if tie_word_embeddings and hf_name == "lm_head.weight":
                continue
            name = gguf_name(hf_name)
            w = param.numpy().astype(np.float32)
            qtype = types.get(name, Q.F32)
            if qtype != Q.F32:
                w = quantized_roundtrip(w, qtype)
                param.copy_(torch.from_numpy(w))
            if ".attn_q." in name:
                w = permute_rows(w, config.num_attention_heads)
            elif ".attn_k." in name:
                w = permute_rows(w, config.num_key_value_heads)
            if qtype == Q.F32:
                writer.add_tensor(name, w)
            else:
                writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return config, model
