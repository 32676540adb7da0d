"""Logprobs across preemption: a request whose KV blocks are taken back and recomputed later gets
prompt logprobs exactly once per prompt position (the recomputation emits none again), and its
prompt and sampled-token logprobs equal, position for position, those of a run never preempted.
Chunked prefill and async scheduling on and off."""

from __future__ import annotations

import random

import pytest

from tests.engine.conftest import assert_engine_idle, tiny_llm
from tokenmill import SamplingParams

TOL = 1e-4
TOP = 2
# Short prompts that grow long: three fit the small pool at admission, then their growth preempts.
PROMPTS = [{"prompt_token_ids": [random.Random(seed).randrange(3, 259) for _ in range(n)]}
           for seed, n in enumerate((30, 37, 45, 28))]
PARAMS = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=TOP, prompt_logprobs=TOP)
SMALL_POOL = dict(block_size=4, num_gpu_blocks_override=26, max_model_len=96)


def _run(path: str, chunked: bool, async_scheduling: bool, small_pool: bool):
    kwargs = dict(SMALL_POOL) if small_pool else dict(block_size=4, max_model_len=96)
    llm = tiny_llm(path, async_scheduling=async_scheduling, max_num_batched_tokens=8 if chunked else 96, **kwargs)
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    preemptions = llm.engine.scheduler.num_preemptions
    assert_engine_idle(llm)
    return outs, preemptions


def _same_row(got: dict, want: dict, where: str) -> None:
    assert set(got) == set(want), f"{where}: token ids {sorted(got)} != {sorted(want)}"
    for token, lp in want.items():
        assert got[token].rank == lp.rank, f"{where}: rank of {token}"
        assert abs(got[token].logprob - lp.logprob) < TOL, f"{where}: logprob of {token}"


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """Room for all, no chunks, async off: nothing is preempted."""
    outs, preemptions = _run(tiny_model_dir, chunked=False, async_scheduling=False, small_pool=False)
    assert preemptions == 0
    return outs


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
def test_logprobs_same_with_preemption(tiny_model_dir, reference, chunked, async_scheduling):
    outs, preemptions = _run(tiny_model_dir, chunked, async_scheduling, small_pool=True)
    assert preemptions > 0, "the small pool forced no preemption"
    for prompt, out, ref in zip(PROMPTS, outs, reference):
        ids = prompt["prompt_token_ids"]
        # Exactly one entry per prompt position; position 0 has none (nothing precedes it).
        assert len(out.prompt_logprobs) == len(ids), (
            f"{len(out.prompt_logprobs)} prompt-logprob entries for a {len(ids)}-token prompt")
        assert out.prompt_logprobs[0] is None
        for i in range(1, len(ids)):
            assert ids[i] in out.prompt_logprobs[i], f"prompt position {i} lacks its own token"
            _same_row(out.prompt_logprobs[i], ref.prompt_logprobs[i], f"prompt position {i}")
        sample, ref_sample = out.outputs[0], ref.outputs[0]
        assert sample.token_ids == ref_sample.token_ids
        assert len(sample.logprobs) == len(sample.token_ids) == PARAMS.max_tokens
        for i, (row, ref_row) in enumerate(zip(sample.logprobs, ref_sample.logprobs)):
            _same_row(row, ref_row, f"sampled token {i}")
