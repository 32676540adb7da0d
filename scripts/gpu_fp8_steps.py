"""Where an engine's 256x256x128 time goes, step by step: bf16 against fp8 weights + fp8 KV (issue 22).

    timeout 140 python scripts/gpu_fp8_steps.py [--engines fp8kv,bf16] [--quick] [--smoke]

Each engine in its own child process (`--child LABEL`), single-process (the engine core and the
worker in the child, so that the core's step clock can be read), dummy weights of the Llama-3.1-8B
shape (gpu_quant.py's LLAMA8B), graphs on, the arguments of gpu_fp8_engines.py's engines:
1. a warm-up (16 prompts), then the workload once under two torch.profiler windows
   (tokenmill/worker/device_profile.py): three steps of >= PREFILL_MIN_TOKENS tokens (the prefill
   chunks, decode rows mixed in) and a window of full 256-row decode steps (graph replays);
   each cut into kernel groups, launch gaps and host gaps (tokenmill/benchmarks/step_profile.py);
2. the workload RUNS more times, unprofiled, with every step's busy time (the core's clock between
   two updates, `Scheduler.observe_step`: with async scheduling, the step's period) and its rows
   and tokens recorded: time in steps carrying prompt tokens against pure decode steps, mean period
   per 256-row decode step;
3. 256x256x1 (prefill alone) once.
The parent prints both engines side by side and writes $OUT/gpu_fp8_steps.json (the children:
$OUT/fp8steps-<label>.json; profiles under $OUT/prof-<label>-{prefill,decode}/).
--quick: no profiled run (no windows) and no prefill-only run: three timed runs.
GPU_FP8_STEPS_ENV_<label>="NAME=VALUE ..." sets environment for that child (A/B of a switch; values without
spaces, e.g. compact JSON), the label's ":" as "_"; labels `<base>:<tag>` run engine <base> with that child's
environment. Session 12's main-table A/B (docs/results/gpu-fp8kv-s12.md):
    GPU_FP8_STEPS_ENV_fp8kv_main='TOKENMILL_FP8_TMA_STORE=0 TOKENMILL_W8A8_TABLE={"256,4096,4096":[128,64,128,8,4,4,1],\
"256,4096,14336":[128,64,128,8,4,4,2]}' python scripts/gpu_fp8_steps.py --quick --engines fp8kv:main,fp8kv,bf16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

OUT = os.environ.get("OUT", "./gpu-out")
ENGINES = {"bf16": {}, "fp8": {"quantization": "fp8"}, "fp8kv": {"quantization": "fp8", "kv_cache_dtype": "fp8"}}
PREFILL_MIN_TOKENS = 8000
RUNS = 2


def _split(log: list[tuple], elapsed: float) -> dict:
    """One run's steps (step id, rows, tokens, seconds) -> time in prompt-carrying steps and decode steps."""
    pre = [s for s in log if s[2] > s[1]]
    dec = [s for s in log if s[2] == s[1]]
    full = [s[3] for s in dec if s[1] == max((d[1] for d in dec), default=0)]
    return {"elapsed_s": elapsed, "steps": len(log), "stepped_s": sum(s[3] for s in log),
            "prefill_steps": len(pre), "prefill_s": sum(s[3] for s in pre),
            "prefill_ms_each": [round(1e3 * s[3], 2) for s in pre], "prefill_tokens": [s[2] for s in pre],
            "decode_steps": len(dec), "decode_s": sum(s[3] for s in dec),
            "full_rows": max((d[1] for d in dec), default=0), "full_decode_steps": len(full),
            "full_decode_ms_median": 1e3 * statistics.median(full) if full else None,
            "full_decode_ms_mean": 1e3 * statistics.mean(full) if full else None}


def child(label: str, smoke: bool, quick: bool = False) -> None:
    import random

    import torch
    from gpu_quant import LLAMA8B, SMOKE, config_dir

    from tokenmill import LLM, SamplingParams
    from tokenmill.benchmarks import step_profile
    from tokenmill.core.scheduler import Scheduler
    from tokenmill.worker.device_profile import ENV_VAR

    base = label.split(":")[0]
    num, inp, outp = (8, 24, 8) if smoke else (256, 256, 128)
    rec: dict = {"label": label, "env": os.environ.get(f"GPU_FP8_STEPS_ENV_{label.replace(':', '_')}", "")}
    folder = {w: os.path.join(OUT, f"prof-{label.replace(':', '_')}-{w}") for w in ("prefill", "decode")}
    windows = [{"out_dir": folder["prefill"], "min_tokens": 32 if smoke else PREFILL_MIN_TOKENS, "skip": 1, "steps": 4},
               {"out_dir": folder["decode"], "batch": num, "skip": 2 if smoke else 30, "steps": 3 if smoke else 12}]
    if not quick:
        os.environ[ENV_VAR] = json.dumps(windows)
    log: list[tuple] = []
    observe = Scheduler.observe_step

    def hook(self, so, seconds):
        log.append((so.step_id, len(so.row_slots), int(so.total_num_scheduled_tokens), seconds))
        return observe(self, so, seconds)
    Scheduler.observe_step = hook
    extra = {"device": "cpu", "enforce_eager": True, "kv_cache_memory_gb": 0.05, "max_num_batched_tokens": 32,
             "max_num_seqs": 8} if smoke else {}
    t0 = time.perf_counter()
    llm = LLM(config_dir(SMOKE if smoke else LLAMA8B), load_format="dummy", dtype="bfloat16",
              max_model_len=(1024 if smoke else 16384) + 272, disable_log_stats=True, enable_prefix_caching=False,
              single_process=True, **ENGINES[base], **extra)
    os.environ.pop(ENV_VAR, None)
    rec["engine_up_s"] = time.perf_counter() - t0
    print(f"  {label}: engine up in {rec['engine_up_s']:.0f} s", flush=True)
    rng = random.Random(0)
    prompts = lambda n, length: [{"prompt_token_ids": [rng.randrange(3, 250) for _ in range(length)]} for _ in range(n)]
    params = SamplingParams(temperature=0, max_tokens=outp, ignore_eos=True, detokenize=False)
    llm.generate(prompts(max(1, num // 16), inp), params, use_tqdm=False)  # warm (too few tokens for a prefill window)

    def run(what: str, n_out: int) -> dict:
        log.clear()
        p = SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True, detokenize=False)
        ps = prompts(num, inp)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        outs = llm.generate(ps, p, use_tqdm=False)
        elapsed = time.perf_counter() - start
        r = _split(list(log), elapsed)
        r["tok_s"] = sum(len(o.outputs[0].token_ids) for o in outs) / elapsed
        print(f"  {label} {what}: {r['tok_s']:,.0f} output tok/s; {elapsed:.3f} s = prompt steps {r['prefill_s']:.3f} "
              f"({r['prefill_steps']}) + decode steps {r['decode_s']:.3f} ({r['decode_steps']}; {r['full_rows']}-row median "
              f"{r['full_decode_ms_median'] or 0:.3f} ms x {r['full_decode_steps']}) + outside steps "
              f"{elapsed - r['stepped_s']:.3f}", flush=True)
        return r
    if not quick:
        rec["profiled_run"] = run("profiled run", outp)
    for w, path in folder.items() if not quick else ():
        path = os.path.join(path, "rank0.json")
        if os.path.exists(path):
            with open(path) as f:
                rec[w] = step_profile.analyze(json.load(f))
            print(step_profile.format_report(f"{label} {w}", rec[w], top=30), flush=True)
        else:
            print(f"  {label}: no {w} window written", flush=True)
    rec["runs"] = [run(f"run {i + 1}", outp) for i in range(RUNS + int(quick))]  # (quick: 3, no profiled run)
    if not quick:
        rec["prefill_only"] = run("256x256x1 (prefill only)", 1)
    with open(os.path.join(OUT, f"fp8steps-{label.replace(':', '_')}.json"), "w") as f:
        json.dump(rec, f, indent=1)
    llm.shutdown()


def table(recs: dict) -> list[str]:
    labels = list(recs)
    lines = ["| | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]

    def row(name, fn, fmt="{:,.3f}"):
        vals = []
        for lab in labels:
            try:
                v = fn(recs[lab])
                vals.append(fmt.format(v) if v is not None else "-")
            except (KeyError, TypeError, IndexError, statistics.StatisticsError):
                vals.append("-")
        lines.append(f"| {name} | " + " | ".join(vals) + " |")
    med = lambda r, k: statistics.median(x[k] for x in r["runs"])
    row("output tok/s (median of runs)", lambda r: med(r, "tok_s"), "{:,.0f}")
    row("elapsed s", lambda r: med(r, "elapsed_s"))
    row("prompt-carrying steps s", lambda r: med(r, "prefill_s"))
    row("  their count", lambda r: med(r, "prefill_steps"), "{:.0f}")
    row("decode steps s", lambda r: med(r, "decode_s"))
    row("  their count", lambda r: med(r, "decode_steps"), "{:.0f}")
    row("full-row decode step ms (median)", lambda r: med(r, "full_decode_ms_median"))
    row("outside steps s", lambda r: med(r, "elapsed_s") - med(r, "stepped_s"))
    row("256x256x1 s", lambda r: r["prefill_only"]["elapsed_s"])
    for phase in ("prefill", "decode"):
        row(f"{phase} profile: device period us", lambda r, phase=phase: r[phase]["period_us"], "{:,.0f}")
        row(f"{phase} profile: kernels us", lambda r, phase=phase: r[phase]["kernel_us"], "{:,.0f}")
        row(f"{phase} profile: launch gaps us", lambda r, phase=phase: r[phase]["launch_gaps_us"], "{:,.0f}")
        row(f"{phase} profile: host gaps us", lambda r, phase=phase: r[phase]["host_gaps_us"], "{:,.0f}")
        row(f"{phase} profile: between steps us", lambda r, phase=phase: r[phase]["between_steps_us"], "{:,.0f}")
        groups = sorted({g for r in recs.values() for g in r.get(phase, {}).get("groups_us", {})})
        for g in groups:
            row(f"{phase} {g} us", lambda r, g=g, phase=phase: r[phase]["groups_us"].get(g, 0.0), "{:,.0f}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engines", default="fp8kv,bf16")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--child")
    ap.add_argument("--child-timeout", type=float, default=90.0)
    ap.add_argument("--quick", action="store_true", help="no profile windows, no prefill-only run: 3 timed runs")
    ns = ap.parse_args()
    os.makedirs(OUT, exist_ok=True)
    if ns.child:
        os.environ["TRITON_INTERPRET"] = "1" if ns.smoke else "0"
        child(ns.child, ns.smoke, ns.quick)
        return
    recs = {}
    for label in ns.engines.split(","):
        env = dict(os.environ)
        for item in os.environ.get(f"GPU_FP8_STEPS_ENV_{label.replace(':', '_')}", "").split():
            k, _, v = item.partition("=")
            env[k] = v
        path = os.path.join(OUT, f"fp8steps-{label.replace(':', '_')}.json")
        if os.path.exists(path):
            os.remove(path)  # (a failed child leaves none)
        t0 = time.perf_counter()
        cmd = [sys.executable, os.path.abspath(__file__), "--child", label] + (["--smoke"] if ns.smoke else []) + (
            ["--quick"] if ns.quick else [])
        try:
            rc = subprocess.run(cmd, check=False, env=env, timeout=ns.child_timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        print(f"  {label}: rc {rc} in {time.perf_counter() - t0:.0f} s", flush=True)
        if os.path.exists(path):
            with open(path) as f:
                recs[label] = json.load(f)
    lines = table(recs)
    print("\n".join(lines), flush=True)
    with open(os.path.join(OUT, "gpu_fp8_steps.json"), "w") as f:
        json.dump({"engines": recs, "table": lines}, f, indent=1)


if __name__ == "__main__":
    main()
