"""LongRoPE's choice of factors for prompts longer than `original_max_position_embeddings`, against
Hugging Face (tiny random Phi-3, float32, CPU; original_max 32, prompts of 40-60 tokens).

HF rotates such a prompt with the long factors from position 0 (its forward call is longer than
original_max) and every token generated after it too; a prompt within original_max keeps the short
factors and its generations switch at position original_max. tokenmill decides a prompt's factors
by its full length, so chunked prefill and prefix-cache hits give HF's result too. The last test
plants the old rule (each token by its own position) and sees the comparison fail.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.engine.conftest import tiny_llm
from tests.engine.test_families_vs_hf import LOGPROB_TOL, NEW_TOKENS, greedy, hf_prompt_logprobs
from tests.helpers.hf_reference import assert_greedy_matches_hf, hf_greedy
from tests.helpers.tiny_models import make_tiny_model_dir
from tokenmill.layers.rotary import RotaryEmbedding

ORIGINAL_MAX = 32
# 20 stays within original_max (its generations cross it); 33 is the first length past it.
PROMPT_LENS = (20, 33, 40, 52, 60)


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    path = make_tiny_model_dir("phi3", tmp_path_factory.mktemp("longrope"),
                               original_max_position_embeddings=ORIGINAL_MAX)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    rng = random.Random(7)
    longest = [rng.randrange(3, 259) for _ in range(max(PROMPT_LENS))]
    # Each prompt a prefix of the longest: the short prompts' cached blocks start the long ones.
    prompts = [longest[:n] for n in PROMPT_LENS]
    refs = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    return path, hf, prompts, refs


def check(llm, hf, prompts, refs, label, logprobs=True):
    outs = greedy(llm, prompts, **({"prompt_logprobs": 1} if logprobs else {}))
    assert_greedy_matches_hf([o.outputs[0].token_ids for o in outs], refs, label)
    if not logprobs:
        return
    for prompt, out in zip(prompts, outs):
        ours = torch.tensor([out.prompt_logprobs[i][t].logprob for i, t in enumerate(prompt) if i])
        torch.testing.assert_close(ours, hf_prompt_logprobs(hf, prompt), atol=LOGPROB_TOL, rtol=0,
                                   msg=lambda m: f"{label}, prompt of {len(prompt)}: {m}")


def test_hf_switches_factors_by_call_length(phi3):
    """The premise: HF's logits for the first 32 tokens change once the call is longer than 32."""
    _, hf, prompts, _ = phi3
    with torch.inference_mode():
        alone = hf(input_ids=torch.tensor([prompts[-1][:ORIGINAL_MAX]])).logits[0]
        within_longer = hf(input_ids=torch.tensor([prompts[-1][:ORIGINAL_MAX + 1]])).logits[0, :ORIGINAL_MAX]
    assert (alone - within_longer).abs().max() > 1e-3


def test_long_prompts(phi3):
    path, hf, prompts, refs = phi3
    check(tiny_llm(path), hf, prompts, refs, "longrope")


def test_long_prompts_chunked(phi3):
    """An 8-token budget splits every prompt: each chunk still uses its prompt's factors."""
    path, hf, prompts, refs = phi3
    check(tiny_llm(path, max_num_batched_tokens=8, block_size=4), hf, prompts, refs, "longrope chunked")


def test_prefix_cache_keeps_factors_apart(phi3):
    """A short prompt's cached blocks (short factors) never serve a long prompt (long factors from
    position 0), nor the other way round; equal-kind prompts still share them."""
    path, _, prompts, refs = phi3
    llm = tiny_llm(path, block_size=4)
    for order in ((0, 2), (2, 0), (3, 4)):  # short then long, long then short, long then long
        for i in order:
            out = greedy(llm, [prompts[i]])
            assert_greedy_matches_hf([out[0].outputs[0].token_ids], [refs[i]], f"prefix cache, prompt {i}")
    assert llm.engine.scheduler.kv.stats.hits > 0, "the long prompts shared no cached block"


def test_speculative_ngram(phi3):
    """n-gram drafts verified in steps of several positions per row: greedy tokens stay HF's
    (each position is rotated by its own position + 1, as HF's one-token decodes are)."""
    from tests.helpers.engine import pin_spec_cost

    path, _, prompts, refs = phi3
    llm = tiny_llm(path, block_size=4, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    pin_spec_cost(llm)
    outs = greedy(llm, prompts)
    assert_greedy_matches_hf([o.outputs[0].token_ids for o in outs], refs, "longrope speculative")
    assert llm.engine.scheduler.spec_stats.snapshot().num_drafts > 0, "nothing was drafted"


def test_graphs(phi3, monkeypatch):
    """The worker's prompt-chunk and decode graphs (captured as on CUDA, replayed eagerly on CPU:
    tests/helpers/graphs.py) take the factors from the device's inputs alone."""
    from tests.helpers.graphs import capture_real_graphs, replays

    path, _, prompts, refs = phi3
    llm = tiny_llm(path, max_num_seqs=4, max_num_batched_tokens=16, async_scheduling=False)
    runner = capture_real_graphs(llm, monkeypatch)
    for prompt, ref in zip(prompts, refs):  # one at a time: each prefill chunk is a step alone
        out = greedy(llm, [prompt])
        assert_greedy_matches_hf([out[0].outputs[0].token_ids], [ref], f"graphs, prompt of {len(prompt)}")
    assert replays(runner.prompt_graphs) >= len(prompts) and replays(runner.graphs) > 0
    llm.shutdown()


def test_the_old_rule_fails(phi3, monkeypatch):
    """Each token by its own position + 1 (the rule before): the long prompts no longer match."""
    path, hf, prompts, refs = phi3
    table_rows = RotaryEmbedding._table_rows
    monkeypatch.setattr(RotaryEmbedding, "_table_rows", lambda self, positions, meta: table_rows(self, positions, None))
    with pytest.raises(AssertionError):
        check(tiny_llm(path), hf, prompts[2:], refs[2:], "old rule")
