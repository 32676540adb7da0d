"""Seeded random workloads for the scheduler tests: (scheduler config, [(prompt, params, eos ids)])."""

from __future__ import annotations

import random

from tests.core.fake_worker import EOS, expected_output
from tokenmill.sampling_params import SamplingParams

Workload = tuple[dict, list[tuple[list[int], SamplingParams, tuple[int, ...]]]]


def random_params(rng: random.Random, prompt: list[int]) -> SamplingParams:
    max_tokens = rng.randrange(1, 48)
    stop = None
    if rng.random() < 0.2:  # a token this request will really produce, or not
        stop = [rng.choice(expected_output(prompt, max_tokens) + [999])]
    return SamplingParams(max_tokens=max_tokens, stop_token_ids=stop, ignore_eos=rng.random() < 0.2,
                          min_tokens=rng.choice([0, 0, 0, 2, 5]),
                          logprobs=rng.choice([None] * 8 + [0, 2]),
                          prompt_logprobs=rng.choice([None] * 8 + [0, 1]))


def mixed_workload(seed: int) -> Workload:
    """Preemptions (small pools), chunked prefills (small budgets), shared prefixes (a small
    alphabet), stop tokens, min_tokens, logprobs, a few requests with other EOS ids."""
    rng = random.Random(seed)
    num_blocks, block_size = rng.randrange(24, 120), rng.choice([1, 2, 4, 16])
    config = dict(num_blocks=num_blocks, block_size=block_size, budget=rng.randrange(1, 128),
                  max_seqs=rng.randrange(1, 12), caching=rng.random() < 0.8, async_scheduling=rng.random() < 0.5)
    requests = []
    for _ in range(rng.randrange(1, 30)):
        prompt = [rng.randrange(10, 30) for _ in range(rng.randrange(1, 48))]
        params = random_params(rng, prompt)
        if -(-(len(prompt) + params.max_tokens) // block_size) > num_blocks:
            continue
        eos = (EOS,) if rng.random() < 0.9 else (EOS, 17)  # other EOS ids: the row-by-row stop check
        requests.append((prompt, params, eos))
    return config, requests


def contention_workload(seed: int) -> Workload:
    """Prefix-cache contention in tiny pools: prompts that are another request's prompt plus
    part of its output, so decoding rows fill blocks whose twins sit free-but-cached at the
    head of the free queue while other rows allocate."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4])
    config = dict(num_blocks=rng.randrange(4, 16), block_size=block_size, budget=rng.randrange(1, 10),
                  max_seqs=rng.randrange(2, 5), caching=True, async_scheduling=rng.random() < 0.5)
    bases = [[rng.randrange(10, 14) for _ in range(rng.randrange(1, 5))] for _ in range(2)]
    requests = []
    for _ in range(rng.randrange(3, 12)):
        base, kind = rng.choice(bases), rng.random()
        if kind < 0.4:
            prompt = list(base)
        elif kind < 0.8:
            output = expected_output(base, 12)
            prompt = base + output[:rng.randrange(0, len(output) + 1)]
        else:
            prompt = [rng.randrange(20, 30) for _ in range(rng.randrange(1, 6))]
        params = SamplingParams(max_tokens=rng.randrange(1, 10), ignore_eos=True)
        if -(-(len(prompt) + params.max_tokens) // block_size) <= config["num_blocks"]:
            requests.append((prompt, params, (EOS,)))
    return config, requests
