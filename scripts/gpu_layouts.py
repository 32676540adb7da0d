"""Issue 25 on two GPUs, one command: the teacher-forced layout check in bfloat16 and the
like-for-like throughput of one GPU, TP=2 and PP=2.

  check   tokenmill/benchmarks/layout_check.py on random weights of Llama-3.2-1B's layers (8 of them)
          with an 8192-token vocabulary (full distributions come back as prompt logprobs): TP=2,
          PP=2 and TP=2 with async scheduling off against one GPU (tp2 with its steps in overlapped
          halves, model/tp_overlap.py, opt-in; tp2-sync in one batch), each engine with a decode
          probe (decode steps against its prompt path, the greedy tail against the sampler), each judged against the spread
          of two valid one-GPU reductions; then TP=2 with rank 1's rows of a weight swapped
          (TOKENMILL_TEST_FAULTS wrong_shard): gate and up halves swapped must fail; 16 rows swapped
          is reported. Every engine in its own process, all at once (benchmarks/layout_jobs.py; the
          one-GPU base and reference on different GPUs), each row printed when its scores are in,
          what still runs at --check-budget killed and reported missing. A failed check exits 1.
  arsweep  what would speed the engine's all-reduces, checked: NCCL's settings (NCCL_ENVS) against
          its default at 32 and 64 MiB (prefill chunks), then the lamport all-reduce + norm's launch
          shapes (--ar-lamport-tiles) at decode row counts; within --ar-budget.
  allreduce  `tokenmill bench all-reduce --tp 2`: NCCL, one-shot, two-shot per size (checked, timed in
          CUDA graphs), and the all-reduce fused with the residual add + RMSNorm against NCCL or
          one-shot + the Triton add + norm (checked against its torch reference, chained, timed), in its
          pull and push variants; and the TP overlap (model/tp_overlap.py) on an 8-layer MLP chain:
          halves with their all-reduces on the side stream against one batch, checked, timed.
  kernels this issue's decode kernels in bf16 on the device, bit for bit the kernels they replace
          (rotary + KV write, the TP vocab embedding); a difference exits 1.
  batch1  batch 1 (one prompt at a time, 512 in x 256 out): ms per output token of one GPU, TP=2
          (fused all-reduce + norm) and TP=2 with them apart (tp2-unfused); goal TP=2 <= 0.6x.
  profile batch1 with a torch.profiler window over 32 decode steps on every rank: per-step device time
          of each kernel group (GEMMs, attention, norms, all-reduce, rope, sampling, copies, others),
          launch gaps, host gaps and the gap between steps; one GPU beside TP=2 (off by default).
  tpprofile  prefill chunks and 1000-row decode steps (64-token prompts) profiled in one run per layout
          (--profile-layouts): per kernel group, and the all-reduce per decode step from the trace.
  single  one-GPU sweeps side by side: one-row linears (cuBLAS vs the Triton GEMV, gpu_gemv.py) and
          batch-1 attention launches at a TP rank's heads (gpu_attention.py).
  arprofile  TP=2 decode steps of 1000 rows profiled (short prompts): the all-reduce's time per decode
          step of the bench's batch from the trace (off by default).
  bench   Llama-3.1-8B shape, dummy bfloat16 weights, 1000 prompts x 512 in x 256 out, one GPU,
          TP=2 and PP=2 at the same --max-num-seqs (scripts/device_check.py's pbench runs): output
          tok/s and the ratios to one GPU (targets TP=2 >= 1.75x, PP=2 >= 1.85x: reported, not
          enforced, as the speed work of the issue is not built yet).

    NCCL_NVLS_ENABLE=0 OUT=/tmp/gpu-out python scripts/gpu_layouts.py
    python scripts/gpu_layouts.py --smoke          # CPU (gloo), tiny shapes: checks that it runs

Writes $OUT/gpu_layouts.json (plus the benchmark records); $OUT defaults to ./gpu-out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.environ.setdefault("OUT", os.path.join(os.getcwd(), "gpu-out"))  # before device_check reads it
os.makedirs(OUT, exist_ok=True)
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "scripts"))

import device_check  # noqa: E402  (its SHAPES, weights_dir, config_dir and bench)

from tokenmill.benchmarks import decode_consistency as dc  # noqa: E402
from tokenmill.benchmarks import layout_check as lc  # noqa: E402

_COMMON = dict(rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=2)
# The check's model: Llama-3.2-1B's layers (width 2048, 32 heads, 8 KV heads; 8 of its 16 layers)
# with a vocabulary small enough for full prompt logprobs. Smoke: three layers of width 64.
device_check.SHAPES["layoutcheck"] = dict(
    vocab_size=8192, hidden_size=2048, intermediate_size=8192, num_hidden_layers=8, num_attention_heads=32,
    num_key_value_heads=8, head_dim=64, max_position_embeddings=4096, tie_word_embeddings=False,
    rope_theta=500000.0, **_COMMON)
device_check.SHAPES["layoutcheck-smoke"] = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False, **_COMMON)
device_check.SHAPES["llama8b-smoke"] = device_check.SHAPES["layoutcheck-smoke"]
LAYOUTS = ("tp2", "pp2", "tp2-sync")


def wrong_shards(shape: str) -> dict[str, dict[str, str]]:
    """Planted faults on TP rank 1, layer 1 (TOKENMILL_TEST_FAULTS): "tp2-gate-up-swapped", its gate
    and up halves loaded in the wrong order (must fail), and "tp2-16-rows-swapped", its first 16
    gate rows traded with the next 16 (the CI test's fault; on a wide model a subtler one: reported,
    not required to fail)."""
    half = device_check.SHAPES[shape]["intermediate_size"] // 2  # rank 1's gate rows
    plans = {"tp2-gate-up-swapped": dict(rows=[0, half], count=half),
             "tp2-16-rows-swapped": dict(rows=[0, 16], count=16)}
    return {name: {"TOKENMILL_TEST_FAULTS": json.dumps({"wrong_shard": {
        "rank": 1, "parameter": "layers.1.mlp.gate_up_proj.weight", **plan}})} for name, plan in plans.items()}


CHECK_LAYOUTS = (*LAYOUTS, "tp2-unfused", "tp2-gate-up-swapped", "tp2-16-rows-swapped")


def check(results: dict, smoke: bool, names: Sequence[str] = CHECK_LAYOUTS, parallel: int = 0,
          budget_s: float = 140.0) -> bool:
    """The layout check in bfloat16 over `names` (of CHECK_LAYOUTS, or key=value layouts); True when
    the layouts pass and the wrong shard (tp2-gate-up-swapped, where named) fails. Every engine in
    its own process, `parallel` at once (0: all), the base and the reference (one GPU each, on
    different GPUs) beside the layouts (`benchmarks/layout_jobs.py`); each row printed as soon as its
    scores are in; jobs still running at `budget_s` are killed and reported as missing (a failure)."""
    from tokenmill.benchmarks import layout_jobs as lj
    import threading
    shape = "layoutcheck-smoke" if smoke else "layoutcheck"
    start = time.perf_counter()
    vocab = device_check.SHAPES[shape]["vocab_size"]
    # No prefix caching: the decode probe generates the same prompts twice, and must see the same
    # steps. The KV pool is a fixed number of blocks (enough for the probe's 48 sequences): engines
    # that start side by side must not size it from the memory the others happen to leave.
    common = dict(dtype="bfloat16", enable_prefix_caching=False, max_logprobs=vocab, max_num_seqs=64)
    if not smoke:
        common.update(max_model_len=1024, num_gpu_blocks_override=1024)
    prompt_lens, continuation = ([5, 17, 40], 4) if smoke else ([8, 64, 200, 400], 32)
    prompts = lc.random_prompts(vocab, prompt_lens)
    # Each engine's decode steps against its own prompt steps (`decode_consistency`): 48 sequences.
    probe_prompts = dc.random_prompts(vocab, 16 if smoke else 48)
    probe_tokens = 4 if smoke else 12
    envs = wrong_shards(shape)
    # tp2 runs its prompt steps (< 1000 tokens here) and its decode steps of >= 32 rows (the probe's)
    # in overlapped halves (model/tp_overlap.py, off by default); tp2-sync keeps one batch: both
    # paths are checked.
    envs["tp2"] = {"TOKENMILL_TP_OVERLAP": "1", "TOKENMILL_TP_OVERLAP_MIN_TOKENS": "32"}
    # TP=2 with the all-reduce, residual add and RMSNorm apart: the fused kernel's numerics beside it.
    envs["tp2-unfused"] = {"TOKENMILL_FUSED_ALL_REDUCE_NORM": "0"}
    # (a name of key=value pairs, e.g. "pp=2,split=4.5:3.5", is its own layout: `Layout.parse`)
    layouts = [lc.Layout.parse(n) if n in LAYOUTS or "=" in n else lc.Layout(n, lc.PRESETS["tp2"]) for n in names]
    workdir = os.path.join(OUT, "layout_check")
    shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(workdir)
    # The weights are made while the jobs import (seconds each): a job waits for their path.
    model_file = os.path.join(workdir, "model_path")

    def make_weights() -> None:
        lj.write_atomic(model_file, device_check.weights_dir(shape))
        print(f"weights written [{time.perf_counter() - start:.0f} s]", flush=True)

    threading.Thread(target=make_weights, name="weights", daemon=True).start()
    base = lc.base_layout()
    # the reference's chunks: a third of the shortest sequence (prompt + continuation), as `reference_layout`
    reference = lc.reference_layout([[0] * (n + continuation) for n in prompt_lens])
    gpus = 2 if not smoke else 0

    def spec(layout: lc.Layout, device: str | None, **extra) -> lj.JobSpec:
        probed = layout.name not in ("tp2-gate-up-swapped", "tp2-16-rows-swapped")  # (a wrong model: not judged)
        return lj.JobSpec(layout.name, "", {**common, **layout.engine}, workdir, envs.get(layout.name, {}),
                          device if gpus else None, probe_prompts=probe_prompts if probed else (),
                          probe_tokens=probe_tokens, model_file=model_file, **extra)

    specs = [spec(base, "0", prompts=prompts, continuation=continuation), spec(reference, "1"),
             *(spec(layout, None) for layout in layouts)]
    scores: dict[str, list] = {}
    probes: dict[str, dict] = {}
    verdicts: dict[str, lc.Verdict] = {}
    record: dict = {"dtype": "bfloat16", "layouts": {}, "jobs": {}}
    results["layout_check"] = record
    ref_spread: list = []

    def judge_ready() -> None:
        if "one" not in scores or reference.name not in scores:
            return
        if not ref_spread:
            ref_spread.append(lc.compare(reference.name, scores[reference.name], scores["one"]))
            record["reference"] = dataclasses.asdict(ref_spread[0])
            print(f"reference spread ({reference.name} vs one): mean {ref_spread[0].mean:.2e} p99 "
                  f"{ref_spread[0].p99:.2e} max {ref_spread[0].max:.2e}", flush=True)
        for layout in layouts:
            if layout.name in scores and layout.name not in verdicts:
                v = lc.judge(lc.compare(layout.name, scores[layout.name], scores["one"]), ref_spread[0], "bfloat16")
                verdicts[layout.name] = v
                record["layouts"][layout.name] = {**dataclasses.asdict(v.spread), "ratios": v.ratios,
                                                  "factor": v.factor, "passed": v.passed,
                                                  "seconds": time.perf_counter() - start}
                print(lc.format_report(lc.LayoutReport("bfloat16", ref_spread[0], [v])).splitlines()[-1]
                      + f"   [{time.perf_counter() - start:.0f} s]", flush=True)

    def on_done(job: lj.JobSpec, ok: bool, tail: str) -> None:
        if not ok:
            print(f"{job.name}: job failed [{time.perf_counter() - start:.0f} s]; its log ends:\n{tail}", flush=True)
            record["jobs"][job.name] = {"ok": False}
        else:
            scores[job.name], info = lj.load_scores(job)
            record["jobs"][job.name] = {"ok": True, "seconds": info["seconds"]}
            print(f"{job.name}: scored [{time.perf_counter() - start:.0f} s; engine start "
                  f"{info['seconds']['start']:.0f} s, job {info['seconds']['total']:.0f} s]", flush=True)
            if info["probe"] is not None:
                probes[job.name] = info["probe"]
                if job.name != "one":
                    print(dc.format_line(job.name, info["probe"], probes.get("one")), flush=True)
            judge_ready()
        with open(os.path.join(OUT, "gpu_layouts.json"), "w") as f:
            json.dump(results, f, indent=2)

    print(f"layout check: {len(specs)} engines, {parallel or len(specs)} at once, budget "
          f"{budget_s - (time.perf_counter() - start):.0f} s", flush=True)
    states = lj.run_jobs(specs, parallel or len(specs), budget_s - (time.perf_counter() - start), on_done)
    record["jobs_state"] = states
    missing = [layout.name for layout in layouts if layout.name not in verdicts]
    if ref_spread:
        print(lc.format_report(lc.LayoutReport("bfloat16", ref_spread[0],
                                               [verdicts[n.name] for n in layouts if n.name in verdicts])))
    for name in ["one", *(n for n in states if n != "one")]:
        if name in probes:
            print(dc.format_line(name, probes[name], None if name == "one" else probes.get("one")))
    if missing:
        print("no verdict for " + ", ".join(f"{n} ({states.get(n, 'no base or reference scores')})" for n in missing))
    passed = {n: v.passed for n, v in verdicts.items()}
    must_pass = [n for n in (*LAYOUTS, "tp2-unfused", *(n for n in names if "=" in n)) if n in names]
    ok = (not missing and all(passed[n] for n in must_pass)
          and not passed.get("tp2-gate-up-swapped", False))
    decode_ok = {n: dc.judge(r, probes["one"]) for n, r in probes.items() if n != "one"} if "one" in probes else {}
    decode_passed = bool(decode_ok) and all(decode_ok.values())
    record.update(passed=ok, seconds=time.perf_counter() - start,
                  decode_probe={"results": probes, "passed": decode_ok, "all_passed": decode_passed})
    print(f"layout check: {'ok' if ok else 'FAILED'} (layouts must pass, tp2-gate-up-swapped must fail); "
          f"decode vs prompt path: {'ok' if decode_passed else 'FAILED'} [{time.perf_counter() - start:.0f} s]")
    return ok and decode_passed


_BENCH_LAYOUTS = {  # name: (engine flags, extra environment)
    "tp1": ([], {}),
    "tp2": (["--tensor-parallel-size", "2"], {}),
    "tp2-nccl": (["--tensor-parallel-size", "2"], {"TOKENMILL_ALL_REDUCE": "nccl"}),
    # TP=2 with the lamport kernel's first launch shape (one row a tile, 16 warps, a program per
    # SM, no PDL): the A/B of the default shape.
    "tp2-before": (["--tensor-parallel-size", "2"], {"TOKENMILL_LAMPORT_TILES": "1:16:1"}),
    # TP=2 with steps of >= 512 rows in two halves, all-reduces beside GEMMs (model/tp_overlap.py,
    # off by default), and with prompt chunks only (>= 2048 tokens): the A/B of the overlap.
    "tp2-overlap": (["--tensor-parallel-size", "2"], {"TOKENMILL_TP_OVERLAP": "1"}),
    "tp2-overlap-prefill": (["--tensor-parallel-size", "2"], {"TOKENMILL_TP_OVERLAP": "1",
                                                              "TOKENMILL_TP_OVERLAP_MIN_TOKENS": "2048"}),
    # TP=2 with the decode logits gathered for the greedy argmax (before the sharded argmax).
    "tp2-gathered-logits": (["--tensor-parallel-size", "2"], {"TOKENMILL_TP_SHARDED_ARGMAX": "0"}),
    # TP=2 with the all-reduce, residual add and RMSNorm apart (two launches where tp2 has one).
    "tp2-unfused": (["--tensor-parallel-size", "2"], {"TOKENMILL_FUSED_ALL_REDUCE_NORM": "0"}),
    # The same TP=2 steps with every all-reduce skipped (wrong outputs, same shapes and lengths:
    # --ignore-eos): the device step's difference from tp2 is what the all-reduces cost a step.
    "tp2-no-all-reduce": (["--tensor-parallel-size", "2"], {"TOKENMILL_BENCH_SKIP_ALL_REDUCE": "1"}),
    # TP=2 with the rotary and the KV-cache write as two kernels (A/B of their fusion).
    "tp2-rope-apart": (["--tensor-parallel-size", "2"], {"TOKENMILL_FUSED_ROPE_KV_WRITE": "0"}),
    "tp1-rope-apart": ([], {"TOKENMILL_FUSED_ROPE_KV_WRITE": "0"}),
    # TP=2 with the fused all-reduce + norm kernel's push variant (reads local, writes remote).
    "tp2-push": (["--tensor-parallel-size", "2"], {"TOKENMILL_ALL_REDUCE_NORM_VARIANT": "push"}),
    # ... its lamport variant (rows pushed with their own readiness: no signals) and the pull one.
    "tp2-lamport": (["--tensor-parallel-size", "2"], {"TOKENMILL_ALL_REDUCE_NORM_VARIANT": "lamport"}),
    "tp2-pull": (["--tensor-parallel-size", "2"], {"TOKENMILL_ALL_REDUCE_NORM_VARIANT": "pull"}),
    "pp2": (["--pipeline-parallel-size", "2"], {}),
    # Three micro-batches on two stages: the host's turn-around between a stage's batches hidden.
    "pp2-mb3": (["--pipeline-parallel-size", "2", "--pp-microbatches", "3"], {}),
    # The split chosen by timing a layer, the embedding and the LM head at start (logged).
    "pp2-measured": (["--pipeline-parallel-size", "2", "--pp-layer-partition", "measured"], {}),
    # Sampled tokens from the last stage to the first on the devices (scripts/gpu_pipeline.py times it).
    "pp2-dt": (["--pipeline-parallel-size", "2", "--pp-device-tokens"], {}),
}
_STEP_KEYS = ("output_tokens_per_s", "tpot_ms_p50", "device_step_ms_p50", "device_idle_fraction_p50")


def bench(results: dict, smoke: bool, max_num_seqs: int, layouts: list[str], workload: tuple[int, int, int],
          label: str, env_of=lambda name: {}) -> None:
    """`layouts` on the 8B shape at the same max_num_seqs, in one call; ratios to tp1. `env_of(name)`:
    more environment for a layout's run."""
    shape = "llama8b-smoke" if smoke else "llama8b"
    n, lin, lout = (min(workload[0], 8), 16, 8) if smoke else workload
    extra = ["--max-num-seqs", str(max_num_seqs), "--warmup", "0"]
    if smoke:
        extra += ["--kv-cache-memory-gb", "0.05"]
    figures: dict[str, dict] = {}
    for name in layouts:
        flags, env = _BENCH_LAYOUTS[name]
        env = {**env, **env_of(name)}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            device_check.bench(results, shape, n, lin, lout, baseline=False, extra=[*flags, *extra],
                               run=f"_{label}_{name}")
        finally:
            for k, v in saved.items():
                os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        key = next(k for k in results if k.startswith(f"bench_{shape}_{n}x{lin}x{lout}") and k.endswith(f"_{label}_{name}"))
        tm = results[key].get("tokenmill") or {}
        figures[name] = {k: tm.get(k) for k in _STEP_KEYS}
        figures[name]["pipeline"] = tm.get("pipeline")
    one = (figures.get("tp1") or {}).get("output_tokens_per_s")
    ratios = {k: (v["output_tokens_per_s"] / one if v.get("output_tokens_per_s") and one else None)
              for k, v in figures.items() if k != "tp1"}
    tpot = {k: v.get("tpot_ms_p50") for k, v in figures.items()}
    if label.startswith("batch1"):  # ms per output token against one GPU's (goal: TP=2 <= 0.6x)
        ratios = {k: (t / tpot["tp1"] if t and tpot.get("tp1") else None) for k, t in tpot.items() if k != "tp1"}
    step = {k: v.get("device_step_ms_p50") for k, v in figures.items()}
    all_reduce_ms = (step["tp2"] - step["tp2-no-all-reduce"]
                     if step.get("tp2") and step.get("tp2-no-all-reduce") else None)
    targets = {"tp2": 1.75, "pp2": 1.85} if label == "throughput" else {"tp2": "<=0.6"}
    fusion_ms = (tpot["tp2-unfused"] - tpot["tp2"] if tpot.get("tp2") and tpot.get("tp2-unfused") else None)
    results[f"layout_{label}"] = {"max_num_seqs": max_num_seqs, "workload": [n, lin, lout], "layouts": figures,
                                  "ratio_to_one_gpu": ratios, "targets": targets,
                                  "all_reduce_ms_per_decode_step_p50": all_reduce_ms,
                                  "fusion_saves_ms_per_token": fusion_ms,
                                  "ratio_kind": "ms per token" if label.startswith("batch1") else "output tok/s"}
    print(f"{label}: {n} x {lin} x {lout}, max_num_seqs {max_num_seqs}")
    print(f"{'layout':<18} {'out tok/s':>10} {'x one GPU':>10} {'target':>7} {'tpot p50':>9} {'step p50':>9}")
    for name, fig in figures.items():
        r = ratios.get(name)
        value = fig.get("output_tokens_per_s")
        print(f"{name:<18} {'-' if value is None else round(value):>10} {'' if r is None else f'{r:.3f}':>10} "
              f"{targets.get(name, ''):>7} {fig.get('tpot_ms_p50') or 0:9.3f} {fig.get('device_step_ms_p50') or 0:9.3f}")
    for name, fig in figures.items():  # the bubble of each stage, from the step trace
        for i, stage in enumerate((fig.get("pipeline") or {}).get("stages") or []):
            print(f"  {name} stage {i}: busy {stage.get('busy_s', 0):.2f} s, idle {stage.get('idle_s', 0):.2f} s, "
                  f"bubble {stage.get('bubble_fraction', 0):.1%} (goal < 3%)")
    if label.startswith("batch1"):
        print("(batch1: 'x one GPU' is ms per output token over one GPU's)")
    if fusion_ms is not None:
        print(f"fused all-reduce + add + RMSNorm saves {fusion_ms:.3f} ms per token (tp2-unfused - tp2, tpot p50)")
    if all_reduce_ms is not None:
        print(f"all-reduces per decode step (tp2 - tp2-no-all-reduce, device step p50): {all_reduce_ms:.3f} ms")


def kernels(results: dict, smoke: bool) -> bool:
    """This issue's decode kernels on the device in bf16, bit for bit the paths they replace: the
    rotary + KV-cache write against `rotate_` then `write_kv` (Llama-3.1-8B's heads at TP=2 and one
    GPU, 1 and 37 tokens, padding slots), and the TP vocab embedding against the torch lookup."""
    import torch

    from tokenmill.layers.attention.triton_kv_write import write_kv
    from tokenmill.layers.attention.triton_rope_kv_write import rotate_and_write_kv
    from tokenmill.layers.rotary import RotaryEmbedding
    from tokenmill.layers.triton_ops.rotary import rotate_
    from tokenmill.layers.triton_ops.vocab_embedding import vocab_embedding
    from tokenmill.config import RopeConfig
    if smoke or not torch.cuda.is_available():
        print("kernels: needs CUDA (skipped)")
        return True
    dev, dt, ok = torch.device("cuda"), torch.bfloat16, True
    rope = RotaryEmbedding(128, 8192, RopeConfig(theta=500000.0)).to(dev)
    checks = {}
    for hq, hkv in ((16, 4), (32, 8)):
        for tokens in (1, 37):
            g = torch.Generator(device=dev).manual_seed(tokens)
            qkv = torch.randn(tokens, (hq + 2 * hkv) * 128, generator=g, device=dev).to(dt)
            pos = torch.randint(0, 8000, (tokens,), generator=g, device=dev)
            slots = torch.randperm(64 * 16, generator=g, device=dev)[:tokens]
            slots[::5] = -1
            cache = torch.zeros(2, 64, 16, hkv, 128, device=dev, dtype=dt)
            ref_qkv, ref_cache = qkv.clone(), cache.clone()
            qk = ref_qkv[:, :(hq + hkv) * 128].view(tokens, hq + hkv, 128)
            rotate_(qk, None, pos, rope.cos_cache, rope.sin_cache, 128)
            q_ref, k_ref = qk.split([hq, hkv], dim=1)
            write_kv(k_ref, ref_qkv[:, (hq + hkv) * 128:].view(tokens, hkv, 128), ref_cache, slots)
            qk = qkv[:, :(hq + hkv) * 128].view(tokens, hq + hkv, 128)
            q, k = qk.split([hq, hkv], dim=1)
            rotate_and_write_kv(q, k, qkv[:, (hq + hkv) * 128:].view(tokens, hkv, 128), pos, rope.cos_cache,
                                rope.sin_cache, 128, cache, slots)
            checks[f"rope_kv_write_{hq}x{hkv}_t{tokens}"] = bool(torch.equal(q, q_ref) and torch.equal(cache, ref_cache))
    weight = torch.randn(64128, 4096, device=dev).to(dt)
    ids = torch.tensor([0, 64127, 64128, 100000, 128255, 5], device=dev)
    for start in (0, 64128):
        local = ids - start
        outside = (local < 0) | (local >= weight.shape[0])
        want = torch.nn.functional.embedding(local.masked_fill(outside, 0), weight).masked_fill_(outside[:, None], 0)
        checks[f"vocab_embedding_start{start}"] = bool(torch.equal(vocab_embedding(ids, weight, start), want))
    ok = all(checks.values())
    results["kernels"] = {"checks": checks, "passed": ok}
    print("kernels (bf16, bit for bit): " + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in checks.items()))
    return ok


def read_profiles(folder: str, label: str) -> dict:
    """Every rank's profile under $OUT/`folder`, analyzed, printed and written beside it as text."""
    from tokenmill.benchmarks import step_profile
    path = os.path.join(OUT, folder)
    ranks = sorted(f for f in os.listdir(path) if f.startswith("rank")) if os.path.isdir(path) else []
    figures = {}
    for file in ranks:
        with open(os.path.join(path, file)) as f:
            a = step_profile.analyze(json.load(f))
        text = step_profile.format_report(label, a)
        print(text, flush=True)
        with open(os.path.join(OUT, f"{folder}_{file[:-5]}.txt"), "w") as f:
            f.write(text + "\n")
        figures[f"{folder}_{file[:-5]}".removeprefix("profile_")] = a
    if not ranks:
        print(f"{label}: no profile written")
    return figures


def profile_env(folder: str, window: dict) -> dict:
    from tokenmill.worker.device_profile import ENV_VAR
    shutil.rmtree(os.path.join(OUT, folder), ignore_errors=True)  # not an earlier run's
    return {ENV_VAR: json.dumps({"out_dir": os.path.join(OUT, folder), **window})}


def profile(results: dict, smoke: bool, layouts: list[str], prompts: int) -> None:
    """Batch 1 (as the batch1 part) with a torch.profiler window over 32 graph-replayed decode steps
    of the first prompt on every rank (TOKENMILL_DEVICE_PROFILE, tokenmill/worker/device_profile.py):
    per step, each kernel group's device time, and the idle time split into launch gaps, host gaps
    inside the step and the gap between steps (tokenmill/benchmarks/step_profile.py). The all-reduce
    group of TP=2 is the all-reduces' device time per decode step."""
    window = dict(batch=1, skip=2, steps=3) if smoke else dict(batch=1, skip=64, steps=32)
    figures, tpot = {}, {}
    for name in layouts:  # one bench call each, its profile read at once (a run cut short keeps them)
        bench(results, smoke, 1, [name], (prompts, 512, 256), "batch1_profiled",
              lambda layout: profile_env(f"profile_{layout}", window))
        # The device step, not the TPOT: reading the trace out stalls the run for a few seconds.
        tpot[name] = results["layout_batch1_profiled"]["layouts"][name].get("device_step_ms_p50")
        figures.update(read_profiles(f"profile_{name}", f"{name} batch 1"))
        results["profile_batch1"] = {"device_step_ms_p50": tpot, "ranks": figures}
        with open(os.path.join(OUT, "gpu_layouts.json"), "w") as f:
            json.dump(results, f, indent=2)
    print("batch 1 (profiled runs), device step ms p50: " + ", ".join(
        f"{k} {v:.3f}" + (f" ({v / tpot['tp1']:.3f}x one GPU)" if k != "tp1" and tpot.get("tp1") else "")
        for k, v in tpot.items() if v))
    one, tp = figures.get("tp1_rank0"), figures.get("tp2_rank0")
    if one and tp:
        print(f"{'per step (us)':<22} {'one GPU':>9} {'TP=2':>9} {'TP/one':>7}")
        rows = [("device period", "period_us"), ("kernels", "kernel_us"), ("launch gaps", "launch_gaps_us"),
                ("host gaps in step", "host_gaps_us"), ("between steps", "between_steps_us")]
        rows += [(g, g) for g in sorted(set(one["groups_us"]) | set(tp["groups_us"]),
                                      key=lambda g: -tp["groups_us"].get(g, 0))]
        for label, key in rows:
            x = one.get(key, one["groups_us"].get(key, 0.0))
            y = tp.get(key, tp["groups_us"].get(key, 0.0))
            print(f"{label:<22} {x:9.1f} {y:9.1f} {y / x if x else float('nan'):7.3f}")
        print(f"kernels per step: one GPU {one['kernels_per_step']:.0f}, TP=2 {tp['kernels_per_step']:.0f}; "
              f"all-reduce per decode step (TP=2 rank 0, from the trace): {tp['groups_us'].get('all_reduce', 0):.1f} us "
              f"in {tp['groups_calls'].get('all_reduce', 0):.0f} calls")


def ar_profile(results: dict, smoke: bool) -> None:
    """TP=2 decode steps of 1000 rows, profiled (12 steps after 8; short prompts, so that the run is
    mostly start-up): the all-reduce's time per decode step of the bench's batch, from the trace.
    Not inside the bench's timed runs: reading the trace out stalls a run for a few seconds."""
    rows = 8 if smoke else 1000
    window = dict(batch=rows, skip=2, steps=3) if smoke else dict(batch=rows, skip=8, steps=12)
    bench(results, smoke, 1024, ["tp2"], (rows, 32, 48), "arprofile",
          lambda name: profile_env(f"arprofile_{name}", window))
    figures = read_profiles("arprofile_tp2", f"tp2 {rows} rows")
    results["profile_all_reduce"] = figures
    r0 = figures.get("arprofile_tp2_rank0") or {}
    if r0:
        print(f"tp2: all-reduce per decode step of {rows} rows (rank 0, from the trace): "
              f"{r0['groups_us'].get('all_reduce', 0) / 1e3:.3f} ms in {r0['groups_calls'].get('all_reduce', 0):.0f} "
              f"calls, of a device period of {r0['period_us'] / 1e3:.3f} ms")


def tp_profile(results: dict, smoke: bool, layouts: list[str]) -> None:
    """The throughput bench's kind of steps profiled (1000 prompts x 64 in, 32 out, max_num_seqs
    1024: short prompts keep the run short; the bench's are 512): in one run per layout, a window
    over 3 prefill chunks (steps of >= 8000 tokens) and one over 8 decode steps of all 1000 rows,
    on every rank. Per step
    and kernel group (GEMMs, attention, all-reduce, ...), side by side per layout: what keeps TP=2
    from halving a step, and the all-reduce's time per decode step from the trace."""
    from tokenmill.worker.device_profile import ENV_VAR
    rows = 8 if smoke else 1000

    def windows(name: str) -> dict:
        for kind in ("prefill", "decode"):
            shutil.rmtree(os.path.join(OUT, f"tpprofile_{name}_{kind}"), ignore_errors=True)
        return {ENV_VAR: json.dumps([
            dict(out_dir=os.path.join(OUT, f"tpprofile_{name}_prefill"), min_tokens=1 if smoke else 8000,
                 skip=1 if smoke else 2, steps=2 if smoke else 3),
            dict(out_dir=os.path.join(OUT, f"tpprofile_{name}_decode"), batch=rows, skip=1 if smoke else 4,
                 steps=2 if smoke else 8)])}

    figures: dict = {}
    for name in layouts:
        bench(results, smoke, 1024, [name], (rows, 64, 32), "tpprofile", windows)
        for kind in ("prefill", "decode"):
            figures.update(read_profiles(f"tpprofile_{name}_{kind}", f"{name} {kind}"))
        results["profile_throughput"] = figures
        with open(os.path.join(OUT, "gpu_layouts.json"), "w") as f:
            json.dump(results, f, indent=2)
    for kind in ("prefill", "decode"):
        per = {name: figures.get(f"tpprofile_{name}_{kind}_rank0") for name in layouts}
        per = {k: v for k, v in per.items() if v}
        if not per:
            continue
        groups = sorted({g for v in per.values() for g in v["groups_us"]}, key=lambda g: -max(
            v["groups_us"].get(g, 0.0) for v in per.values()))
        print(f"{kind} step (rank 0), ms: " + "  ".join(f"{k} {v['period_us'] / 1e3:.3f}" for k, v in per.items()))
        print(f"{'group':<14} " + " ".join(f"{k:>12}" for k in per))
        for g in groups:
            print(f"{g:<14} " + " ".join(f"{v['groups_us'].get(g, 0.0) / 1e3:12.3f}" for v in per.values()))
        tp = per.get("tp2")
        if tp and kind == "decode":
            print(f"tp2: all-reduce per decode step of {rows} rows (rank 0, from the trace): "
                  f"{tp['groups_us'].get('all_reduce', 0) / 1e3:.3f} ms in {tp['groups_calls'].get('all_reduce', 0):.0f} "
                  f"calls, of a device period of {tp['period_us'] / 1e3:.3f} ms")


def all_reduce(results: dict, smoke: bool, sizes_kib: str | None, fused_rows: str | None = None,
               variants: str = "pull,push,lamport", timeout_s: float = 90.0, overlap_rows: str = "",
               lamport_tiles: str = "", key: str = "all_reduce") -> bool:
    """`tokenmill bench all-reduce --tp 2`: NCCL vs the symmetric buffer per size, checked; then the
    all-reduce fused with the residual add + RMSNorm against NCCL / one-shot + the Triton add + norm
    (checked against `all_reduce_norm.reference`, chained in a graph, timed)."""
    if smoke:
        print("all-reduce: needs two GPUs (skipped in --smoke)")
        return True
    record = os.path.join(OUT, "all_reduce.json")
    if os.path.exists(record):
        os.remove(record)  # not an earlier call's
    sizes = ["--sizes-kib", sizes_kib] if sizes_kib is not None else []
    sizes += ["--fused-rows", fused_rows] if fused_rows is not None else []
    sizes += ["--fused-variants", variants, "--overlap-rows", overlap_rows, "--lamport-tiles", lamport_tiles]
    # In its own process group with a time limit: a kernel that never returns (two ranks waiting on
    # each other) ends this part as failed, its workers with it, and the call goes on.
    proc = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "bench", "all-reduce", "--tp", "2", *sizes,
                             "--output-json", record], cwd=REPO, text=True, start_new_session=True)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        import signal
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        print(f"all-reduce: no result after {timeout_s:.0f} s (killed)", flush=True)
        return False
    if os.path.exists(record):
        with open(record) as f:
            results[key] = json.load(f)
        os.replace(record, os.path.join(OUT, f"{key}.json"))
    return proc.returncode == 0


# NCCL's settings tried on the prefill chunks' all-reduce (64 MiB: 8192 tokens x 4096 in bf16, which
# NCCL carries), each in its own pair of processes (`arsweep`); "default" is the engine's today.
NCCL_ENVS = {
    "ch32": {"NCCL_MIN_NCHANNELS": "32"},
    "simple-ch24": {"NCCL_PROTO": "Simple", "NCCL_MIN_NCHANNELS": "24"},
    "ch32-nt512": {"NCCL_MIN_NCHANNELS": "32", "NCCL_NTHREADS": "512"},
}
# The lamport kernel's launch shapes (rows:warps:per_sm[:pdl+pre]), in order of interest (a run cut at
# its budget keeps the first). At hidden 4096 the compiled kernel (sm_90, offline) holds 50 / 52 /
# 80 / 93 / 36 registers a thread at 1:16 / 1:16:pre / 1:8 / 1:8:pre / 1:32:pre: 2 / 2 / 3 / 2 / 1
# programs per SM.
LAMPORT_TILES = "1:16:1,1:16:1:pre,1:16:1:pdl+pre,1:16:2:pre,1:8:3,1:32:1:pre,2:32:1:pre,1:8:2:pre"


def ar_sweep(results: dict, smoke: bool, tiles: str, fused_rows: str, nccl_envs: list[str],
             budget_s: float = 150.0) -> bool:
    """What would make the engine's all-reduces faster, each checked: NCCL's settings (NCCL_ENVS)
    against its default on prefill-sized messages, then the lamport fused kernel's launch shapes
    (`--lamport-tiles`: rows per tile, warps, programs per SM, PDL) at the decode steps' row counts.
    Every run ends (killed where it must) within `budget_s` of the start: a call's limit must not
    leave its processes on the GPUs."""
    deadline = time.perf_counter() + budget_s
    ok = True
    for name in ["default", *nccl_envs]:
        env = NCCL_ENVS.get(name, {})
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            ok = all_reduce(results, smoke, "32768,65536", "", "lamport",
                            timeout_s=max(min(30.0, deadline - time.perf_counter() - 30), 1.0),
                            key=f"arsweep_nccl_{name}") and ok
        finally:
            for k, v in saved.items():
                os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        rows = {r["kib"]: r for r in (results.get(f"arsweep_nccl_{name}") or {}).get("rows", [])}
        if rows:
            print(f"NCCL {name:<12} " + "  ".join(
                f"{kib >> 10} MiB nccl {r['nccl_graph_us']:.1f} two-shot {r['two_shot_graph_us']:.1f} us"
                for kib, r in sorted(rows.items())), flush=True)
        with open(os.path.join(OUT, "gpu_layouts.json"), "w") as f:
            json.dump(results, f, indent=2)
    ok = all_reduce(results, smoke, "", fused_rows, "lamport", lamport_tiles=tiles, key="arsweep_lamport",
                    timeout_s=max(deadline - time.perf_counter(), 1.0)) and ok
    by_rows: dict[int, list] = {}
    for r in (results.get("arsweep_lamport") or {}).get("fused_rows", []):
        by_rows.setdefault(r["rows"], []).append(r)
    for rows, runs in sorted(by_rows.items()):
        best = min((r for r in runs if r["ok"]), key=lambda r: r["fused_graph_us"], default=None)
        print(f"lamport {rows:>5} rows: " + "  ".join(f"{r['tiles']} {r['fused_graph_us']:.1f}" for r in runs)
              + (f"  best {best['tiles']}" if best else "  none checked ok"), flush=True)
    return ok


def single_gpu_sweeps(results: dict, smoke: bool, budget: float) -> bool:
    """One-GPU sweeps side by side, one per GPU: the one-row linears of TP=1 and TP=2 (cuBLAS against
    the Triton GEMV's tiles, scripts/gpu_gemv.py) on GPU 1, and batch-1 decode attention at a rank's
    heads (16 query / 4 KV heads at TP=2, 32 / 8 at one GPU; context 640, the bench's max_model_len
    784 as the decode graphs capture it) swept over its launch (scripts/gpu_attention.py) on GPU 0."""
    scripts = os.path.join(REPO, "scripts")
    gemv_out, attn_out = os.path.join(OUT, "gemv"), os.path.join(OUT, "attention_b1")
    smoke_flag = ["--smoke"] if smoke else []
    procs = {"gemv": subprocess.Popen(
        [sys.executable, os.path.join(scripts, "gpu_gemv.py"), "--budget", str(budget * 0.8), *smoke_flag],
        env={**os.environ, "OUT": gemv_out, "CUDA_VISIBLE_DEVICES": "1"}, text=True)}
    heads_runs = [(16, 4), (32, 8)]
    code = ("import sys; sys.argv = ['gpu_attention.py', '--shapes', {shape!r}, '--sweep-all', '--budget', {b!r}] "
            "+ {smoke!r}; import gpu_attention as g; g.LLAMA8B = ({hq}, {hkv}, 128); g.MAX_MODEL_LEN = 784; g.main()")
    attn_ok = True
    if smoke:
        print("attention sweep: needs CUDA (skipped in --smoke)")
    else:
        for hq, hkv in heads_runs:
            env = {**os.environ, "OUT": os.path.join(attn_out, f"h{hq}x{hkv}"), "CUDA_VISIBLE_DEVICES": "0"}
            cmd = code.format(shape="1x640", b=str(budget * 0.4), smoke=[], hq=hq, hkv=hkv)
            attn_ok = subprocess.run([sys.executable, "-c", cmd], cwd=scripts, env=env, text=True).returncode == 0 and attn_ok
            path = os.path.join(attn_out, f"h{hq}x{hkv}", "gpu_attention.json")
            if os.path.exists(path):
                with open(path) as f:
                    results[f"attention_b1_h{hq}x{hkv}"] = json.load(f)
    gemv_ok = procs["gemv"].wait() == 0
    path = os.path.join(gemv_out, "gpu_gemv.json")
    if os.path.exists(path):
        with open(path) as f:
            results["gemv"] = json.load(f)
    return gemv_ok and attn_ok


def pick_variant(results: dict) -> None:
    """From this call's `allreduce` part: the fused all-reduce + norm variant fastest at one row (of
    those whose checks passed) for every later engine run of the call (TOKENMILL_ALL_REDUCE_NORM_VARIANT),
    and, where it is the lamport one and beats the all-reduce + norm apart at every larger row count
    measured (prefill-sized messages included), its buffer sized for them (TOKENMILL_ALL_REDUCE_NORM_MAX_MIB)."""
    rows = (results.get("all_reduce") or {}).get("fused_rows") or []
    at_one = [r for r in rows if r["rows"] == 1 and r["ok"]]
    if not at_one:
        print("variant pick: no checked one-row figures; the engine's default stays")
        return
    best = min(at_one, key=lambda r: r["fused_graph_us"])
    variant = best.get("variant") or ("push" if best.get("push") else "pull")
    os.environ["TOKENMILL_ALL_REDUCE_NORM_VARIANT"] = variant
    pick = {"variant": variant, "one_row_us": {r.get("variant"): r["fused_graph_us"] for r in at_one}}
    large = [r for r in rows if r.get("variant") == variant and r["rows"] * r["hidden"] * 2 > (2 << 20)]
    if variant == "lamport" and large and all(
            r["ok"] and r["fused_graph_us"] < min(r["one_shot_norm_graph_us"], r["nccl_norm_graph_us"]) for r in large):
        mib = max(r["rows"] * r["hidden"] * 2 for r in large) >> 20
        os.environ["TOKENMILL_ALL_REDUCE_NORM_MAX_MIB"] = str(mib)
        pick["max_mib"] = mib
    results["variant_pick"] = pick
    print(f"variant pick for the engine runs below: {pick}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default="allreduce,check,batch1,bench")
    ap.add_argument("--max-num-seqs", type=int, default=1024, help="the same for every layout of the bench")
    ap.add_argument("--layouts", default="tp1,tp2,tp2-no-all-reduce,pp2,pp2-mb3", help="the bench's layouts: "
                    + ", ".join(_BENCH_LAYOUTS))
    ap.add_argument("--check-layouts", default=",".join(CHECK_LAYOUTS), help="check: layouts judged against one "
                    "GPU (tp2-gate-up-swapped must fail, the others but tp2-16-rows-swapped must pass)")
    ap.add_argument("--ar-sizes-kib", default=None, help="allreduce: message sizes (default: bench all-reduce's)")
    ap.add_argument("--ar-fused-rows", default=None, help="allreduce: rows of the fused all-reduce + norm runs "
                    "(pull and push variants; default: bench all-reduce's)")
    ap.add_argument("--batch1-layouts", default="tp1,tp2,tp2-unfused", help="batch1: layouts to time")
    ap.add_argument("--batch1-prompts", type=int, default=4, help="batch1: prompts (one at a time, 512 in x 256 out)")
    ap.add_argument("--profile-layouts", default="tp2", help="tpprofile: layouts profiled (e.g. tp1,tp2)")
    ap.add_argument("--sweep-budget", type=float, default=40.0, help="single: seconds for the one-GPU sweeps")
    ap.add_argument("--pick-variant", action="store_true", help="allreduce: the later engine runs take the fused "
                    "kernel's variant fastest at one row here (and lamport's large-message buffer where it wins)")
    ap.add_argument("--ar-variants", default="pull,push,lamport", help="allreduce: the fused kernel's variants")
    ap.add_argument("--ar-overlap-rows", default="1024,8192", help="allreduce: rows of the TP overlap's check "
                    "and timing (an 8-layer MLP chain in halves against one batch; '' for none)")
    ap.add_argument("--check-parallel", type=int, default=0, help="check: engines at once (0: all)")
    ap.add_argument("--check-budget", type=float, default=140.0, help="check: seconds from the part's start "
                    "after which engines still running are killed (their rows reported missing)")
    ap.add_argument("--ar-lamport-tiles", default=LAMPORT_TILES, help="arsweep: the lamport kernel's launch "
                    "shapes, rows:warps:per_sm")
    ap.add_argument("--ar-budget", type=float, default=150.0, help="arsweep: seconds for all its runs")
    ap.add_argument("--ar-nccl-envs", default=",".join(NCCL_ENVS), help="arsweep: NCCL settings tried (of "
                    + ", ".join(NCCL_ENVS) + ")")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: only that the script runs")
    args = ap.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast on the lent machines
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    import torch
    results: dict = {"smoke": args.smoke, "torch": torch.__version__,
                     "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                     "num_gpus": torch.cuda.device_count()}
    if not args.smoke and torch.cuda.device_count() < 2:
        print("needs two GPUs (or --smoke)")
        return 2
    ok = True
    for part in args.parts.split(","):
        start = time.perf_counter()
        print(f"==== {part}", flush=True)
        if part == "check":
            # ';' separates layouts when one is a key=value name ("tp2;pp=2,split=4.5:3.5")
            names = args.check_layouts.split(";" if ";" in args.check_layouts else ",")
            unknown = {n for n in names if "=" not in n} - set(CHECK_LAYOUTS)
            if unknown:
                raise SystemExit(f"--check-layouts: unknown {sorted(unknown)} (of {', '.join(CHECK_LAYOUTS)})")
            ok = check(results, args.smoke, names, args.check_parallel, args.check_budget) and ok
        elif part == "bench":
            bench(results, args.smoke, args.max_num_seqs, args.layouts.split(","), (1000, 512, 256), "throughput")
        elif part == "arprofile":
            ar_profile(results, args.smoke)
        elif part == "batch1":
            bench(results, args.smoke, 1, args.batch1_layouts.split(","), (args.batch1_prompts, 512, 256), "batch1")
        elif part == "kernels":
            ok = kernels(results, args.smoke) and ok
        elif part == "profile":
            profile(results, args.smoke, args.batch1_layouts.split(","), args.batch1_prompts)
        elif part == "tpprofile":
            tp_profile(results, args.smoke, args.profile_layouts.split(","))
        elif part == "single":
            ok = single_gpu_sweeps(results, args.smoke, args.sweep_budget) and ok
        elif part == "arsweep":
            ok = ar_sweep(results, args.smoke, args.ar_lamport_tiles, args.ar_fused_rows or "1,256,1024",
                          [n for n in args.ar_nccl_envs.split(",") if n], args.ar_budget) and ok
        elif part == "allreduce":
            ok = all_reduce(results, args.smoke, args.ar_sizes_kib, args.ar_fused_rows, args.ar_variants,
                            overlap_rows=args.ar_overlap_rows) and ok
            if args.pick_variant:
                pick_variant(results)
        else:
            raise SystemExit(f"--parts: unknown part {part!r} (allreduce, arsweep, single, check, kernels, batch1, profile, arprofile, tpprofile, bench)")
        print(f"[{part}: {time.perf_counter() - start:.0f} s]", flush=True)
        with open(os.path.join(OUT, "gpu_layouts.json"), "w") as f:
            json.dump(results, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
