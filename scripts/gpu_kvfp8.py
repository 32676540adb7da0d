"""The FP8 KV cache part of scripts/gpu_quant.py (`--parts kvfp8`): a bf16-KV and an fp8-KV engine
side by side in ONE process (Llama-3.1-8B shape, bf16 dummy weights, graphs on),
so that every ratio has its baseline measured in the same process, interleaved.

- Both engines are up at once, each with about 45% of the device's memory (the first takes
  gpu_memory_utilization 0.45; the second 0.9, which counts the first's memory as used), so the KV
  blocks ratio is that of equal pools; 1000x512x256 (256 rows at most) needs far less KV than
  either pool holds, so no run preempts.
- batch1_16k: one request of a 16k-token prompt and 1 + BATCH1_TOKENS output tokens per run;
  decode ms per token = (last token's time - first token's time) / (tokens - 1), read from the
  request's metrics, so the prefill (~0.6 s, whose run-to-run spread divided by 64 tokens was the
  old figure's noise) is not in it. Every run of an engine repeats one prompt with prefix caching
  on, so only its first run prefills (engine start and runs must fit the GPU script's budget). Rounds alternate the engines' order; the figure is each
  engine's median over the rounds (every round's value is in the record).
- After the timed runs, one more batch-1 request of each engine runs under a device-profile window
  (tokenmill/worker/device_profile.py, batch 1): its decode steps cut into kernel groups
  (tokenmill/benchmarks/step_profile.py), printed side by side with the attention kernels apart
  (the paged attention launch, the split reduce, the fused rotary + KV write).
- 1000x512x256: output tok/s of each engine, one after the other (KVFP8_ORDER=fp8-first swaps them).
  Without it (--workloads batch1_16k) the engines take max_num_seqs 1: one decode graph to capture.
- attention (first, before the engines take the device's memory): the decode attention kernels alone,
  bf16 against fp8 KV, at 256 x 640, 1000 x 640, 1 x 16384 and 256 rows of 5 tokens over 640 keys
  (multi-token decode tiles, as speculative verification launches them) (scripts/gpu_attention.py in a child
  process: every launch checked against the float32 reference, the defaults beside the previous
  defaults and a few opt-in fp8 launches (--vt-variants), microseconds per layer and the fraction of
  the byte bound, its JSON in $OUT).
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import time

BATCH1_TOKENS = int(os.environ.get("KVFP8_TOKENS", "64"))  # decode steps per timed batch-1 run
ROUNDS = int(os.environ.get("KVFP8_ROUNDS", "3"))  # timed batch-1 runs per engine
PROFILE_STEPS = 16  # decode steps in the device-profile window (the request after the timed ones)
PROFILE = os.environ.get("KVFP8_PROFILE", "1") != "0"  # 0: no profiled batch-1 request (a shorter run)
LABELS = ("bf16kv", "fp8kv")  # the baseline first
ENGINE_KWARGS = {"bf16kv": {"gpu_memory_utilization": 0.45}, "fp8kv": {"kv_cache_dtype": "fp8", "gpu_memory_utilization": 0.9}}
# Kernels shown apart from their step_profile group (a name fragment -> a row of the table).
KERNELS = {"paged attention": "_paged_attention_kernel", "split reduce": "_reduce_splits_kernel",
           "rotary + KV write": "rope_kv_write"}


ATTENTION_SHAPES = "256x640,1000x640,1x16384,256x640q5"  # q5: 5-token rows (speculative verification)
ATTENTION_BUDGET_S = float(os.environ.get("KVFP8_ATTENTION_BUDGET", "30"))  # gpu_attention.py's --budget
ATTENTION_KV = os.environ.get("KVFP8_ATTENTION_KV", "bf16,fp8")  # fp8_e5m2 too: the other format (+3 cases)


def attention_microbench(results: dict, smoke: bool, out: str) -> str | None:
    """scripts/gpu_attention.py (default launches, no sweep) in a child process; its table printed as it
    runs, its records under results["timings"]["kvfp8_attention"]. Returns what failed (a check, a
    crash, its time limit), which fails the part after the engines have run, or None."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_attention.py")
    args = ([sys.executable, script, "--no-sweep", "--no-before", "--vt-variants", "--kv", ATTENTION_KV]
            + (["--smoke", "--shapes", "3x40,1x150,3x40q5"] if smoke else
               ["--shapes", ATTENTION_SHAPES, "--precompile-shards", "8"])
            + ["--budget", str(ATTENTION_BUDGET_S)])
    env = dict(os.environ, OUT=os.path.join(out, "attention"))
    start = time.perf_counter()
    try:
        rc = subprocess.run(args, env=env, timeout=ATTENTION_BUDGET_S + 20 if not smoke else 900).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    rec = results.setdefault("timings", {}).setdefault("kvfp8_attention", {})
    rec["seconds"] = time.perf_counter() - start
    path = os.path.join(out, "attention", "gpu_attention.json")
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
        rec.update(device=data["device"], read_gbps=data["read_gbps"], copy_gbps=data["copy_gbps"], cases={
            f"{r['case']} {r['kv']}": {k: r.get(k) for k in ("us", "bound_us", "previous_us", "attend_us", "write_us",
                                                            "ok", "err", "plan", "best", "best_us",
                                                            "variant_failures")}
            for r in data["records"] if "case" in r and "error" not in r})
    return None if rc == 0 else f"gpu_attention.py: rc={rc} (a failed check, a crash or its time limit)"


def _prompt(length: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 259) for _ in range(length)]}]


def decode_ms(llm, length: int, tokens: int, seed: int) -> dict:
    """One batch-1 request: its decode ms per token from the token timestamps, and the wall time."""
    from tokenmill import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=1 + tokens, ignore_eos=True, detokenize=False)
    start = time.perf_counter()
    out = llm.generate(_prompt(length, seed), params, use_tqdm=False)[0]
    wall = time.perf_counter() - start
    n, m = len(out.outputs[0].token_ids), out.metrics
    if n < 2 or "first_token_time" not in m:
        raise RuntimeError(f"batch-1 run gave {n} tokens, metrics {sorted(m)}")
    return {"ms_per_token": 1e3 * (m["last_token_time"] - m["first_token_time"]) / (n - 1), "wall_s": wall,
            "ttft_s": m["first_token_time"] - m.get("arrival_time", m["first_token_time"])}


def _kernel_rows(analysis: dict) -> dict:
    rows = {}
    for row, fragment in KERNELS.items():
        rows[row] = sum(k["us_per_step"] for k in analysis.get("kernels", []) if fragment in k["name"])
    return rows


def profile_table(prof: dict) -> list[str]:
    """Per kernel group (and the attention kernels apart), us per batch-1 decode step, side by side."""
    if not all(label in prof for label in LABELS):
        return []
    a, b = (prof[label] for label in LABELS)
    groups = sorted(set(a["groups_us"]) | set(b["groups_us"]), key=lambda g: -a["groups_us"].get(g, 0.0))
    lines = ["| per decode step, us | bf16 KV | fp8 KV | fp8 - bf16 |", "|---|---|---|---|"]
    for name, x, y in ([("device period", a["period_us"], b["period_us"]), ("kernels", a["kernel_us"], b["kernel_us"])]
                       + [(g, a["groups_us"].get(g, 0.0), b["groups_us"].get(g, 0.0)) for g in groups]
                       + [(f"  {r}", _kernel_rows(a)[r], _kernel_rows(b)[r]) for r in KERNELS]
                       + [("launch gaps", a["launch_gaps_us"], b["launch_gaps_us"]),
                          ("host gaps in the step", a["host_gaps_us"], b["host_gaps_us"]),
                          ("between steps", a["between_steps_us"], b["between_steps_us"])]):
        lines.append(f"| {name} | {x:,.1f} | {y:,.1f} | {y - x:+,.1f} |")
    return lines


def _save(results: dict, out: str) -> None:
    """What is measured so far, to $OUT/kvfp8_side_by_side.json (a run cut short keeps it)."""
    os.makedirs(out, exist_ok=True)
    keep = {k: results[k] for k in ("timings", "kvprofile") if k in results}  # (timings: kvfp8_attention too)
    with open(os.path.join(out, "kvfp8_side_by_side.json"), "w") as f:
        json.dump(keep, f, indent=1, default=str)


def side_by_side(results: dict, smoke: bool, path: str, long_ctx: int, workloads: list[str], out: str,
                 throughput, scale) -> None:
    """`throughput(llm, num, input_len, output_len)` -> output tok/s (gpu_quant's); `scale` shrinks
    the 1000x512x256 shape in a smoke run."""
    from tokenmill import LLM
    from tokenmill.benchmarks import step_profile
    from tokenmill.worker.device_profile import ENV_VAR

    tokens = 4 if smoke else BATCH1_TOKENS
    rounds = 1 if smoke else ROUNDS
    # The window opens on the profiled request, after the timed runs' decode steps (not slowed by it).
    # A run's one-token steps: its decode steps, and the first step too when the prompt is cached but for
    # its last token (a one-row, one-token step); the window opens 8 steps into the profiled request.
    window = {"skip": rounds * (tokens + 1) + 8, "steps": 3 if smoke else PROFILE_STEPS}
    extra = dict(device="cpu", enforce_eager=True, kv_cache_memory_gb=0.05) if smoke else {}
    timings = results.setdefault("timings", {})
    t0_part = time.perf_counter()
    engines, failed = {}, []
    if "attention" in workloads:
        failed += [e for e in [attention_microbench(results, smoke, out)] if e]
        _save(results, out)
        print(f"  [attention kernels: {time.perf_counter() - t0_part:.0f} s]", flush=True)
    if not {"batch1_16k", "1000x512x256"} & set(workloads):
        if failed:
            raise RuntimeError("; ".join(failed))
        return
    recs = {label: timings.setdefault("kvfp8" if label == "fp8kv" else "kvfp8_bf16kv", {}) for label in LABELS}
    try:
        for label in LABELS:
            folder = os.path.join(out, f"kvprofile_{label}")
            if "batch1_16k" in workloads and PROFILE:
                os.environ[ENV_VAR] = json.dumps({"out_dir": folder, "batch": 1, **window})
            kwargs = dict(ENGINE_KWARGS[label])
            if "1000x512x256" not in workloads:  # batch 1 only: one decode graph (batch 1) to capture
                kwargs["max_num_seqs"] = 1
            if smoke:
                kwargs.pop("gpu_memory_utilization")
            start = time.perf_counter()
            try:
                # Prefix caching on: every batch-1 run of an engine repeats one prompt, so only the first
                # prefills it (the figure is decode time, whatever filled the cache).
                engines[label] = LLM(path, load_format="dummy", dtype="bfloat16", max_model_len=long_ctx + 256 + 16,
                                     disable_log_stats=True, enable_prefix_caching=True, **kwargs, **extra)
            except Exception as e:  # noqa: BLE001 - the other engine's figures still come out
                failed.append(f"{label} engine: {type(e).__name__}: {str(e)[:300]}")
                print(f"  {label}: engine failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            finally:
                os.environ.pop(ENV_VAR, None)
            recs[label]["engine_up_s"] = time.perf_counter() - start
            # Not "kv_blocks": the two pools of this process differ in size (the second engine's budget
            # counts the first's memory), so their block counts are no 2x figure; blocks per GiB are.
            blocks = engines[label].kv_cache_stats()["num_blocks"]
            arch = engines[label].config.model.arch
            per_block = (2 * arch.num_layers * engines[label].config.cache.block_size * arch.num_kv_heads * arch.head_dim
                         * (1 if label == "fp8kv" else 2))
            recs[label]["kv_blocks_this_pool"] = blocks
            recs[label]["kv_pool_gib"] = blocks * per_block / 2**30
            recs[label]["kv_blocks_per_gib"] = 2**30 / per_block
            print(f"  {label}: engine up in {recs[label]['engine_up_s']:.0f} s; {blocks} KV blocks "
                  f"({recs[label]['kv_pool_gib']:.1f} GiB pool, {recs[label]['kv_blocks_per_gib']:.0f} blocks a GiB)",
                  flush=True)
        _save(results, out)
        print(f"  [engines up: {time.perf_counter() - t0_part:.0f} s into the part]", flush=True)
        if "batch1_16k" in workloads:
            _batch1(engines, recs, results, long_ctx, tokens, rounds, window, out, step_profile)
            _save(results, out)
            print(f"  [batch 1: {time.perf_counter() - t0_part:.0f} s into the part]", flush=True)
        if "1000x512x256" in workloads:
            order = LABELS if os.environ.get("KVFP8_ORDER", "") != "fp8-first" else LABELS[::-1]
            for label in (lb for lb in order if lb in engines):
                t0 = time.perf_counter()
                recs[label]["1000x512x256"] = throughput(engines[label], scale(1000), scale(512), scale(256))
                print(f"  {label} 1000x512x256: {recs[label]['1000x512x256']:,.0f} output tok/s "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
                _save(results, out)
            if len(engines) == 2:
                r = recs["fp8kv"]["1000x512x256"] / recs["bf16kv"]["1000x512x256"]
                print(f"  1000x512x256 fp8 KV / bf16 KV: {r:.3f}", flush=True)
    finally:
        for llm in engines.values():
            llm.shutdown()
    if failed:
        raise RuntimeError("; ".join(failed))


def _batch1(engines, recs, results, long_ctx, tokens, rounds, window, out, step_profile) -> None:
    runs = {label: [] for label in engines}
    for r in range(rounds):
        for label in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
            runs[label].append(decode_ms(engines[label], long_ctx, tokens, seed=7))
        print(f"  round {r + 1}: " + ", ".join(f"{lb} {runs[lb][-1]['ms_per_token']:.3f} ms/token" for lb in engines),
              flush=True)
    for label in engines:
        values = [x["ms_per_token"] for x in runs[label]]
        recs[label]["batch1_16k"] = statistics.median(values)
        recs[label]["batch1_16k_runs"] = runs[label]
    if len(engines) == 2:
        r = recs["fp8kv"]["batch1_16k"] / recs["bf16kv"]["batch1_16k"]
        print(f"  batch 1 x {long_ctx}: bf16 KV {recs['bf16kv']['batch1_16k']:.3f}, fp8 KV "
              f"{recs['fp8kv']['batch1_16k']:.3f} ms/token (medians of {rounds}): fp8 / bf16 {r:.3f}", flush=True)
    _save(results, out)
    if not PROFILE:
        return
    # The profiled request (its steps are slowed by the window: not timed).
    prof = results.setdefault("kvprofile", {})
    for label, llm in engines.items():
        decode_ms(llm, long_ctx, window["steps"] + 24, seed=7)
        path = os.path.join(out, f"kvprofile_{label}", "rank0.json")
        if not os.path.exists(path):
            print(f"  {label}: no profile window written ({path})", flush=True)
            continue
        with open(path) as f:
            a = step_profile.analyze(json.load(f))
        prof[label] = a
        print(step_profile.format_report(f"{label} batch-1 decode at {long_ctx} tokens", a, top=12), flush=True)
        _save(results, out)
    for line in profile_table(prof):
        print("  " + line, flush=True)
