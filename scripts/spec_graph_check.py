"""Speculative decoding on CUDA with every graph on (decode and verification graphs, greedy
step-end graphs, the n-gram and draft proposers' graphs): outputs must equal the plain engine's,
token for token, for greedy and seeded requests, async on and off, and a batch mixing both (whose
steps verify through the sampler instead of the greedy tail); requests run one at a time
(their prefills replay the prompt-chunk graphs) equal to an eager engine's; and load around the
adaptive cap, where the proposer's state is dropped (plain decode graphs and greedy tail, no
draft mirror) and rebuilt mid-request (the n-gram histories from the step's tokens, the draft's
KV by a catch-up prefill). Each engine runs in its own core
process and is shut down before the next starts (one GPU, one pool at a time).

    python scripts/spec_graph_check.py [--output-json PATH] [--kv-cache-dtype fp8] [--quick]

--kv-cache-dtype: every engine's cache (fp8: the Triton kernels over fp8 blocks). --quick: greedy
only (n-gram async, self-draft sync, and one at a time with n-gram against an eager engine).

Exits 1 on any difference.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.engine.test_speculative import repetitive_prompts  # noqa: E402
from tests.helpers.tiny_models import make_tiny_model_dir  # noqa: E402
from tokenmill import LLM, SamplingParams  # noqa: E402


KV_CACHE = {}  # --kv-cache-dtype, for every engine


def run(path: str, prompts, params, one_at_a_time: bool = False, before=None, **engine) -> tuple[list[list[int]], dict]:
    """`before`: (prompts, params) generated first on the same engine (not returned)."""
    with LLM(path, dtype="float32", gpu_memory_utilization=0.2, max_model_len=256, **KV_CACHE, **engine) as llm:
        if before is not None:
            llm.generate(*before, use_tqdm=False)
        if one_at_a_time:  # batch-1 prefills: the prompt-chunk graphs
            outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
        else:
            outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.scheduler_stats()
    return [list(o.outputs[0].token_ids) for o in outs], stats


def check(results: dict, key: str, got, want, stats, must_draft: bool, all_accepted: bool) -> bool:
    # A self-draft accepts every draft when its logits are the target's: not with an fp8 target cache
    # (the draft's proposals come from its own decode steps, the target's from fp8-rounded context).
    all_accepted = all_accepted and not KV_CACHE
    same = sum(a == b for a, b in zip(got, want))
    drafted, accepted = stats.get("spec_num_draft_tokens", 0), stats.get("spec_num_accepted_tokens", 0)
    ok = same == len(want) and (drafted > 0 or not must_draft) and (accepted == drafted or not all_accepted)
    results[key] = {"identical": same, "of": len(want), "draft_tokens": drafted, "accepted": accepted, "ok": ok}
    print(f"{key:28s} identical {same}/{len(want)}  drafts {drafted:5d}  accepted {accepted:5d}  "
          f"{'ok' if ok else 'FAIL'}", flush=True)
    return ok


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--output-json")
    ap.add_argument("--kv-cache-dtype", default=None, help="auto | fp8 | fp8_e4m3 | fp8_e5m2")
    ap.add_argument("--quick", action="store_true", help="greedy only: five engines")
    args = ap.parse_args()
    if args.kv_cache_dtype:
        KV_CACHE["kv_cache_dtype"] = args.kv_cache_dtype
    path = make_tiny_model_dir("llama", tempfile.mkdtemp())
    prompts = repetitive_prompts(12, seed=11)
    greedy = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    seeded = [SamplingParams(temperature=0.8, top_k=40, seed=5 + i, max_tokens=48, ignore_eos=True)
              for i in range(len(prompts))]
    mixed = [greedy if i % 2 else seeded[i] for i in range(len(prompts))]
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "max_step_tokens": 0}
    self_draft = {"method": "draft_model", "model": path, "num_speculative_tokens": 4, "max_step_tokens": 0}
    results, failed = {}, False
    runs = {"greedy": [(n, a) for n in ("ngram", "self_draft") for a in (True, False)],
            "seeded": [("ngram", True), ("self_draft", True)], "mixed": [("ngram", True), ("self_draft", False)]}
    if args.quick:
        runs = {"greedy": [("ngram", True), ("self_draft", False)]}
    for sampling, params in (("greedy", greedy), ("seeded", seeded), ("mixed", mixed))[:1 if args.quick else 3]:
        want, _ = run(path, prompts, params, async_scheduling=False)
        for name, async_scheduling in runs[sampling]:
            spec = ngram if name == "ngram" else self_draft
            got, stats = run(path, prompts, params, speculative_config=spec, async_scheduling=async_scheduling)
            key = f"{sampling}_{name}_{'async' if async_scheduling else 'sync'}"
            failed |= not check(results, key, got, want, stats, True, name == "self_draft")
    # One request at a time: prefills replay the prompt-chunk graphs; the reference runs eagerly.
    want, _ = run(path, prompts, greedy, one_at_a_time=True, enforce_eager=True)
    for name, spec in (("plain", None), ("ngram", ngram), ("self_draft", self_draft))[1 if args.quick else 0:
                                                                                    2 if args.quick else 3]:
        got, stats = run(path, prompts, greedy, one_at_a_time=True, speculative_config=spec)
        failed |= not check(results, f"one_at_a_time_{name}", got, want, stats, spec is not None, name == "self_draft")
    # Two rows (the state is held), then twelve of unequal lengths under a cap of 16 tokens (60
    # with padding: dropped), proposing again once three are left (15: rebuilt mid-request).
    if args.quick:
        _finish(results, failed, args)
    shrinking = [SamplingParams(temperature=0.0, max_tokens=16 + 4 * i, ignore_eos=True) for i in range(len(prompts))]
    first = (repetitive_prompts(2, seed=12), greedy)
    want, _ = run(path, prompts, shrinking, async_scheduling=False)
    for name, spec in (("ngram", ngram), ("self_draft", self_draft)):
        for async_scheduling in (True, False):
            got, stats = run(path, prompts, shrinking, before=first, async_scheduling=async_scheduling,
                             speculative_config={**spec, "max_step_tokens": 16})
            key = f"dormant_{name}_{'async' if async_scheduling else 'sync'}"
            failed |= not check(results, key, got, want, stats, True, name == "self_draft")
    _finish(results, failed, args)


def _finish(results: dict, failed: bool, args) -> None:
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=2)
    print("all identical" if not failed else "DIFFERENCES", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
