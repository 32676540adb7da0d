"""The families with per-layer attention kinds (Mistral and Qwen2 with sliding windows, Gemma 2,
Gemma 3, Phi-3 with LongRoPE), greedy and prompt logprobs against Hugging Face on tiny random
configs of each real architecture (float32, CPU). Prompts run far past the windows (12-16 tokens),
Gemma 2's attention and final soft-caps bind, Gemma 3's local rope base (10) differs from its
global one, and Phi-3's generations cross its LongRoPE switch (position 64).

Each family also runs under chunked prefill with an 8-token budget, a second pass over the same
prompts (prefix-cache hits), and a KV pool small enough to force preemptions. The last test
widens the window by one block and sees the comparison fail.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.engine.conftest import tiny_llm
from tests.helpers.hf_reference import assert_greedy_matches_hf, hf_greedy
from tests.helpers.tiny_models import FAMILY_ARCHS, WINDOW, make_tiny_model_dir
from tokenmill import SamplingParams
from tokenmill.layers.attention import torch_ref

NEW_TOKENS = 16
LOGPROB_TOL = 1e-4
# Phi-3's prompts stay within its original context (64), rotated with the short factors; the
# generations cross into the long ones (prompts past it: test_longrope_vs_hf.py).
PROMPT_LENS = (3, 29, 45, 60)


@pytest.fixture(scope="module", params=FAMILY_ARCHS)
def family(request, tmp_path_factory):
    arch = request.param
    path = make_tiny_model_dir(arch, tmp_path_factory.mktemp(arch))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    rng = random.Random(arch)
    prompts = [[rng.randrange(3, 259) for _ in range(n)] for n in PROMPT_LENS]
    refs = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    return arch, path, hf, prompts, refs


def greedy(llm, prompts, **params):
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, **params)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)


@torch.inference_mode()
def hf_prompt_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """[len - 1]: log p(ids[i] | ids[:i]) for i >= 1, from one HF forward pass."""
    logits = hf(input_ids=torch.tensor([ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]


def test_greedy_and_prompt_logprobs(family):
    arch, path, hf, prompts, refs = family
    llm = tiny_llm(path)
    outs = greedy(llm, prompts, prompt_logprobs=1)
    assert_greedy_matches_hf([o.outputs[0].token_ids for o in outs], refs, arch)
    for prompt, out in zip(prompts, outs):
        ref = hf_prompt_logprobs(hf, prompt)
        ours = torch.tensor([out.prompt_logprobs[i][tok].logprob for i, tok in enumerate(prompt) if i])
        torch.testing.assert_close(ours, ref, atol=LOGPROB_TOL, rtol=0)


def test_chunked_prefill_and_prefix_cache(family):
    arch, path, _, prompts, refs = family
    llm = tiny_llm(path, max_num_batched_tokens=8, block_size=4)
    first = greedy(llm, prompts)
    hits = llm.engine.scheduler.kv.stats.hits
    second = greedy(llm, prompts)  # the same prompts again: their full blocks are cached
    assert llm.engine.scheduler.kv.stats.hits > hits, "no prefix-cache hit on the second pass"
    for outs, label in ((first, "chunked"), (second, "prefix-cache hits")):
        assert_greedy_matches_hf([o.outputs[0].token_ids for o in outs], refs, f"{arch} {label}")


def test_preemption(family):
    arch, path, _, prompts, refs = family
    # Models whose layers all slide hold a few blocks per request (the window's), so a smaller pool.
    all_slide = arch in ("mistral-swa", "phi3")
    llm = tiny_llm(path, block_size=4, num_gpu_blocks_override=12 if all_slide else 26, max_model_len=96,
                   enable_prefix_caching=False, max_num_batched_tokens=8)
    outs = greedy(llm, prompts)
    assert llm.engine.scheduler.num_preemptions > 0, "the small pool forced no preemption"
    assert_greedy_matches_hf([o.outputs[0].token_ids for o in outs], refs, f"{arch} preempted")


def test_a_window_one_block_too_wide_fails(tmp_path, monkeypatch):
    """The same comparison, with every window reaching one block (4 tokens) further back than
    HF's: it must fail."""
    path = make_tiny_model_dir("mistral-swa", tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 259) for _ in range(n)] for n in (29, 45, 60)]
    refs = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    init = torch_ref.TorchRefAttentionBackend.__init__

    def widened(self, *args, **kwargs):
        init(self, *args, **kwargs)
        assert self.sliding_window == WINDOW
        self.sliding_window += 4

    monkeypatch.setattr(torch_ref.TorchRefAttentionBackend, "__init__", widened)
    llm = tiny_llm(path, block_size=4)
    outs = greedy(llm, prompts, prompt_logprobs=1)
    with pytest.raises(AssertionError):
        assert_greedy_matches_hf([o.outputs[0].token_ids for o in outs], refs, "window + 1 block")
        for prompt, out in zip(prompts, outs):
            ours = torch.tensor([out.prompt_logprobs[i][t].logprob for i, t in enumerate(prompt) if i])
            torch.testing.assert_close(ours, hf_prompt_logprobs(hf, prompt), atol=LOGPROB_TOL, rtol=0)


def test_speculative_ngram(family):
    """n-gram drafts verified over windows (rejected drafts roll back past released blocks'
    bounds): greedy tokens stay HF's."""
    from tests.helpers.engine import pin_spec_cost

    arch, path, _, prompts, refs = family
    llm = tiny_llm(path, block_size=4, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    pin_spec_cost(llm)
    outs = greedy(llm, prompts)
    assert_greedy_matches_hf([o.outputs[0].token_ids for o in outs], refs, f"{arch} speculative")
    assert llm.engine.scheduler.spec_stats.snapshot().num_drafts > 0, "nothing was drafted"


def test_gemma3_conditional_generation_text(tmp_path):
    """Gemma3ForConditionalGeneration: the language model's weights (model.language_model.*, the
    tied head), the vision tower skipped; text prompts match HF's multimodal model."""
    from tests.helpers.tiny_models import make_tiny_gemma3_multimodal_dir

    from transformers import Gemma3ForConditionalGeneration

    path = make_tiny_gemma3_multimodal_dir(tmp_path)
    hf = Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 250) for _ in range(n)] for n in (5, 40)]
    refs = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    outs = greedy(tiny_llm(path), prompts)
    assert_greedy_matches_hf([o.outputs[0].token_ids for o in outs], refs, "gemma3 multimodal, text")
