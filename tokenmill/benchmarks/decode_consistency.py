"""Decode steps against prompt steps, in one engine: the part of a layout the teacher-forced
check (`layout_check`, prompt logprobs only) does not reach.

A layout's decode steps run their own code (CUDA graphs; at TP, the overlapped halves of
`model/tp_overlap.py` from their row count on, and the greedy step-end graph's argmax across the
ranks' vocab shards). In one engine, `probe`:
1. generates greedy continuations of `prompts` with each chosen token's logprob (the sampler's
   path: the logits gathered);
2. generates them again without logprobs (the greedy step-end graph: at TP its argmax over the
   vocab shards): the tokens must be the same, except where the requests reached the engine in
   other batches (the engine steps while they are submitted, so a step's rows can differ between
   the runs, and with them the roundings): sequences may part, as often as they part in the
   reference engine (doubled) or in a quarter of them; the report says how many parted at a near tie
   of the first run (top-2 logprobs within NEAR_TIE) (prefix caching off, else the second run's
   prompt steps would differ on purpose);
3. scores prompt + continuation as a prompt (prompt logprobs: the prompt path) and takes |delta|
   between each generated token's logprob from its decode step and from the prompt path.
The decode path passes when its mean |delta| is within `factor` of one process's (the check's
reference engine, a valid one-GPU layout), floored at FLOOR: a decode step that computes
something else than the prompt path (a half joined too early, the wrong half's rows) lands far off.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np

FLOOR = 2e-3  # |delta logprob| floor of the reference (a run whose two paths happen to agree exactly)
NEAR_TIE = 0.05  # top-2 logprob gap under which two valid runs may pick differently (bf16)


def random_prompts(vocab: int, count: int = 48, seed: int = 1) -> list[list[int]]:
    """`count` prompts of 8 to 24 random ids (enough rows that the decode steps run in halves where the
    layout's overlap starts at 32 rows)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(8, 25))] for _ in range(count)]


def probe(llm, prompts: Sequence[Sequence[int]], num_tokens: int) -> dict:
    from tokenmill import SamplingParams
    inputs = [{"prompt_token_ids": list(p)} for p in prompts]
    greedy = dict(temperature=0.0, max_tokens=num_tokens, ignore_eos=True, detokenize=False)
    with_lp = llm.generate(inputs, SamplingParams(logprobs=2, **greedy), use_tqdm=False)
    plain = llm.generate(inputs, SamplingParams(**greedy), use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in with_lp]
    same = near_ties = parted = 0
    for t, a, b in zip(tokens, with_lp, plain):
        other = list(b.outputs[0].token_ids)
        pos = next((i for i, (x, y) in enumerate(zip(t, other)) if x != y), None)
        if pos is None and len(t) == len(other):
            same += 1
            continue
        top = sorted((lp.logprob for lp in a.outputs[0].logprobs[pos or 0].values()), reverse=True)
        if pos is not None and len(top) > 1 and top[0] - top[1] < NEAR_TIE:
            near_ties += 1
        else:
            parted += 1
    scored = llm.generate([{"prompt_token_ids": list(p) + t} for p, t in zip(prompts, tokens)],
                          SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1, detokenize=False),
                          use_tqdm=False)
    deltas = []
    for p, t, gen, sc in zip(prompts, tokens, with_lp, scored):
        rows = sc.prompt_logprobs
        for i, (tok, lp) in enumerate(zip(t, gen.outputs[0].logprobs)):
            deltas.append(abs(lp[tok].logprob - rows[len(p) + i][tok].logprob))
    d = np.asarray(deltas, dtype=np.float64)
    return {"sequences": len(prompts), "tokens": int(d.size), "tail_tokens_equal": same,
            "tail_near_ties": near_ties, "tail_parted": parted,
            "mean": float(d.mean()), "p99": float(np.quantile(d, 0.99)), "max": float(d.max())}


def judge(result: dict, reference: dict, factor: float = 4.0) -> bool:
    """The greedy step-end graph's tokens equal the sampler's but where two valid runs of the
    reference engine also part (its own count, doubled, or a quarter of the sequences, whichever is
    more: in bf16 two batchings of one engine part beyond NEAR_TIE too), and the decode path's mean
    |delta| within `factor` of the reference engine's (floored). A wrong shard offset or a wrong half
    parts nearly every sequence."""
    parts, ref_parts = (r["tail_near_ties"] + r["tail_parted"] for r in (result, reference))
    return (parts <= max(2 * ref_parts, result["sequences"] // 4)
            and result["mean"] <= factor * max(reference["mean"], FLOOR))


def format_line(name: str, result: dict, reference: dict | None) -> str:
    verdict = "" if reference is None else ("ok" if judge(result, reference) else "FAIL")
    return (f"{name:<24} decode vs prompt |dlogprob| mean {result['mean']:.2e} p99 {result['p99']:.2e} "
            f"max {result['max']:.2e} over {result['tokens']} tokens; greedy tail = sampler on "
            f"{result['tail_tokens_equal']}/{result['sequences']} sequences ({result['tail_near_ties']} parted at "
            f"a near tie, {result['tail_parted']} not) {verdict}")
