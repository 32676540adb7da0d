"""Multi-process generation equals single-process, token for token (two workers, as two pipeline
stages: N ring readers); a second engine alongside; clean shutdown leaves nothing behind."""

from __future__ import annotations

import pytest

from tests.e2e.procs import engine_pids, leftovers, wait_gone
from tokenmill import LLM, SamplingParams
from tokenmill.errors import EngineDeadError

ENGINE = dict(dtype="float32", kv_cache_memory_gb=0.01, max_num_batched_tokens=64)
PROMPTS = ["hello world", "the quick brown fox jumps", "a", "tokenmill " * 12]


@pytest.fixture(scope="module")
def engines(tiny_model):
    mp = LLM(tiny_model, pipeline_parallel_size=2, **ENGINE)
    sp = LLM(tiny_model, single_process=True, **ENGINE)
    yield mp, sp
    mp.shutdown()
    sp.shutdown()


def _same(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        assert [(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in x.outputs] == \
               [(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in y.outputs]


def test_multiprocess_matches_single_process(engines) -> None:
    mp, sp = engines
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    first = sp.generate(PROMPTS, greedy, use_tqdm=False)
    _same(mp.generate(PROMPTS, greedy, use_tqdm=False), first)

    text = first[1].outputs[0].text
    stop = text[6:8]  # occurs in the greedy output, so the stop string must cut it there
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=24),
        SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=16),
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=[stop]),
        SamplingParams(temperature=0.7, top_k=20, seed=3, max_tokens=12, logprobs=2),
    ]
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[1], PROMPTS[3]]
    sp_out = sp.generate(prompts, params, use_tqdm=False)
    mp_out = mp.generate(prompts, params, use_tqdm=False)
    _same(mp_out, sp_out)
    assert len(mp_out[1].outputs) == 2
    assert mp_out[2].outputs[0].finish_reason == "stop" and mp_out[2].outputs[0].stop_reason == stop
    for mp_row, sp_row in zip(mp_out[3].outputs[0].logprobs, sp_out[3].outputs[0].logprobs, strict=True):
        assert mp_row.keys() == sp_row.keys()  # the worker's torch may use other threads: last-bit noise
        assert [(v.rank, v.decoded_token) for v in mp_row.values()] == \
               [(v.rank, v.decoded_token) for v in sp_row.values()]
        assert [v.logprob for v in mp_row.values()] == pytest.approx([v.logprob for v in sp_row.values()],
                                                                     abs=1e-5)
    # Each pipeline stage holds half the layers: the same memory holds twice the blocks.
    assert mp.kv_cache_stats()["num_blocks"] // 2 == sp.kv_cache_stats()["num_blocks"]
    stats = mp.kv_cache_stats()
    assert stats["num_requests"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]
    assert mp.scheduler_stats()["num_running"] == 0


def test_engine_attribute_only_in_single_process(engines) -> None:
    mp, sp = engines
    assert sp.engine.scheduler is not None
    with pytest.raises(AttributeError, match="kv_cache_stats"):
        mp.engine  # noqa: B018


def test_second_engine_alongside_then_clean_shutdown(engines, tiny_model) -> None:
    mp, _ = engines
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    with LLM(tiny_model, **ENGINE) as second:
        assert second.client.core.run_dir != mp.client.core.run_dir
        core, workers = engine_pids(second)
        assert len(workers) == 1 and len(engine_pids(mp)[1]) == 2
        a = mp.generate(["same prompt"], params, use_tqdm=False)
        b = second.generate(["same prompt"], params, use_tqdm=False)
        assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids
        run_dir = second.client.core.run_dir
    assert not wait_gone({core, *workers}, 2.0)
    assert not leftovers(run_dir)
    with pytest.raises(EngineDeadError):
        second.generate(["after shutdown"], params, use_tqdm=False)
    assert mp.generate(["same prompt"], params, use_tqdm=False)[0].outputs[0].token_ids == \
        a[0].outputs[0].token_ids
