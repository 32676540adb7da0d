"""Python calls per decode step of tokenmill on CPU (batch 1), from cProfile: what the host does
besides the GEMMs. Runs in one process (`single_process=True`) with any tokenmill build (run it
with that build's python), so two builds can be compared call by call.

    python scripts/cpu_decode_calls.py --model /tmp/smollm2-hf --dtype float32 --out calls.json
    python scripts/cpu_decode_calls.py --compare a.json b.json   # per-step counts side by side

A step's counts are the difference between a run of `--steps` + 1 output tokens and a run of 1
(the prefill and the request's own overhead cancel), divided by `--steps`.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import random


def _name(func: tuple) -> str:
    path, line, name = func
    for root in ("/tokenmill/", "/site-packages/", "/torch/"):  # (two builds' venvs and checkouts alike)
        if root in path:
            path = root.strip("/") + "/" + path.split(root, 1)[1]
            break
    return f"{path}({name})"  # no line number: two builds' functions match by file and name


def profiled(llm, prompt: list[int], max_tokens: int) -> tuple[dict[str, int], dict[str, float], float]:
    from tokenmill import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prof = cProfile.Profile()
    prof.enable()
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    prof.disable()
    stats = pstats.Stats(prof).stats
    calls: dict[str, int] = {}
    own: dict[str, float] = {}
    for f, s in stats.items():  # (same-named functions of one file are summed)
        calls[_name(f)] = calls.get(_name(f), 0) + s[1]  # primitive + recursive calls
        own[_name(f)] = own.get(_name(f), 0.0) + s[2]
    return calls, own, sum(own.values())


def measure(ns) -> dict:
    from tokenmill import LLM
    llm = LLM(model=ns.model, dtype=ns.dtype, max_model_len=1024, seed=0, kv_cache_memory_gb=1.0,
              single_process=True)
    rng = random.Random(0)
    prompt = [rng.randrange(100, 49000) for _ in range(ns.input_len)]
    profiled(llm, prompt, ns.steps + 1)  # warm
    c1, o1, t1 = profiled(llm, prompt, 1)
    cn, on, tn = profiled(llm, prompt, ns.steps + 1)
    per_step = {k: (v - c1.get(k, 0)) / ns.steps for k, v in cn.items()}
    own = {k: (v - o1.get(k, 0.0)) / ns.steps for k, v in on.items()}
    return {"dtype": ns.dtype, "steps": ns.steps, "calls_per_step": {k: v for k, v in per_step.items() if v > 0},
            "own_s_per_step": {k: v for k, v in own.items() if per_step.get(k, 0) > 0},
            "total_calls_per_step": sum(v for v in per_step.values() if v > 0),
            "profiled_s_per_step": (tn - t1) / ns.steps}


def compare(a_path: str, b_path: str, top: int) -> None:
    a, b = (json.load(open(p)) for p in (a_path, b_path))
    ca, cb = a["calls_per_step"], b["calls_per_step"]
    print(f"calls per decode step: {a_path} {a['total_calls_per_step']:.0f}, {b_path} {b['total_calls_per_step']:.0f}")
    print(f"profiled s per step:   {a['profiled_s_per_step'] * 1e3:.2f} ms, {b['profiled_s_per_step'] * 1e3:.2f} ms")
    keys = sorted(set(ca) | set(cb), key=lambda k: -abs(ca.get(k, 0) - cb.get(k, 0)))
    print(f"{'A':>8} {'B':>8} {'B-A':>8}  function (largest differences first)")
    for k in keys[:top]:
        print(f"{ca.get(k, 0):8.1f} {cb.get(k, 0):8.1f} {cb.get(k, 0) - ca.get(k, 0):8.1f}  {k}")
    oa, ob = a["own_s_per_step"], b["own_s_per_step"]
    print(f"\n{'A us':>8} {'B us':>8}  own time per step (largest first)")
    for k in sorted(set(oa) | set(ob), key=lambda k: -max(oa.get(k, 0), ob.get(k, 0)))[:top // 2]:
        print(f"{oa.get(k, 0) * 1e6:8.0f} {ob.get(k, 0) * 1e6:8.0f}  {k}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--out")
    p.add_argument("--compare", nargs=2, metavar="JSON")
    p.add_argument("--top", type=int, default=40)
    ns = p.parse_args()
    if ns.compare:
        compare(*ns.compare, ns.top)
        return
    record = measure(ns)
    print(f"{record['total_calls_per_step']:.0f} Python calls per decode step, "
          f"{record['profiled_s_per_step'] * 1e3:.2f} ms per step under the profiler")
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
