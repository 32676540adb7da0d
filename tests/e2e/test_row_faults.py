"""A row-level fault fails only its request, in the real multi-process engine: non-finite logits
in one request's row, sampling raising for one request (injected through TOKENMILL_TEST_FAULTS,
read by the worker process). The victims fail with RequestFailedError midway; every other
request of the busy batch gets exactly the tokens it gets alone; the engine keeps serving and
holds nothing afterwards. Without the variable, the same prompts run normally."""

from __future__ import annotations

import asyncio
import json

import pytest

from tokenmill import SamplingParams
from tokenmill.errors import RequestFailedError
from tokenmill.frontend.async_llm import AsyncLLM
from tokenmill.protocol import RowFailure
from tokenmill.sampling_params import RequestOutputKind

ENGINE = dict(dtype="float32", kv_cache_memory_gb=0.01)
NAN, SAMPLING = 7, 8  # marker tokens: prompts starting with them are the victims
PLAN = {"nan_logits": {"marker_token": NAN, "after": 3}, "sampling_error": {"marker_token": SAMPLING, "after": 2}}


def _params(i: int, n: int = 1) -> SamplingParams:
    random = dict(temperature=0.8, seed=100 + i, top_p=0.9) if i % 2 else dict(temperature=0.0)
    return SamplingParams(max_tokens=24, ignore_eos=True, n=n, output_kind=RequestOutputKind.DELTA, **random)


NORMAL = [([20 + i, 30, 31, 32, 33][: 2 + i % 4], _params(i)) for i in range(6)]
VICTIMS = [([NAN, 30, 31, 32], _params(1), RowFailure.NON_FINITE_LOGITS),
           ([SAMPLING, 30, 31], _params(2), RowFailure.SAMPLING_ERROR),
           ([NAN, 40, 41], _params(3, n=2), RowFailure.NON_FINITE_LOGITS)]


async def _collect(llm: AsyncLLM, prompt: list[int], params: SamplingParams) -> tuple[list[list[int]], BaseException | None]:
    tokens: list[list[int]] = [[] for _ in range(params.n)]
    try:
        async for out in llm.generate({"prompt_token_ids": prompt}, params):
            for c in out.outputs:
                tokens[c.index] += c.token_ids
    except RequestFailedError as exc:
        return tokens, exc
    return tokens, None


def test_row_faults_fail_only_their_requests(tiny_model, monkeypatch) -> None:
    monkeypatch.setenv("TOKENMILL_TEST_FAULTS", json.dumps(PLAN))

    async def main():
        llm = AsyncLLM(tiny_model, **ENGINE)
        try:
            everything = [*((p, s) for p, s in NORMAL), *((p, s) for p, s, _ in VICTIMS)]
            together = await asyncio.gather(*(_collect(llm, p, s) for p, s in everything))
            alone = [await _collect(llm, p, s) for p, s in NORMAL]
            return together, alone, await llm.kv_cache_stats(), llm.stalled_for()
        finally:
            llm.shutdown()

    together, alone, stats, stalled = asyncio.run(main())
    for (tokens, error), (ref, ref_error) in zip(together[:len(NORMAL)], alone):
        assert error is None and ref_error is None
        assert tokens == ref and len(tokens[0]) == 24
    for (tokens, error), (_, _, why) in zip(together[len(NORMAL):], VICTIMS):
        assert isinstance(error, RequestFailedError) and str(error) == why.message
        assert all(len(t) < 24 for t in tokens)
    assert together[len(NORMAL)][0][0], "the NaN victim failed before streaming anything"
    assert (stats["num_free_blocks"], stats["num_requests"]) == (stats["num_blocks"], 0)  # nothing left behind
    assert stalled == 0.0


def test_victim_prompts_run_normally_without_fault_injection(tiny_model, monkeypatch) -> None:
    monkeypatch.delenv("TOKENMILL_TEST_FAULTS", raising=False)

    async def main():
        llm = AsyncLLM(tiny_model, **ENGINE)
        try:
            return await asyncio.gather(*(_collect(llm, p, s) for p, s, _ in VICTIMS))
        finally:
            llm.shutdown()

    for (tokens, error), (_, params, _) in zip(asyncio.run(main()), VICTIMS):
        assert error is None and [len(t) for t in tokens] == [24] * params.n



@pytest.mark.parametrize("fault,method", [("nan_logits", "ngram"), ("sampling_error", "ngram"),
                                          ("sampling_error", "draft_model")])
def test_row_fault_fails_alone_in_speculative_steps(tiny_model, monkeypatch, capfd, fault, method) -> None:
    """With speculation drafting on every step (repetitive prompts for n-gram lookup; the target
    as its own draft model, seeded sampling, for rejection sampling), a row fault is caught in
    verification steps too: non-finite logits at any of a row's positions, or its sampling
    raising (the worker then verifies each row alone). The victims fail; the others' tokens
    are their own alone."""
    marker, why = ((NAN, RowFailure.NON_FINITE_LOGITS) if fault == "nan_logits"
                   else (SAMPLING, RowFailure.SAMPLING_ERROR))
    monkeypatch.setenv("TOKENMILL_TEST_FAULTS", json.dumps({fault: {"marker_token": marker, "after": 4}}))
    phrases = [[50 + 3 * i, 90 + i, 120, 140 + i] for i in range(5)]
    prompts = [p * 3 + p[:2] for p in phrases] + [[marker, *p * 3, *p[:2]] for p in phrases[:2]]
    spec = {"method": method, "num_speculative_tokens": 3, "max_step_tokens": 0}
    if method == "draft_model":
        spec["model"] = tiny_model
    params = [SamplingParams(max_tokens=24, ignore_eos=True, output_kind=RequestOutputKind.DELTA,
                             **(dict(temperature=0.0) if method == "ngram" else dict(temperature=0.8, seed=i)))
              for i in range(len(prompts))]

    async def main():
        llm = AsyncLLM(tiny_model, **ENGINE, speculative_config=spec)
        try:
            together = await asyncio.gather(*(_collect(llm, p, s) for p, s in zip(prompts, params)))
            alone = [await _collect(llm, p, s) for p, s in zip(prompts[:5], params)]
            return together, alone, await llm.scheduler_stats(), await llm.kv_cache_stats()
        finally:
            llm.shutdown()

    together, alone, sched, kv = asyncio.run(main())
    assert [t for t, _ in together[:5]] == [t for t, _ in alone] and all(e is None for _, e in together[:5])
    for tokens, error in together[5:]:
        assert isinstance(error, RequestFailedError) and str(error) == why.message
        assert len(tokens[0]) < 24
    assert sched["spec_num_accepted_tokens"] > 0, sched
    assert kv["num_requests"] == 0 and kv["num_free_blocks"] == kv["num_blocks"], kv
    if fault == "sampling_error":  # the worker's log: it was a verification step that raised
        assert "verifying a step of" in capfd.readouterr().err
