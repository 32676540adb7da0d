"""`LLM` and `AsyncLLM` share one request path (`EngineFrontend`): each request is tokenized and
checked once, a prepared request is not checked again, and a bug met while turning one
request's output into text fails that request alone (logged), not the engine."""

from __future__ import annotations

import asyncio
import logging

import pytest

from tests.helpers.request_checks import count_request_checks
from tests.helpers.tiny_models import make_tiny_model_dir
from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineArgs
from tokenmill.frontend.async_llm import AsyncLLM
from tokenmill.frontend.engine_frontend import EngineFrontend
from tokenmill.frontend.inproc_client import InprocClient
from tokenmill.frontend.detokenizer import IncrementalDetokenizer

ENGINE = dict(dtype="float32", kv_cache_memory_gb=0.01, single_process=True)
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
TEXT_FREE = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, detokenize=False)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_tiny_model_dir("llama", tmp_path_factory.mktemp("one-path"))


@pytest.fixture(scope="module")
def llm(model_dir):
    engine = LLM(model_dir, **ENGINE)
    yield engine
    engine.shutdown()


@pytest.fixture
def checks(monkeypatch) -> dict[str, int]:
    return count_request_checks(monkeypatch)


def assert_idle(llm: LLM) -> None:
    stats = llm.kv_cache_stats()
    assert stats["num_requests"] == 0 and stats["num_free_blocks"] == stats["num_blocks"], stats
    assert not llm.frontend.has_unfinished()


def test_llm_checks_each_request_once(llm, checks) -> None:
    outs = llm.generate(["hello", {"prompt_token_ids": [5, 6, 7]}], GREEDY, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4]
    assert checks == {"validate": 2, "tokenize": 2}
    prepared = llm.frontend.prepare("hello", GREEDY)
    again = llm.generate(prepared, use_tqdm=False)
    assert checks == {"validate": 3, "tokenize": 3}, "a prepared request was checked again"
    assert again[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    assert_idle(llm)


def test_requests_are_prepared_before_the_engine_starts(llm, model_dir) -> None:
    """Building a front-end starts nothing: requests can be checked first (the CLI does)."""
    frontend = EngineFrontend(EngineArgs(model=model_dir, **ENGINE))
    request = frontend.prepare("hello", GREEDY)
    with pytest.raises(RuntimeError, match="not started"):
        frontend.submit("r", request)
    assert not frontend.has_unfinished()
    with pytest.raises(RuntimeError, match="already started"):
        llm.frontend.start(InprocClient, InprocClient)


def test_prepared_request_carries_its_own_params(llm, model_dir) -> None:
    prepared = llm.frontend.prepare("hello", GREEDY)
    with pytest.raises(ValueError, match="^sampling_params: a prepared request carries its own"):
        llm.generate(prepared, GREEDY, use_tqdm=False)

    async def main(engine: AsyncLLM) -> None:
        with pytest.raises(ValueError, match="^sampling_params: a prepared request carries its own"):
            async for _ in engine.generate(engine.frontend.prepare("hi", GREEDY), GREEDY, "x"):
                pass

    run_async(model_dir, main)
    assert_idle(llm)


def test_async_llm_checks_each_request_once(model_dir, checks) -> None:
    async def main(engine: AsyncLLM) -> None:
        async def final(prompt, params) -> list[int]:
            async for out in engine.generate(prompt, params):
                pass
            return out.outputs[0].token_ids

        first = await final("hello", GREEDY)
        assert checks == {"validate": 1, "tokenize": 1}
        assert await final(engine.frontend.prepare("hello", GREEDY), None) == first
        assert checks == {"validate": 2, "tokenize": 2}, "a prepared request was checked again"

    run_async(model_dir, main)


def test_a_failure_on_one_request_output_fails_it_alone(llm, model_dir, monkeypatch, caplog) -> None:
    def broken_push(self, token_id: int) -> str:
        raise RuntimeError("detokenizer bug")

    monkeypatch.setattr(IncrementalDetokenizer, "push", broken_push)
    with caplog.at_level(logging.ERROR, logger="tokenmill.frontend.output_processor"):
        with pytest.raises(RuntimeError, match="detokenizer bug"):
            llm.generate(["hello", {"prompt_token_ids": [5, 6, 7]}], [GREEDY, TEXT_FREE], use_tqdm=False)
    assert_idle(llm)
    failed = [r for r in caplog.records if "failed while processing its output" in r.getMessage()]
    assert failed and failed[0].exc_info is not None  # logged with its traceback
    # The engine goes on: a request that needs no text still runs.
    assert len(llm.generate({"prompt_token_ids": [5, 6, 7]}, TEXT_FREE, use_tqdm=False)[0].outputs[0].token_ids) == 4

    async def main(engine: AsyncLLM) -> None:
        async def tokens(prompt, params, request_id) -> list[int]:
            async for out in engine.generate(prompt, params, request_id):
                pass
            return out.outputs[0].token_ids

        broken, fine = await asyncio.gather(tokens("hello", GREEDY, "broken"),
                                            tokens({"prompt_token_ids": [5, 6, 7]}, TEXT_FREE, "fine"),
                                            return_exceptions=True)
        assert isinstance(broken, RuntimeError) and "detokenizer bug" in str(broken)
        assert isinstance(fine, list) and len(fine) == 4
        assert (await engine.kv_cache_stats())["num_requests"] == 0

    run_async(model_dir, main)


def run_async(model_dir: str, main) -> None:
    engine = AsyncLLM(model_dir, **ENGINE)
    try:
        asyncio.run(main(engine))
    finally:
        engine.shutdown()
