"""Tiny random HF models saved to disk, for tests that compare tokenmill with transformers.

Every model shares one byte-level tokenizer (ids 0-2 are <pad>, <s>, </s>; each byte
is one token after them), so any text round-trips and every id decodes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, LlamaConfig, MistralConfig,
                          Phi3Config, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerFast, Qwen2Config,
                          Qwen3Config)

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
TINY_VOCAB_SIZE = len(SPECIAL_TOKENS) + 256
ARCHS = ("llama", "llama3", "mistral", "qwen2", "qwen3")
# Families with per-layer attention kinds: windows far shorter than the test prompts, soft-caps
# that bind, local rope bases unlike the global ones (tests/engine/test_families_vs_hf.py).
WINDOW = 12
FAMILY_ARCHS = ("mistral-swa", "qwen2-swa", "gemma2", "gemma3", "phi3")
_CONFIG_CLASSES = {"llama": LlamaConfig, "llama3": LlamaConfig, "mistral": MistralConfig,
                   "qwen2": Qwen2Config, "qwen3": Qwen3Config, "mistral-swa": MistralConfig,
                   "qwen2-swa": Qwen2Config, "gemma2": Gemma2Config, "gemma3": Gemma3TextConfig,
                   "phi3": Phi3Config}
_ARCHITECTURES = {"gemma3": "Gemma3ForCausalLM"}
_FAMILY_OVERRIDES: dict[str, dict[str, Any]] = {
    "mistral-swa": dict(sliding_window=WINDOW),
    # Qwen2: full attention below max_window_layers, windows from there on.
    "qwen2-swa": dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    "gemma2": dict(num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=24, initializer_range=0.3, sliding_window=WINDOW,
                   attn_logit_softcapping=1.5, final_logit_softcapping=4.0, hidden_activation="gelu_pytorch_tanh"),
    "gemma3": dict(num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                                    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
                   final_logit_softcapping=None, attn_logit_softcapping=None, hidden_activation="gelu_pytorch_tanh"),
    # LongRoPE from position 64 on (short and long factors differ); a window; half the head rotated.
    "phi3": dict(sliding_window=WINDOW + 4, original_max_position_embeddings=64, partial_rotary_factor=0.5,
                 initializer_range=0.3,
                 rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                  "short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [2.0, 4.0, 8.0, 16.0],
                                  "partial_rotary_factor": 0.5}),
}


def make_tiny_config(arch: str, tie_word_embeddings: bool = False, **overrides: Any) -> PretrainedConfig:
    """A 2-layer GQA config (4 query heads, 2 KV heads) of the given family.

    "llama3" adds Llama-3.1 rope scaling; "qwen3" uses a head_dim unequal to hidden/heads.
    """
    kwargs: dict[str, Any] = dict(
        vocab_size=TINY_VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
        tie_word_embeddings=tie_word_embeddings, pad_token_id=PAD_ID, bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
    )
    if arch == "llama3":
        kwargs["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 64}
    if arch == "qwen3":
        kwargs["head_dim"] = 32
    kwargs.update(_FAMILY_OVERRIDES.get(arch, {}))
    kwargs.update(overrides)
    config = _CONFIG_CLASSES[arch](**kwargs)
    config.architectures = [_ARCHITECTURES.get(arch) or f"{type(config).__name__.removesuffix('Config')}ForCausalLM"]
    return config


def make_tiny_hf_model(config: PretrainedConfig, seed: int = 0) -> PreTrainedModel:
    """The HF model for `config` in float32 eval mode, with weights drawn from `seed`.

    Norm weights are randomized too (HF inits them to 1), so a loader that mixes them up fails.
    """
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                # Gemma's norms scale by (1 + weight): centre them on 0 so both conventions see ~1.
                param.uniform_(-0.5, 0.5) if config.model_type.startswith("gemma") else param.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.1)
    return model.eval()


def make_tiny_tokenizer() -> PreTrainedTokenizerFast:
    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({ch: len(SPECIAL_TOKENS) + i for i, ch in enumerate(sorted(byte_chars))})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>")


def make_tiny_model_dir(arch: str, tmp_path: str | Path, tie_word_embeddings: bool = False, seed: int = 0,
                        max_shard_size: str | None = None, **config_overrides: Any) -> str:
    """Saves a tiny random HF model (safetensors, config, generation config, tokenizer) into
    `tmp_path`/<arch>[-tied] and returns that directory."""
    config = make_tiny_config(arch, tie_word_embeddings, **config_overrides)
    model = make_tiny_hf_model(config, seed)
    out = Path(tmp_path) / f"{arch}{'-tied' if tie_word_embeddings else ''}"
    save_kwargs: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(out, **save_kwargs)
    make_tiny_tokenizer().save_pretrained(out)
    return str(out)


def make_tiny_gemma3_multimodal_dir(tmp_path: str | Path, seed: int = 0) -> str:
    """A tiny Gemma3ForConditionalGeneration (the tiny Gemma 3 text model, a one-layer SigLIP
    vision tower, tied embeddings) saved into `tmp_path`/gemma3-mm; tokenmill runs its text part."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    text = make_tiny_config("gemma3").to_dict()
    text.pop("architectures", None)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=32, patch_size=8).to_dict()
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=258,
                          boi_token_index=256, eoi_token_index=257)
    config.architectures = ["Gemma3ForConditionalGeneration"]
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(-0.5, 0.5)
    out = Path(tmp_path) / "gemma3-mm"
    model.save_pretrained(out, safe_serialization=True)
    make_tiny_tokenizer().save_pretrained(out)
    return str(out)
