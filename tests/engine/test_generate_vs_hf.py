"""LLM.generate, greedy, token for token against Hugging Face on tiny random models of every family."""

from __future__ import annotations

import random
import warnings

import pytest
from transformers import AutoModelForCausalLM

from tests.helpers.hf_reference import compare_greedy, hf_greedy
from tests.helpers.tiny_models import ARCHS, make_tiny_model_dir
from tokenmill import LLM, SamplingParams

# Default engine (multi-process, async scheduling) for every family; two with async scheduling off.
CASES = [(arch, tied, True) for arch in ARCHS for tied in (False, True)] + [("llama", False, False),
                                                                          ("qwen3", True, False)]


@pytest.mark.parametrize("arch,tied,async_scheduling", CASES,
                         ids=[f"{a}-{'tied' if t else 'untied'}{'' if s else '-sync'}" for a, t, s in CASES])
def test_greedy_matches_hf(arch, tied, async_scheduling, tmp_path):
    path = make_tiny_model_dir(arch, tmp_path, tie_word_embeddings=tied)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype="float32").eval()
    rng = random.Random(arch + str(tied))
    prompts = [[rng.randrange(3, 259) for _ in range(n)] for n in (1, 5, 17, 33, 64, 100)]
    llm = LLM(path, dtype="float32", kv_cache_memory_gb=0.01, max_num_batched_tokens=64,
              async_scheduling=async_scheduling)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ref = hf_greedy(hf, prompt, 24, eos_token_ids=[])
        note = compare_greedy(out.outputs[0].token_ids, ref, f"{arch} prompt of {len(prompt)}")
        if note:
            warnings.warn(note)
        assert out.outputs[0].finish_reason == "length"
    stats = llm.kv_cache_stats()
    assert stats["num_free_blocks"] == stats["num_blocks"] and stats["num_requests"] == 0
    llm.shutdown()
