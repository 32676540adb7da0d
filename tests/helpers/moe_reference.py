"""HF's view of a MoE/MLA model's output, and the check the MoE tests and scripts/gpu_moe.py share
(no pytest here: the GPU script imports it)."""

from __future__ import annotations

import random

import torch

from tokenmill import LLM, SamplingParams

NEW_TOKENS = 8
TOL = 1e-4
PROMPT_LENS = (1, 9, 33, 70)


def prompts_for(arch: str) -> list[list[int]]:
    rng = random.Random(arch)
    return [[rng.randrange(3, 259) for _ in range(n)] for n in PROMPT_LENS]


@torch.inference_mode()
def hf_logprobs(hf, tokens: list[int]) -> torch.Tensor:
    return torch.log_softmax(hf(torch.tensor([tokens])).logits[0].float(), dim=-1)


def check_against_hf(hf, prompts, outs, label: str) -> None:
    """Each output's greedy tokens are HF's argmax over the same sequence (teacher-forced: one HF
    pass per prompt), and every sampled and prompt logprob within TOL of HF's."""
    for prompt, out in zip(prompts, outs):
        tokens = out.outputs[0].token_ids
        ref = hf_logprobs(hf, prompt + tokens)
        assert tokens == ref[len(prompt) - 1:-1].argmax(-1).tolist(), f"{label}: greedy tokens differ from HF's"
        for j, (token, row) in enumerate(zip(tokens, out.outputs[0].logprobs or [])):
            got = row[token].logprob
            assert abs(got - float(ref[len(prompt) - 1 + j, token])) < TOL, f"{label}: logprob {j} off: {got}"
        if out.prompt_logprobs is None:
            continue
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for i in range(1, len(prompt)):
            got = out.prompt_logprobs[i][prompt[i]].logprob
            assert abs(got - float(ref[i - 1, prompt[i]])) < TOL, f"{label}: prompt logprob {i} off: {got}"


def generate(llm: LLM, prompts, prompt_logprobs: int | None = 0, max_tokens: int = NEW_TOKENS,
              logprobs: int | None = 0):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs,
                            prompt_logprobs=prompt_logprobs)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
