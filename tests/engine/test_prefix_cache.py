"""Prefix caching: a second batch sharing a long system prompt (> 10 blocks) computes only its
new tokens, counted both by the prefix-cache stats and by the tokens the scheduler schedules,
and its outputs equal those of an engine without prefix caching."""

from __future__ import annotations

import random

import pytest

from tests.engine.conftest import tiny_llm
from tests.helpers.hf_reference import compare_greedy, hf_greedy
from tests.helpers.tiny_models import make_tiny_model_dir
from tokenmill import SamplingParams

BLOCK = 16
SYSTEM_LEN = 11 * BLOCK + 5  # 11 full blocks shared, then a partial block that differs per request
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


class ScheduleRecorder:
    """Wraps `scheduler.schedule` to count the tokens scheduled per step and per request."""

    def __init__(self, scheduler, monkeypatch) -> None:
        self.steps: list[int] = []
        self.per_handle: dict[int, int] = {}
        original = scheduler.schedule

        def schedule():
            out = original()
            if out is not None:
                self.steps.append(out.total_num_scheduled_tokens)
                for handle, n in zip(out.scheduled_handles, out.num_scheduled_tokens):
                    self.per_handle[handle] = self.per_handle.get(handle, 0) + n
            return out

        monkeypatch.setattr(scheduler, "schedule", schedule)

    def reset(self) -> None:
        self.steps, self.per_handle = [], {}

    @property
    def total(self) -> int:
        return sum(self.steps)


@pytest.fixture(scope="module")
def peaky_dir(tmp_path_factory) -> str:
    return make_tiny_model_dir("llama", tmp_path_factory.mktemp("peaky"), seed=4, initializer_range=0.3)


@pytest.fixture(scope="module")
def cached_llm(peaky_dir):
    return tiny_llm(peaky_dir)


@pytest.fixture(scope="module")
def uncached_llm(peaky_dir):
    return tiny_llm(peaky_dir, enable_prefix_caching=False)


def batch(system: list[int], first_tokens: list[int], rng: random.Random) -> list[dict]:
    """system + a suffix starting with a distinct token (so nothing past the system prompt is shared)."""
    return [{"prompt_token_ids": system + [t] + [rng.randrange(3, 259) for _ in range(rng.randrange(5, 30))]}
            for t in first_tokens]


def test_second_batch_computes_only_new_tokens(cached_llm, uncached_llm, monkeypatch):
    rng = random.Random(11)
    system = [rng.randrange(3, 259) for _ in range(SYSTEM_LEN)]
    first, second = batch(system, [3, 4, 5], rng), batch(system, [6, 7, 8], rng)
    scheduler = cached_llm.engine.scheduler
    recorder = ScheduleRecorder(scheduler, monkeypatch)
    shared = (SYSTEM_LEN // BLOCK) * BLOCK  # 176 tokens in 11 full blocks

    queries, hits = scheduler.kv.stats.queries, scheduler.kv.stats.hits
    out1 = cached_llm.generate(first, GREEDY, use_tqdm=False)
    lens1 = [len(p["prompt_token_ids"]) for p in first]
    assert scheduler.kv.stats.queries - queries == sum(lens1)
    # Requests admitted in the same step share the blocks the first one is computing.
    assert scheduler.kv.stats.hits - hits == 2 * shared
    assert recorder.total == sum(lens1) - 2 * shared + 3 * (MAX_TOKENS - 1)

    recorder.reset()
    queries, hits = scheduler.kv.stats.queries, scheduler.kv.stats.hits
    out2 = cached_llm.generate(second, GREEDY, use_tqdm=False)
    lens2 = [len(p["prompt_token_ids"]) for p in second]
    assert scheduler.kv.stats.queries - queries == sum(lens2)
    assert scheduler.kv.stats.hits - hits == len(second) * shared
    # Only the new tokens: each prompt past its cached blocks, then one token per decode step.
    assert sorted(recorder.per_handle.values()) == sorted(n - shared + MAX_TOKENS - 1 for n in lens2)
    assert recorder.total == sum(lens2) - 3 * shared + 3 * (MAX_TOKENS - 1)
    assert [o.num_cached_tokens for o in out2] == [shared] * 3

    reference = uncached_llm.generate(first + second, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out1 + out2] == [o.outputs[0].token_ids for o in reference]
    assert all(o.num_cached_tokens == 0 for o in reference)
    assert uncached_llm.engine.scheduler.kv.stats.hits == 0


def test_identical_prompt_recomputes_only_its_last_block(cached_llm, uncached_llm, monkeypatch):
    """A fully cached prompt still computes at least its last token (to get logits): with a prompt of
    exactly 12 blocks, 11 blocks hit and the last block's 16 tokens are computed."""
    rng = random.Random(12)
    prompt = {"prompt_token_ids": [rng.randrange(3, 259) for _ in range(12 * BLOCK)]}
    first = cached_llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    recorder = ScheduleRecorder(cached_llm.engine.scheduler, monkeypatch)
    again = cached_llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 11 * BLOCK
    assert recorder.total == BLOCK + MAX_TOKENS - 1
    expected = uncached_llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == expected


def test_generated_tokens_are_cached_too(cached_llm, uncached_llm):
    """A follow-up turn whose prompt is (previous prompt + its output + more) hits the output's blocks."""
    rng = random.Random(13)
    prompt = [rng.randrange(3, 259) for _ in range(40)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    out = cached_llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].token_ids
    follow_up = {"prompt_token_ids": prompt + out + [5, 6, 7]}
    got = cached_llm.generate(follow_up, GREEDY, use_tqdm=False)[0]
    # 80 tokens were computed and written: 5 full blocks; the 80th token's KV was never written
    # (the last sampled token is not fed back), so only 4 full blocks (64 tokens) may be cached.
    assert got.num_cached_tokens == 64
    expected = uncached_llm.generate(follow_up, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert got.outputs[0].token_ids == expected


@pytest.mark.slow
def test_real_model_shared_system_prompt(smollm2_llm, smollm2_hf, monkeypatch):
    tokenizer = smollm2_llm.get_tokenizer()
    system = ("You are Marlowe, a meticulous assistant for a maritime museum in Lisbon. You answer questions about "
              "ships, navigation, cartography and the age of exploration. Keep answers short, precise and "
              "friendly. If you are unsure, say so. Never invent dates. Prefer metric units. Mention the gallery "
              "number when an exhibit is relevant: gallery 1 holds astrolabes and quadrants, gallery 2 holds "
              "ship models, gallery 3 holds charts and atlases, gallery 4 holds the navigator portraits. "
              "The museum opens at ten in the morning and closes at six in the evening, every day except Monday. "
              "Tickets cost twelve euros; children under twelve and teachers with a class enter for free. The "
              "café on the top floor overlooks the river and serves pastries, soup and coffee until five. Guided "
              "tours in Portuguese, English and Spanish start at eleven and at three from the main hall. ")
    questions = [["Where are the astrolabes?", "What is a quadrant?"],
                 ["Which gallery has ship models?", "Who drew the charts?", "Is the museum open today?"]]

    def prompts(qs):
        texts = [tokenizer.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": q}],
                                               tokenize=False, add_generation_prompt=True) for q in qs]
        return [{"prompt_token_ids": tokenizer(t, add_special_tokens=False).input_ids} for t in texts]

    first, second = prompts(questions[0]), prompts(questions[1])
    common = 0
    a, b = first[0]["prompt_token_ids"], second[0]["prompt_token_ids"]
    while a[common] == b[common]:
        common += 1
    shared = common // BLOCK * BLOCK
    assert shared > 10 * BLOCK, f"the system prompt must span more than 10 blocks, got {common} tokens"
    scheduler = smollm2_llm.engine.scheduler
    smollm2_llm.generate(first, GREEDY, use_tqdm=False)
    recorder = ScheduleRecorder(scheduler, monkeypatch)
    hits = scheduler.kv.stats.hits
    out2 = smollm2_llm.generate(second, GREEDY, use_tqdm=False)
    lens2 = [len(p["prompt_token_ids"]) for p in second]
    assert scheduler.kv.stats.hits - hits == len(second) * shared
    assert recorder.total == sum(lens2) - len(second) * (shared - MAX_TOKENS + 1)
    assert [o.num_cached_tokens for o in out2] == [shared] * len(second)
    for prompt, out in zip(second, out2):
        ref = hf_greedy(smollm2_hf, prompt["prompt_token_ids"], MAX_TOKENS)
        assert compare_greedy(out.outputs[0].token_ids, ref, "cached system prompt") is None
