"""Speculative decoding end to end: with any proposer, greedy and seeded outputs are the plain
engine's token for token (async on and off, chunked prefill, preemption, the real SmolLM2), and
drafts are really verified and accepted (the counters say how many).

The reference is the same engine without speculation and with async scheduling off; it is itself
checked against Hugging Face in test_generate_vs_hf.py and test_smollm2_vs_hf.py."""

from __future__ import annotations

import numpy as np
import pytest

from tests.engine.conftest import tiny_llm
from tests.helpers.engine import worker_runner
from tokenmill import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "max_step_tokens": 0}


def repetitive_prompts(count: int, seed: int = 0) -> list[dict]:
    """Prompts that repeat a phrase, so that n-gram lookup finds something to propose."""
    rng = np.random.default_rng(seed)
    prompts = []
    for _ in range(count):
        phrase = rng.integers(5, 200, int(rng.integers(4, 14))).tolist()
        prompts.append({"prompt_token_ids": phrase * 3 + phrase[:3]})
    return prompts


def token_ids(llm: LLM, prompts, params) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return tiny_llm(tiny_model_dir, async_scheduling=False)


GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("extra", [{}, {"max_num_batched_tokens": 16}, {"num_gpu_blocks_override": 16}],
                         ids=["plain", "chunked-prefill", "preemption"])
def test_ngram_greedy_equals_plain(tiny_model_dir, reference, async_scheduling, extra):
    prompts = repetitive_prompts(8)
    want = token_ids(reference, prompts, GREEDY)
    llm = tiny_llm(tiny_model_dir, async_scheduling=async_scheduling, speculative_config=NGRAM, **extra)
    assert token_ids(llm, prompts, GREEDY) == want
    stats = llm.scheduler_stats()
    assert stats["spec_num_draft_tokens"] > 100 and stats["spec_num_accepted_tokens"] > 0, stats
    if "num_gpu_blocks_override" in extra:
        assert stats["num_preemptions"] > 0, stats
    if async_scheduling:
        assert worker_runner(llm).num_placeholders_filled > 0, "the speculative run did not run async"
    llm.shutdown()


def test_seeded_sampling_equals_plain(tiny_model_dir, reference):
    """n-gram drafts are one-hot: the target's own seeded sample decides, so seeded outputs are the plain ones."""
    prompts = repetitive_prompts(6, seed=1)
    params = [SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=100 + i, max_tokens=32, ignore_eos=True)
              for i in range(len(prompts))]
    want = token_ids(reference, prompts, params)
    llm = tiny_llm(tiny_model_dir, speculative_config=NGRAM)
    assert token_ids(llm, prompts, params) == want
    assert llm.scheduler_stats()["spec_num_draft_tokens"] > 0
    llm.shutdown()


def test_requests_that_cannot_speculate_run_plain_beside_those_that_do(tiny_model_dir, reference):
    """Penalties and logprobs turn speculation off for that request only; both kinds share steps."""
    prompts = repetitive_prompts(4, seed=2)
    params = [GREEDY, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, repetition_penalty=1.3),
              SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2), GREEDY]
    want = reference.generate(prompts, params, use_tqdm=False)
    llm = tiny_llm(tiny_model_dir, speculative_config=NGRAM)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert [len(o.outputs[0].logprobs or []) for o in got] == [0, 0, 40, 0]
    assert llm.scheduler_stats()["spec_num_draft_tokens"] > 0
    llm.shutdown()


@pytest.mark.slow
def test_smollm2_copying_a_passage(smollm2_llm):
    """The real model asked to repeat a passage: n-gram drafts are mostly accepted, output unchanged."""
    tokenizer = smollm2_llm.get_tokenizer()
    passage = ("The printing press spread across Europe within decades. Books became cheaper, literacy rose, "
               "and ideas travelled faster than ever before. ")
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": f"Repeat exactly:\n{passage * n}"}],
                                             tokenize=False, add_generation_prompt=True) for n in (1, 2)]
    params = SamplingParams(temperature=0.0, max_tokens=48)
    want = [o.outputs[0].token_ids for o in smollm2_llm.generate(prompts, params, use_tqdm=False)]
    with LLM("smollm2", dtype="float32", max_model_len=2048, kv_cache_memory_gb=0.5,
             speculative_config={"method": "ngram", "num_speculative_tokens": 4}) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.scheduler_stats()
    assert got == want
    assert stats["spec_num_accepted_tokens"] > stats["spec_num_draft_tokens"] // 2, stats
