"""Where a speculative step's time goes on CUDA: cProfile of `LLM.generate` at batch 1, single
process, plain vs n-gram vs target-as-draft, on a SmolLM2-shaped model (random weights)."""

from __future__ import annotations

import cProfile
import io
import pstats
import subprocess
import sys
import time

sys.path.insert(0, ".")
from scripts.device_check import config_dir  # noqa: E402
from tokenmill import LLM, SamplingParams  # noqa: E402


def main() -> None:
    path = config_dir(sys.argv[1] if len(sys.argv) > 1 else "smollm2")
    phrase = list(range(100, 140))
    prompt = {"prompt_token_ids": phrase * 8}
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    variants = {"plain": None, "ngram": {"method": "ngram", "num_speculative_tokens": 4},
                "self_draft": {"method": "draft_model", "model": path, "num_speculative_tokens": 4,
                               "max_step_tokens": 0}}
    only = sys.argv[2] if len(sys.argv) > 2 else None
    if only is None:  # one process per variant (a closed engine's GPU memory is not all given back)
        for name in variants:
            subprocess.run([sys.executable, __file__, sys.argv[1] if len(sys.argv) > 1 else "smollm2", name])
        return
    for name, spec in variants.items():
        if name != only:
            continue
        llm = LLM(path, load_format="dummy", dtype="bfloat16", single_process=True, max_model_len=1024,
                  speculative_config=spec)
        for _ in range(2):
            llm.generate([prompt], params, use_tqdm=False)
        prof = cProfile.Profile()
        start = time.perf_counter()
        prof.enable()
        out = llm.generate([prompt], params, use_tqdm=False)
        prof.disable()
        elapsed = time.perf_counter() - start
        stats = llm.scheduler_stats()
        print(f"==== {name}: {len(out[0].outputs[0].token_ids) / elapsed:.1f} tok/s, drafts "
              f"{stats.get('spec_num_draft_tokens')}, accepted {stats.get('spec_num_accepted_tokens')}")
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(22)
        print("\n".join(s.getvalue().splitlines()[6:34]))
        llm.shutdown()


if __name__ == "__main__":
    main()
