"""What one request costs at batch 1 besides its decode steps (CUDA, SmolLM2 shape, random
weights): the time of a 1-token request (prefill, first sample, the trip in and out of the
engine) for a few prompt lengths, in-process and with the engine core in its own process, and a
cProfile of in-process 1-token requests (the top functions by own time).

    python scripts/request_overhead.py
"""

from __future__ import annotations

import cProfile
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts.device_check import config_dir  # noqa: E402
from tokenmill import LLM, SamplingParams  # noqa: E402


def timed_requests(llm: LLM, length: int, max_tokens: int, reps: int = 8) -> float:
    """Median ms of a one-prompt generate."""
    prompt = {"prompt_token_ids": [(7 * i) % 40000 + 100 for i in range(length)]}
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def main() -> None:
    path = config_dir("smollm2")
    for single_process in (False, True):  # the core process frees its memory at shutdown; in-process last
        with LLM(path, load_format="dummy", dtype="bfloat16", max_model_len=2048, single_process=single_process, gpu_memory_utilization=0.3,
                 enable_prefix_caching=False) as llm:
            for length in (32, 173, 512):
                one = timed_requests(llm, length, 1)
                eighty = timed_requests(llm, length, 81)
                print(f"single_process={single_process} prompt {length:4d}: 1-token request {one:6.2f} ms, "
                      f"81-token request {eighty:7.2f} ms ({(eighty - one) / 80:.3f} ms per further token)",
                      flush=True)
            if single_process:
                profile = cProfile.Profile()
                profile.enable()
                timed_requests(llm, 173, 1, reps=10)
                profile.disable()
                pstats.Stats(profile).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
