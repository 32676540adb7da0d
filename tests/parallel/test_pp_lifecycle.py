"""Pipeline parallelism in the engine loop (PP=2, real stage processes, the core in this process):
several micro-batches in flight, further prefill chunks of a prompt while its earlier chunk is in
flight, and aborts and preemptions of requests in flight leave no request, block, sampled token,
step or worker state behind, while every other request still gets one process's tokens."""

from __future__ import annotations

import numpy as np
import pytest

from tests.parallel.core_driver import assert_nothing_left, engine_config, mp_engine_core, run_to_end
from tokenmill.core.engine_core import EngineCore
from tokenmill.protocol import FinishReason
from tokenmill.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
ENGINE = dict(max_num_batched_tokens=48, block_size=4)


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    lengths = [5, 90, 12, 30, 7, 60]  # 90 and 60: several chunks at 48 tokens per step
    return [rng.integers(3, 259, n).tolist() for n in lengths]


@pytest.fixture(scope="module")
def reference(tiny_model) -> dict[int, list[int]]:
    core = EngineCore(engine_config(tiny_model, kv_cache_memory_gb=0.01, **ENGINE))
    try:
        tokens, _ = run_to_end(core, _prompts(), GREEDY)
    finally:
        core.shutdown()
    return tokens


def _in_flight_handles(core: EngineCore) -> list[set[int]]:
    return [set(batch.scheduled_handles) for batch, *_ in core.in_flight]


def test_aborts_in_flight(tiny_model, reference) -> None:
    config = engine_config(tiny_model, pipeline_parallel_size=2, kv_cache_memory_gb=0.01, **ENGINE)
    seen = {"max_in_flight": 0, "chunk_overlap": False}
    aborted: set[int] = set()

    def after_step(core: EngineCore, steps: int) -> None:
        batches = _in_flight_handles(core)
        seen["max_in_flight"] = max(seen["max_in_flight"], len(batches))
        if len(batches) >= 2 and batches[0] & batches[1]:  # a prompt's next chunk while one is in flight
            seen["chunk_overlap"] = True
        if steps == 4:  # abort two requests that are in flight right now
            in_flight = sorted(set().union(*batches) - set(core.scheduler.finished_to_send))
            aborted.update(in_flight[:2])
            core.abort_requests(sorted(aborted))

    with mp_engine_core(config) as core:
        assert core.max_in_flight == 3  # two stages, plus one with async scheduling
        tokens, finished = run_to_end(core, _prompts(), GREEDY, after_step)
        assert len(aborted) == 2, "nothing was in flight to abort"
        assert seen["max_in_flight"] >= 2 and seen["chunk_overlap"], seen
        for handle, ref in reference.items():
            if handle in aborted:
                assert handle not in finished and tokens[handle] == ref[:len(tokens[handle])]
            else:
                assert finished[handle] == FinishReason.LENGTH and tokens[handle] == ref, handle
        assert_nothing_left(core)


def test_preemptions_in_flight(tiny_model, reference) -> None:
    # 40 blocks of 4 tokens hold the longest request (110 tokens) but not all of them at once.
    config = engine_config(tiny_model, pipeline_parallel_size=2, num_gpu_blocks_override=40, max_model_len=128,
                           async_scheduling=False, **ENGINE)
    with mp_engine_core(config) as core:
        assert core.max_in_flight == 2
        tokens, finished = run_to_end(core, _prompts(), GREEDY)
        assert core.scheduler.num_preemptions > 0, "the pool was large enough: nothing was preempted"
        assert tokens == reference
        assert all(reason == FinishReason.LENGTH for reason in finished.values()) and len(finished) == 6
        assert_nothing_left(core)
