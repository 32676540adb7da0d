"""Our LlamaForCausalLM, loaded from HF safetensors, against transformers on tiny random models."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.helpers.paged_batch import PagedRunner
from tests.helpers.tiny_models import make_tiny_model_dir
from tokenmill.layers.attention.torch_ref import TorchRefAttentionBackend
from tokenmill.model.hf_config import load_hf_config
from tokenmill.model.loader import load_model
from tokenmill.model.arch import model_arch

PROMPT_LENS = (37, 21)  # several 16-token blocks; unequal so the batch is ragged
MAX_NEW_TOKENS = 6

CASES = [
    pytest.param("llama", False, None, id="llama-untied"),
    pytest.param("llama", True, "40KB", id="llama-tied-sharded"),
    pytest.param("llama3", False, None, id="llama3-rope-scaling"),
    pytest.param("mistral", False, None, id="mistral"),
    pytest.param("qwen2", True, None, id="qwen2-bias-tied"),
    pytest.param("qwen3", False, None, id="qwen3-qk-norm"),
]


@pytest.mark.parametrize("arch,tied,shard", CASES)
def test_matches_hf(tmp_path, arch: str, tied: bool, shard: str | None) -> None:
    path = make_tiny_model_dir(arch, tmp_path, tie_word_embeddings=tied, seed=1, max_shard_size=shard)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    config = load_hf_config(path)
    model = load_model(path, model_arch(config), "auto", torch.float32, torch.device("cpu"), TorchRefAttentionBackend)
    dims = model.dims
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, config.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    runner = PagedRunner(model, dims.num_layers, dims.num_kv_heads, dims.head_dim, num_seqs=len(prompts),
                         max_len=max(PROMPT_LENS) + MAX_NEW_TOKENS)

    # Prefill: every position's logits, both prompts in one flat batch.
    logits = runner.step(prompts, [len(p) for p in prompts])
    assert logits.dtype == torch.float32
    for i, rows in enumerate(logits.split(list(PROMPT_LENS))):
        with torch.no_grad():
            expected = hf_model(torch.tensor([prompts[i]])).logits[0]
        torch.testing.assert_close(rows, expected, atol=1e-4, rtol=1e-4)

    # Greedy decode with the KV cache, against HF generate (which may stop early at EOS).
    runner = PagedRunner(model, dims.num_layers, dims.num_kv_heads, dims.head_dim, num_seqs=len(prompts),
                         max_len=max(PROMPT_LENS) + MAX_NEW_TOKENS)
    ours = runner.generate_greedy(prompts, MAX_NEW_TOKENS)
    for prompt, got in zip(prompts, ours):
        with torch.no_grad():
            full = hf_model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                                     pad_token_id=0)
        expected = full[0, len(prompt):].tolist()
        assert got[:len(expected)] == expected
