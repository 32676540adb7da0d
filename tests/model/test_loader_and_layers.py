"""Dummy weights, HF-directory config/eos/tokenizer loading, and rope against transformers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from tests.helpers.paged_batch import PagedRunner
from tests.helpers.tiny_models import make_tiny_config, make_tiny_model_dir
from tokenmill.layers.attention.torch_ref import TorchRefAttentionBackend
from tokenmill.config import RopeConfig
from tokenmill.layers.rotary import RotaryEmbedding, apply_rotary
from tokenmill.model.arch import rope_config
from tokenmill.model.hf_config import load_eos_token_ids, load_hf_config
from tokenmill.model.arch import model_arch
from tokenmill.model.loader import load_model
from tokenmill.model.tokenizer import load_tokenizer


def test_dummy_weights(tmp_path) -> None:
    path = make_tiny_model_dir("qwen2", tmp_path)
    config = load_hf_config(path)
    args = (path, model_arch(config), "dummy", torch.bfloat16, torch.device("cpu"), TorchRefAttentionBackend)
    a, b, c = load_model(*args, seed=0), load_model(*args, seed=0), load_model(*args, seed=1)
    assert not a.training and a.model.embed_tokens.weight.dtype == torch.bfloat16
    assert a.model.rotary_emb.cos_cache.dtype == torch.float32
    assert torch.equal(a.model.embed_tokens.weight, b.model.embed_tokens.weight)
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)
    assert torch.equal(a.model.norm.weight, torch.ones_like(a.model.norm.weight))
    dims = a.dims
    runner = PagedRunner(a, dims.num_layers, dims.num_kv_heads, dims.head_dim, num_seqs=1, max_len=8)
    logits = runner.step([[5, 6, 7, 8, 9, 10, 11, 12]], [8])
    assert logits.dtype == torch.float32 and logits.isfinite().all() and logits.abs().max() < 10


def test_hf_dir_config_eos_and_tokenizer(tmp_path) -> None:
    path = make_tiny_model_dir("llama", tmp_path)
    config = load_hf_config(path)
    assert config.architectures == ["LlamaForCausalLM"]
    assert load_eos_token_ids(path, config) == (2,)
    tok = load_tokenizer(path)
    assert tok.is_fast and tok.eos_token_id == 2
    assert tok.decode(tok("héllo").input_ids) == "héllo"


ROPE_CONFIGS = {
    "default": dict(),
    "linear": dict(rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}),
    "llama3": dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
                                    "rope_theta": 500000.0}),
}


@pytest.mark.parametrize("kind", list(ROPE_CONFIGS))
def test_rope_matches_hf(kind: str) -> None:
    config = make_tiny_config("llama", **ROPE_CONFIGS[kind])
    head_dim = config.hidden_size // config.num_attention_heads
    ours = RotaryEmbedding(head_dim, config.max_position_embeddings, rope_config(config))
    positions = torch.tensor([0, 1, 7, 63, 64, 200, 255])
    cos, sin = ours.cos_sin(positions, torch.float32)
    hf_cos, hf_sin = LlamaRotaryEmbedding(config)(torch.zeros(1), positions[None])
    torch.testing.assert_close(cos[:, 0], hf_cos[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(sin[:, 0], hf_sin[0], atol=1e-6, rtol=0)


def test_legacy_rope_fields_and_partial_rotary() -> None:
    legacy = SimpleNamespace(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0})
    assert rope_config(legacy) == RopeConfig(theta=5e5, rope_type="linear", factor=2.0)
    with pytest.raises(ValueError, match="yarn"):
        rope_config(SimpleNamespace(rope_parameters={"rope_type": "yarn", "rope_theta": 1.0}))
    rope = RotaryEmbedding(16, 32, RopeConfig(theta=10000.0, partial_rotary_factor=0.5))
    cos, sin = rope.cos_sin(torch.tensor([3, 5]), torch.float32)
    x = torch.randn(2, 4, 16)
    out = apply_rotary(x, cos, sin)
    assert cos.shape[-1] == 8 and torch.equal(out[..., 8:], x[..., 8:])
    assert not torch.allclose(out[..., :8], x[..., :8])
