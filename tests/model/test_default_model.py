"""The built-in default model (SmolLM2-135M-Instruct Q4_1 GGUF) against transformers' GGUF loading."""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers.paged_batch import PagedRunner
from tests.helpers.requirements import require_smollm2
from tokenmill.layers.attention.torch_ref import TorchRefAttentionBackend
from tokenmill.model.default_model import DEFAULT_MODEL, resolve_model_path
from tokenmill.model.hf_config import load_eos_token_ids, load_hf_config
from tokenmill.model.loader import load_model
from tokenmill.model.tokenizer import load_tokenizer
from tokenmill.model.arch import model_arch


@pytest.fixture(scope="module")
def gguf_path() -> str:
    require_smollm2()
    return resolve_model_path(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def hf_model(gguf_path: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path),
                                                dtype=torch.float32).eval()


def test_aliases_resolve_to_the_gguf(gguf_path: str) -> None:
    assert gguf_path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.isfile(gguf_path)
    assert resolve_model_path("smollm2") == resolve_model_path("SmolLM2-135M-Instruct") == gguf_path


def test_weights_and_logits_match_transformers(gguf_path: str, hf_model: torch.nn.Module) -> None:
    config = load_hf_config(gguf_path)
    assert config.architectures == ["LlamaForCausalLM"] and config.tie_word_embeddings
    model = load_model(gguf_path, model_arch(config), "auto", torch.float32, torch.device("cpu"), TorchRefAttentionBackend)
    ours, theirs = model.state_dict(), hf_model.state_dict()
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    for layer in (0, 17):
        prefix = f"model.layers.{layer}."
        qkv = ours[prefix + "self_attn.qkv_proj.weight"]
        # q and k were row-permuted by llama.cpp: equality means the permutation was undone.
        assert torch.equal(qkv[:q], theirs[prefix + "self_attn.q_proj.weight"])
        assert torch.equal(qkv[q:q + kv], theirs[prefix + "self_attn.k_proj.weight"])
        assert torch.equal(qkv[q + kv:], theirs[prefix + "self_attn.v_proj.weight"])
        gate_up = ours[prefix + "mlp.gate_up_proj.weight"]
        assert torch.equal(gate_up[:config.intermediate_size], theirs[prefix + "mlp.gate_proj.weight"])
        assert torch.equal(ours[prefix + "input_layernorm.weight"], theirs[prefix + "input_layernorm.weight"])
    assert torch.equal(ours["model.embed_tokens.weight"], theirs["model.embed_tokens.weight"])  # Q8_0

    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 314, 5099, 30]
    dims = model.dims
    runner = PagedRunner(model, dims.num_layers, dims.num_kv_heads, dims.head_dim, num_seqs=1, max_len=len(prompt))
    logits = runner.step([prompt], [len(prompt)])
    with torch.no_grad():
        expected = hf_model(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(logits, expected, atol=1e-3, rtol=1e-3)


def test_tokenizer_and_eos(gguf_path: str) -> None:
    first = load_tokenizer(gguf_path)  # converts, then reloads from the cache it wrote
    cached = load_tokenizer(gguf_path)
    for tok in (first, cached):
        assert tok.is_fast and type(tok.backend_tokenizer).__name__ == "Tokenizer"
    chat = [{"role": "user", "content": "Hello there, what is 2+2?"}]
    text = first.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    assert cached.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == text
    assert cached(text).input_ids == first(text).input_ids
    assert cached.decode(cached(text).input_ids) == text
    assert load_eos_token_ids(gguf_path, load_hf_config(gguf_path)) == (cached.convert_tokens_to_ids("<|im_end|>"),)
