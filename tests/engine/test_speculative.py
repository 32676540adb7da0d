"""Speculative decoding end to end: with any proposer, greedy and seeded outputs are the plain
engine's token for token (async on and off, chunked prefill, preemption, the real SmolLM2), and
drafts are really verified and accepted (the counters say how many).

The reference is the same engine without speculation and with async scheduling off; it is itself
checked against Hugging Face in test_generate_vs_hf.py and test_smollm2_vs_hf.py."""

from __future__ import annotations

import numpy as np
import pytest

from tests.engine.conftest import tiny_llm
from tests.helpers.engine import pin_spec_cost, worker_runner
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


def assert_histories_match_the_core(llm) -> tuple[bool, int]:
    """Between engine steps: every n-gram history the worker holds is its request's tokens as
    the core knows them, then at most the tokens of the steps in flight. Returns (held, rows)."""
    runner, table = worker_runner(llm), llm.engine.scheduler.table
    spec = runner.speculator
    lengths = spec.history_len.tolist()
    if not spec.live:
        assert not any(lengths), "a dormant speculator holds a history"
        return False, 0
    for slot in table.order.tolist():
        known, pending = int(table.num_tokens[slot]), int(table.num_pending[slot])
        held = runner.batch.slot_of[int(table.handle[slot])]
        assert known + (pending > 0) <= lengths[held] <= known + pending, (known, pending, lengths[held])
        assert spec.history[held, :known].tolist() == table.tokens[slot, :known].tolist()
    return True, table.num_running


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_ngram_histories_sleep_under_load_and_are_rebuilt(tiny_model_dir, reference, async_scheduling):
    """More rows than max_step_tokens: nothing is proposed, so after a few steps the worker drops
    the n-gram histories (the steps are the plain ones); as rows finish, proposing resumes from
    histories rebuilt from the core's tokens and the token in flight. After every step each held
    history is checked against the core; drafts are accepted after the rebuild; outputs unchanged."""
    first, prompts = repetitive_prompts(2, seed=8), repetitive_prompts(12, seed=9)
    params = [SamplingParams(temperature=0.0, max_tokens=6 + 5 * i, ignore_eos=True) for i in range(12)]
    want = token_ids(reference, first, GREEDY), token_ids(reference, prompts, params)
    llm = tiny_llm(tiny_model_dir, async_scheduling=async_scheduling, speculative_config={**NGRAM, "max_step_tokens": 4})
    pin_spec_cost(llm)
    engine, seen = llm.engine, []
    step = engine.step

    def checked_step():
        outputs = step()
        seen.append(assert_histories_match_the_core(llm))
        return outputs
    engine.step = checked_step
    assert token_ids(llm, first, GREEDY) == want[0]  # two rows: histories held from the start
    accepted = llm.scheduler_stats()["spec_num_accepted_tokens"]
    assert all(held for held, _ in seen) and accepted > 0
    seen.clear()
    assert token_ids(llm, prompts, params) == want[1]  # twelve: dormant, then rebuilt for the last three
    held = [h for h, _ in seen]
    asleep = held.index(False)
    resumed = held.index(True, asleep)
    assert 0 < seen[resumed][1] < 4 and False not in held[resumed:], held
    assert llm.scheduler_stats()["spec_num_accepted_tokens"] > accepted
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


def draft_config(path: str, k: int = 3) -> dict:
    return {"method": "draft_model", "model": path, "num_speculative_tokens": k, "max_step_tokens": 0}


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_target_as_draft_accepts_everything_and_changes_nothing(tiny_model_dir, reference, async_scheduling):
    """The target as its own draft: every draft is accepted (the draft's KV and proposals are the
    target's), greedy and seeded outputs are the plain ones, with chunked prefill in play."""
    prompts = repetitive_prompts(6, seed=3)
    seeded = [SamplingParams(temperature=0.8, top_k=40, seed=7 + i, max_tokens=30, ignore_eos=True)
              for i in range(len(prompts))]
    llm = tiny_llm(tiny_model_dir, async_scheduling=async_scheduling, max_num_batched_tokens=24,
                   speculative_config=draft_config(tiny_model_dir))
    for params in (GREEDY, seeded):  # the second pass reuses the first's cached blocks
        assert token_ids(llm, prompts, params) == token_ids(reference, prompts, params)
        stats = llm.scheduler_stats()
        assert stats["spec_num_draft_tokens"] > 100, stats
        assert stats["spec_num_accepted_tokens"] == stats["spec_num_draft_tokens"], stats
    assert stats["prefix_cache_hits"] > 0, stats
    llm.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_target_as_draft_across_a_dormant_spell(tiny_model_dir, reference, async_scheduling):
    """Two rows, then twelve (more than max_step_tokens=4): the draft's state is dropped (its KV
    no longer written), and once three rows are left it runs over every position computed so
    far and proposes again. Then requests extending four of the twelve, one at a time: their
    cached prefixes hold blocks computed while the draft slept, which it computes first. The
    target as its own draft accepts every draft only if its KV has no hole."""
    runs = [(repetitive_prompts(2, seed=8), [GREEDY] * 2),
            (repetitive_prompts(12, seed=9), [SamplingParams(temperature=0.0, max_tokens=6 + 5 * i, ignore_eos=True)
                                             for i in range(12)])]
    llm = tiny_llm(tiny_model_dir, async_scheduling=async_scheduling,
                   speculative_config={**draft_config(tiny_model_dir), "max_step_tokens": 4})
    pin_spec_cost(llm)
    for prompts, params in runs:
        assert token_ids(llm, prompts, params) == token_ids(reference, prompts, params)
    assert worker_runner(llm).speculator.slept
    before = llm.scheduler_stats()
    prompts, params = runs[1]
    outputs = token_ids(reference, prompts, params)
    for i in (8, 9, 10, 11):  # prompt + 40 of its outputs: blocks decoded while the draft slept
        extended = {"prompt_token_ids": prompts[i]["prompt_token_ids"] + outputs[i][:40] + [7, 8]}
        assert token_ids(llm, [extended], GREEDY) == token_ids(reference, [extended], GREEDY)
    stats = llm.scheduler_stats()
    assert stats["prefix_cache_hits"] - before["prefix_cache_hits"] >= 4 * 48, stats
    assert stats["spec_num_draft_tokens"] - before["spec_num_draft_tokens"] > 50, stats
    assert stats["spec_num_accepted_tokens"] == stats["spec_num_draft_tokens"], stats
    llm.shutdown()


def shared_prefix_prompts() -> list[dict]:
    """Prompts sharing prefixes longer than a block (16 tokens), each after the first reusing the
    blocks of those before it. Under a budget of 24 tokens, the 57-token one computes 25 after
    its 32 cached: a 24-token chunk, then a one-token last chunk (with no cache: 24, 24, 9)."""
    rng = np.random.default_rng(5)
    base = rng.integers(5, 200, 40).tolist()
    return [{"prompt_token_ids": base[:n] + rng.integers(5, 200, extra).tolist()}
            for n, extra in ((37, 3), (34, 23), (20, 9), (40, 6))]


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_target_as_draft_accepts_everything_with_prefix_cache_hits(tiny_model_dir, reference, sampling):
    """Requests run one after another reuse cached blocks; a prompt whose last chunk is a single
    token (what the hits make here) must not verify drafts nobody proposed for it: that used to
    feed it stale tokens, sample from the wrong position and count the phantom drafts rejected."""
    prompts = shared_prefix_prompts()
    llm = tiny_llm(tiny_model_dir, max_num_batched_tokens=24, speculative_config=draft_config(tiny_model_dir))
    for i, prompt in enumerate(prompts):
        params = GREEDY if sampling == "greedy" else SamplingParams(
            temperature=0.8, top_p=0.9, seed=11 + i, max_tokens=30, ignore_eos=True)
        assert token_ids(llm, [prompt], params) == token_ids(reference, [prompt], params), i
    stats = llm.scheduler_stats()
    assert stats["prefix_cache_hits"] >= 16 * 5, stats
    assert stats["spec_num_draft_tokens"] > 60, stats
    assert stats["spec_num_accepted_tokens"] == stats["spec_num_draft_tokens"], stats
    llm.shutdown()


def test_a_different_draft_model_changes_nothing(tiny_model_dir, reference, tmp_path):
    """A draft with other weights: some drafts rejected, greedy output still the plain one."""
    from tests.helpers.tiny_models import make_tiny_model_dir
    other = make_tiny_model_dir("llama", tmp_path, seed=1234)
    prompts = repetitive_prompts(6, seed=4)
    llm = tiny_llm(tiny_model_dir, speculative_config=draft_config(other), num_gpu_blocks_override=16)
    assert token_ids(llm, prompts, GREEDY) == token_ids(reference, prompts, GREEDY)
    stats = llm.scheduler_stats()
    assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"], stats
    assert stats["num_preemptions"] > 0, stats
    llm.shutdown()


@pytest.mark.parametrize("prefix_hit", ["fresh", "prefix-hit", "after-dormancy"])
def test_draft_kv_equals_a_fresh_prefill_bonus_token_included(tiny_model_dir, prefix_hit):
    """After the last (fully accepted) step, the draft's KV at every position of prompt + output
    equals the target's KV from one prefill of those tokens. prefix-hit: an earlier request
    left the first two blocks of the prompt in the prefix cache, and the request reuses them
    (draft KV included: the earlier request's draft wrote it there). after-dormancy: those
    blocks were decoded while the draft's state was dropped (more rows than max_step_tokens),
    so the draft computes them when the request starts."""
    import torch
    prompt = [5, 17, 42, 99, 7, 61, 3, 88, 19]
    spec = {**draft_config(tiny_model_dir), "max_step_tokens": 4 if prefix_hit == "after-dormancy" else 0}
    llm = tiny_llm(tiny_model_dir, async_scheduling=False, speculative_config=spec)
    pin_spec_cost(llm)
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    if prefix_hit == "prefix-hit":
        earlier = [(11 * i) % 190 + 5 for i in range(37)]
        llm.generate([{"prompt_token_ids": earlier}], greedy, use_tqdm=False)
        prompt = earlier[:34] + prompt
    elif prefix_hit == "after-dormancy":
        llm.generate(repetitive_prompts(2, seed=8), greedy, use_tqdm=False)  # the draft's state is held
        busy = [{"prompt_token_ids": [5 + i, 9, 13]} for i in range(12)]  # ... then dropped for these
        long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        earlier = busy[0]["prompt_token_ids"] + list(llm.generate(busy, long, use_tqdm=False)[0].outputs[0].token_ids)
        assert worker_runner(llm).speculator.slept
        llm.generate(repetitive_prompts(1, seed=10), greedy, use_tqdm=False)  # held again from here
        prompt = earlier[:34] + prompt
    out = llm.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)[0].outputs[0].token_ids
    stats = llm.scheduler_stats()
    assert stats["spec_num_accepted_tokens"] == stats["spec_num_draft_tokens"] > 0
    assert stats["prefix_cache_hits"] == (0 if prefix_hit == "fresh" else 32), stats
    tokens = prompt + list(out)
    # With adaptive speculation the last step, with no room left for a draft, proposed nothing:
    # nothing (target or draft) ever ran over the last token.
    checked = len(tokens) - (prefix_hit == "after-dormancy")
    runner = worker_runner(llm)
    (slot,) = runner.batch.slot_of.values()  # the finished request's end has not reached the worker yet
    draft_kv = _kv_at(runner.draft.kv_caches, runner.batch.block_table[slot], checked, runner.block_size)
    fresh = tiny_llm(tiny_model_dir, enable_prefix_caching=False)
    fresh.generate([{"prompt_token_ids": tokens}], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    fresh_runner = worker_runner(fresh)
    (fresh_slot,) = fresh_runner.batch.slot_of.values()
    prefill_kv = _kv_at(fresh_runner.kv_caches, fresh_runner.batch.block_table[fresh_slot], checked,
                        fresh_runner.block_size)
    torch.testing.assert_close(draft_kv, prefill_kv, atol=1e-4, rtol=1e-4)
    llm.shutdown()
    fresh.shutdown()


def _kv_at(caches, block_table, num_tokens: int, block_size: int):
    """[layers, 2, tokens, heads, dim]: the K and V of positions 0..num_tokens-1."""
    import torch
    positions = torch.arange(num_tokens)
    blocks = torch.as_tensor(block_table[(positions // block_size).numpy()].astype("int64"))
    return torch.stack([cache[:, blocks, positions % block_size] for cache in caches])
