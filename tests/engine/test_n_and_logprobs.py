"""n samples, sample logprobs and prompt logprobs (against Hugging Face), penalties and logit_bias."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.engine.conftest import assert_engine_idle, tiny_llm
from tests.helpers.hf_reference import NEAR_TIE, Reference, assert_greedy_matches_hf
from tests.helpers.tiny_models import make_tiny_model_dir
from tokenmill import SamplingParams

TOL = 1e-3


@pytest.fixture(scope="module")
def peaky_dir(tmp_path_factory) -> str:
    return make_tiny_model_dir("llama", tmp_path_factory.mktemp("peaky"), seed=5, initializer_range=0.3)


@pytest.fixture(scope="module")
def llm(peaky_dir):
    return tiny_llm(peaky_dir)


@pytest.fixture(scope="module")
def tiny_hf(peaky_dir):
    return AutoModelForCausalLM.from_pretrained(peaky_dir, dtype=torch.float32).eval()


PROMPT = {"prompt_token_ids": [random.Random(1).randrange(3, 259) for _ in range(23)]}


# ---------------------------------------------------------------- n


def test_n_samples_distinct_under_sampling(llm):
    for seed in (None, 77):
        out = llm.generate(PROMPT, SamplingParams(n=4, temperature=1.0, seed=seed, max_tokens=12, ignore_eos=True),
                           use_tqdm=False)
        assert len(out) == 1
        samples = out[0].outputs
        assert [s.index for s in samples] == [0, 1, 2, 3]
        assert all(len(s.token_ids) == 12 and s.finish_reason == "length" for s in samples)
        assert len({tuple(s.token_ids) for s in samples}) == 4, [s.token_ids for s in samples]
        assert len({s.text for s in samples}) == 4


def test_n_samples_identical_under_greedy(llm):
    single = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    out = llm.generate(PROMPT, SamplingParams(n=4, temperature=0, max_tokens=12, ignore_eos=True, logprobs=2),
                       use_tqdm=False)[0].outputs
    assert [s.index for s in out] == [0, 1, 2, 3]
    assert all(s.token_ids == single[0].outputs[0].token_ids for s in out)
    assert all(s.text == out[0].text for s in out)
    assert all(len(s.logprobs) == 12 for s in out)


# ---------------------------------------------------------------- logprobs vs HF


@torch.inference_mode()
def hf_logprobs(hf, token_ids: list[int]) -> torch.Tensor:
    """float32 log_softmax of the logits at every position of `token_ids` (row i predicts token i + 1)."""
    logits = hf(input_ids=torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def check_row(row: dict, chosen: int, ref: torch.Tensor, k: int, label: str) -> None:
    """`row`: the engine's {token: Logprob} for one position; `ref`: HF logprobs [V] for it."""
    assert next(iter(row)) == chosen, f"{label}: the chosen token must come first"
    top = torch.topk(ref, k)
    top_ids = top.indices.tolist()
    assert set(row) == {chosen} | set(top_ids) or _tied_swap(row, chosen, ref, k), \
        f"{label}: got tokens {sorted(row)}, HF top-{k} {top_ids} + chosen {chosen}"
    assert len(row) in (k, k + 1)
    chosen_rank = int((ref > ref[chosen]).sum()) + 1
    assert row[chosen].rank == chosen_rank, f"{label}: chosen rank {row[chosen].rank}, HF {chosen_rank}"
    for token, lp in row.items():
        assert abs(lp.logprob - float(ref[token])) < TOL, f"{label}: token {token}: {lp.logprob} vs {float(ref[token])}"
        if token != chosen or chosen_rank <= k:
            expected_rank = int((ref > ref[token]).sum()) + 1
            assert abs(lp.rank - expected_rank) <= (1 if _near(ref, token) else 0), \
                f"{label}: token {token} rank {lp.rank}, HF {expected_rank}"
    ranks = sorted(lp.rank for t, lp in row.items() if t != chosen or chosen_rank <= k)
    assert ranks == list(range(1, k + 1)), f"{label}: top ranks {ranks}"


def _near(ref: torch.Tensor, token: int) -> bool:
    return bool(((ref - ref[token]).abs() < NEAR_TIE).sum() > 1)


def _tied_swap(row: dict, chosen: int, ref: torch.Tensor, k: int) -> bool:
    """The k-th and (k+1)-th tokens may swap when their logprobs are within NEAR_TIE."""
    kth = torch.topk(ref, k).values[-1]
    return all(abs(float(ref[t]) - float(kth)) < NEAR_TIE or float(ref[t]) > float(kth) for t in row if t != chosen)


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_logprobs_match_hf(smollm2_llm, smollm2_hf, temperature):
    prompt = smollm2_llm.get_tokenizer()("The three primary colors are").input_ids
    params = SamplingParams(temperature=temperature, seed=3, max_tokens=8, ignore_eos=True, logprobs=5)
    out = smollm2_llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids) == 8
    ref = hf_logprobs(smollm2_hf, prompt + out.token_ids)
    for i, (token, row) in enumerate(zip(out.token_ids, out.logprobs)):
        check_row(row, token, ref[len(prompt) - 1 + i], 5, f"position {i}")
        if temperature == 0.0:
            assert row[token].rank == 1
    total = sum(float(ref[len(prompt) - 1 + i, t]) for i, t in enumerate(out.token_ids))
    assert abs(out.cumulative_logprob - total) < 8 * TOL


@pytest.mark.slow
def test_prompt_logprobs_match_hf(smollm2_llm, smollm2_hf):
    prompt = smollm2_llm.get_tokenizer()("Paris is the capital and largest city of France, with").input_ids
    out = smollm2_llm.generate({"prompt_token_ids": prompt},
                               SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3), use_tqdm=False)[0]
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
    assert out.prompt_logprobs[0] is None
    ref = hf_logprobs(smollm2_hf, prompt)
    for i in range(1, len(prompt)):
        check_row(out.prompt_logprobs[i], prompt[i], ref[i - 1], 3, f"prompt position {i}")


def test_tiny_logprobs_and_prompt_logprobs_with_chunks(peaky_dir, tiny_hf):
    """Chunked prefill (8-token budget) must not lose or shift prompt-logprob rows; logprobs=0 gives
    the chosen token only."""
    chunked = tiny_llm(peaky_dir, max_num_batched_tokens=8)
    prompt = PROMPT["prompt_token_ids"]
    out = chunked.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0,
                                                  prompt_logprobs=4), use_tqdm=False)[0]
    ref = hf_logprobs(tiny_hf, prompt + out.outputs[0].token_ids)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for i in range(1, len(prompt)):
        check_row(out.prompt_logprobs[i], prompt[i], ref[i - 1], 4, f"prompt position {i}")
    for i, (token, row) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs)):
        assert list(row) == [token] and row[token].rank == 1
        assert abs(row[token].logprob - float(ref[len(prompt) - 1 + i, token])) < TOL
    assert_engine_idle(chunked)


# ---------------------------------------------------------------- penalties and logit_bias


@torch.inference_mode()
def hf_greedy_penalized(hf, prompt: list[int], n: int, params: SamplingParams) -> tuple[list[int], list[float]]:
    """Greedy over HF logits adjusted as documented: logit_bias added; repetition penalty (HF: seen in
    prompt or output, positive logits divided, negative multiplied); frequency and presence (OpenAI:
    output counts only)."""
    tokens: list[int] = []
    gaps: list[float] = []
    for _ in range(n):
        logits = hf(input_ids=torch.tensor([prompt + tokens])).logits[0, -1].float()
        for t, b in (params.logit_bias or {}).items():
            logits[t] += b
        seen = torch.zeros_like(logits, dtype=torch.bool)
        seen[torch.tensor(prompt + tokens)] = True
        p = params.repetition_penalty
        logits = torch.where(seen, torch.where(logits > 0, logits / p, logits * p), logits)
        counts = torch.zeros_like(logits)
        if tokens:
            counts.index_add_(0, torch.tensor(tokens), torch.ones(len(tokens)))
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
        top2 = torch.topk(logits, 2)
        tokens.append(int(top2.indices[0]))
        gaps.append(float(top2.values[0] - top2.values[1]))
    return tokens, gaps


PENALTIES = {
    "repetition": dict(repetition_penalty=1.8),
    "frequency": dict(frequency_penalty=1.5),
    "presence": dict(presence_penalty=2.0),
    "all-and-bias": dict(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.5,
                         logit_bias={40: 3.0, 100: -2.0, 200: 1.5}),
}


@pytest.mark.parametrize("case", list(PENALTIES))
def test_penalties_as_defined(llm, tiny_hf, case):
    prompt = PROMPT["prompt_token_ids"]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, **PENALTIES[case])
    plain = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].token_ids
    got = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids
    expected, gaps = hf_greedy_penalized(tiny_hf, prompt, 20, params)
    assert expected != plain, "the penalty must change the greedy output, or this test proves nothing"
    assert_greedy_matches_hf([got], [Reference(expected, gaps)], case)


def test_penalties_only_affect_their_row(llm):
    """A penalized request in the batch must not change its greedy neighbour."""
    plain = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    alone = llm.generate(PROMPT, plain, use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate([PROMPT, PROMPT, PROMPT], [
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=2.0, presence_penalty=2.0,
                       logit_bias={7: 50.0}, min_tokens=10),
        plain, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, frequency_penalty=-2.0)], use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone
    assert mixed[0].outputs[0].token_ids != alone


def test_logit_bias_forces_and_bans(llm):
    forced = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                                                 logit_bias={123: 100.0}), use_tqdm=False)[0].outputs[0]
    assert forced.token_ids == [123] * 10
    sampled = llm.generate(PROMPT, SamplingParams(temperature=1.0, seed=5, max_tokens=10, ignore_eos=True,
                                                  logit_bias={124: 100.0}), use_tqdm=False)[0].outputs[0]
    assert sampled.token_ids == [124] * 10
    plain = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].token_ids
    banned = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                                                 logit_bias={t: -100.0 for t in set(plain)}),
                          use_tqdm=False)[0].outputs[0].token_ids
    assert not set(banned) & set(plain)


def test_huge_repetition_penalty_prevents_repeats(llm):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids
    assert len(set(plain)) < len(plain), "the plain greedy output must repeat, or this test proves nothing"
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                              repetition_penalty=1e6), use_tqdm=False)[0].outputs[0].token_ids
    assert len(set(out)) == len(out), f"a token repeats: {out}"
    assert not set(out) & set(PROMPT["prompt_token_ids"]), "a prompt token was repeated"
