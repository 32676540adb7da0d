"""MoE and MLA models split over two CPU processes: TP=2 (each rank a slice of every expert's
intermediate size, OLMoE's q/k norms over sharded heads, MLA heads split with the latent
replicated; gpt-oss: sinks split by head, expert biases added once) and PP=2 (dense and sparse
layers on different stages; gpt-oss: sliding and full layers), against HF's greedy tokens."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.helpers.tiny_moe_models import make_tiny_moe_model_dir
from tokenmill import LLM, SamplingParams

NEW_TOKENS = 6
ENGINE = dict(dtype="float32", kv_cache_memory_gb=0.01, max_num_batched_tokens=32, max_model_len=128)


@pytest.mark.parametrize("arch,split", [("qwen2_moe", "tp"), ("olmoe", "tp"), ("deepseek_v3", "tp"),
                                        ("deepseek_v2", "pp"), ("gpt_oss", "tp"), ("gpt_oss", "pp")])
def test_split_matches_hf(arch, split, tmp_path):
    path = make_tiny_moe_model_dir(arch, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = random.Random(arch)
    prompts = [[rng.randrange(3, 259) for _ in range(n)] for n in (5, 40)]
    sizes = dict(tensor_parallel_size=2) if split == "tp" else dict(pipeline_parallel_size=2)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    with LLM(path, **sizes, **ENGINE) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        tokens = out.outputs[0].token_ids
        with torch.inference_mode():
            ref = torch.log_softmax(hf(torch.tensor([prompt + tokens])).logits[0].float(), dim=-1)
        assert tokens == ref[len(prompt) - 1:-1].argmax(-1).tolist(), f"{arch} {split}: tokens differ from HF's"
        for j, (token, row) in enumerate(zip(tokens, out.outputs[0].logprobs)):
            assert abs(row[token].logprob - float(ref[len(prompt) - 1 + j, token])) < 1e-4
