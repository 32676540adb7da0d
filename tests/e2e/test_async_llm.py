"""AsyncLLM: streamed deltas equal the offline result; a cancelled consumer's request is aborted."""

from __future__ import annotations

import asyncio

from tokenmill import LLM, SamplingParams
from tokenmill.frontend.async_llm import AsyncLLM
from tokenmill.sampling_params import RequestOutputKind

ENGINE = dict(dtype="float32", kv_cache_memory_gb=0.01)


def test_async_streams_deltas_and_cancellation_aborts(tiny_model) -> None:
    reference = LLM(tiny_model, single_process=True, **ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = reference.generate(["stream me", "and me"], params, use_tqdm=False)
    engine = AsyncLLM(tiny_model, **ENGINE)

    async def collect(prompt: str, request_id: str) -> tuple[list[int], str, list[int]]:
        delta = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                               output_kind=RequestOutputKind.DELTA)
        tokens, text, sizes = [], "", []
        async for out in engine.generate(prompt, delta, request_id):
            sizes.append(len(out.outputs[0].token_ids))
            tokens += out.outputs[0].token_ids
            text += out.outputs[0].text
        assert out.finished and out.outputs[0].finish_reason == "length"
        return tokens, text, sizes

    async def endless(started: asyncio.Event) -> None:
        forever = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        async for _ in engine.generate({"prompt_token_ids": [9, 8, 7]}, forever, "endless"):
            started.set()

    async def main() -> None:
        results = await asyncio.gather(collect("stream me", "a"), collect("and me", "b"))
        for (tokens, text, sizes), ref in zip(results, expected):
            assert tokens == ref.outputs[0].token_ids and text == ref.outputs[0].text
            assert len(sizes) > 1 and sum(sizes) == 12  # streamed, not one final chunk

        started = asyncio.Event()
        task = asyncio.create_task(endless(started))
        await asyncio.wait_for(started.wait(), 10)
        assert (await engine.scheduler_stats())["num_running"] == 1
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        for _ in range(100):  # the abort travels to the core asynchronously
            stats = await engine.kv_cache_stats()
            if stats["num_requests"] == 0:
                break
            await asyncio.sleep(0.02)
        assert stats["num_requests"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
