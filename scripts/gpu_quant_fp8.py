"""The FP8 W8A8 parts of scripts/gpu_quant.py: where an fp8 engine step's time goes, and the W8A8
GEMM per row count.

- `profile`: bf16 and fp8 engines (Llama-3.1-8B shape, dummy weights, graphs on), each in its own
  process (`--child profile-one-<label>`), single-process engines. Decode: a torch.profiler
  window over graph-replayed steps of `DECODE_ROWS` rows (tokenmill/worker/device_profile.py) cut
  into kernel groups, launch gaps and host gaps (tokenmill/benchmarks/step_profile.py); prefill: one
  eager step of `PREFILL_TOKENS` prompt tokens under torch.profiler. Then the physical bound of
  each throughput workload for both (prefill at the profiled GEMM rate, decode steps at
  max(bytes / copy bandwidth, FLOPs / GEMM rate), KV reads included) and the tok/s it allows.
- `w8a8`: each Llama-8B linear at 16..8192 rows: bf16 cuBLAS, the activation quantization alone,
  row-wise / tensor-wise `torch._scaled_mm`, the engine's W8A8 path, and the Triton fp8 GEMM
  (`triton_fp8_gemm`) at several tiles and split-K; every variant checked against the torch
  reference first. Prints `stream_tiles.W8A8_MEASURED` lines for the winners.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time

import torch

import triton_precompile  # scripts/: compiles a sweep's kernels in parallel processes

# Decode rows profiled (the 256x256x128 workload's batch) and the eager prefill chunk's tokens.
DECODE_ROWS = 256
PREFILL_TOKENS = 8192
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
SMOKE_SHAPES = {"qkv": (256, 128), "o": (128, 128), "gate_up": (512, 128), "down": (128, 256)}


# ---------------------------------------------------------------- profile

def profile_one(results: dict, label: str, smoke: bool, shape: dict, config_dir, out: str) -> None:
    """One engine (`label` bf16 or fp8) in this process: the decode window and one prefill step."""
    from tokenmill import LLM, SamplingParams
    from tokenmill.benchmarks import step_profile
    from tokenmill.worker.device_profile import ENV_VAR

    rows, in_len = (4, 16) if smoke else (DECODE_ROWS, 256)
    skip, steps = (2, 3) if smoke else (12, 16)
    folder = os.path.join(out, f"profile_{label}")
    os.environ[ENV_VAR] = json.dumps({"out_dir": folder, "batch": rows, "skip": skip, "steps": steps})
    kwargs = {"quantization": "fp8"} if label == "fp8" else {}
    extra = dict(device="cpu", enforce_eager=True, kv_cache_memory_gb=0.05) if smoke else {}
    start = time.perf_counter()
    llm = LLM(config_dir(shape), load_format="dummy", dtype="bfloat16", max_model_len=2048, disable_log_stats=True,
              enable_prefix_caching=False, single_process=True, **kwargs, **extra)
    os.environ.pop(ENV_VAR)
    print(f"  profile {label}: engine up in {time.perf_counter() - start:.0f} s", flush=True)
    import random
    rng = random.Random(0)
    prompts = lambda n, length: [{"prompt_token_ids": [rng.randrange(3, 250) for _ in range(length)]}
                                 for _ in range(n)]
    params = SamplingParams(temperature=0, max_tokens=skip + steps + 24, ignore_eos=True, detokenize=False)
    t0 = time.perf_counter()
    llm.generate(prompts(rows, in_len), params, use_tqdm=False)
    rec = results.setdefault("profile", {}).setdefault(label, {})
    rec["decode_run_s"] = time.perf_counter() - t0
    path = os.path.join(folder, "rank0.json")
    if os.path.exists(path):
        with open(path) as f:
            a = step_profile.analyze(json.load(f))
        rec["decode"] = a
        print(step_profile.format_report(f"{label} decode, {rows} rows", a), flush=True)
    else:
        print(f"  profile {label}: no decode window written ({path})", flush=True)
    # Prefill: one eager step of PREFILL_TOKENS (the default max_num_batched_tokens), warmed first.
    n_prompts, p_len = (2, 16) if smoke else (PREFILL_TOKENS // 512, 512)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False)
    llm.generate(prompts(n_prompts, p_len), one, use_tqdm=False)
    cuda = torch.cuda.is_available() and not smoke
    t0 = time.perf_counter()
    a = _profiled(llm, prompts(n_prompts, p_len), one, cuda)
    rec["prefill_wall_ms"] = 1e3 * (time.perf_counter() - t0)
    if a:
        rec["prefill"] = a
        rec["prefill_tokens"] = n_prompts * p_len
        print(step_profile.format_report(f"{label} prefill, {n_prompts * p_len} tokens (eager)", a), flush=True)
    # Batch 1: one 512-token prompt decoding 1 + B1_STEPS tokens minus the same with 1 token (the
    # prompt's own kernels cancel): per decode step, each group's device time and the span.
    n = 4 if smoke else B1_STEPS
    fixed = prompts(1, 512 if not smoke else 16)
    runs = {}
    for tokens in (1, 1 + n) if os.environ.get("PROFILE_SKIP_B1") != "1" else ():  # (=1: 256 rows and prefill only)
        params1 = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, detokenize=False)
        llm.generate(fixed, params1, use_tqdm=False)
        runs[tokens] = _profiled(llm, fixed, params1, cuda)
    if runs.get(1) and runs.get(1 + n):
        long, short = runs[1 + n], runs[1]
        groups = {g: (long["groups_us"].get(g, 0.0) - short["groups_us"].get(g, 0.0)) / n
                  for g in set(long["groups_us"]) | set(short["groups_us"])}
        rec["batch1"] = {"period_us": (long["period_us"] - short["period_us"]) / n,
                         "kernel_us": (long["kernel_us"] - short["kernel_us"]) / n,
                         "kernels_per_step": (long["kernels_per_step"] - short["kernels_per_step"]) / n,
                         "groups_us": dict(sorted(groups.items(), key=lambda kv: -kv[1])),
                         "launch_gaps_us": 0.0, "host_gaps_us": 0.0, "between_steps_us": 0.0,
                         "top_kernels": long["kernels"][:25]}
        rec["batch1"]["idle_us"] = rec["batch1"]["period_us"] - rec["batch1"]["kernel_us"]
        print(f"  {label} batch 1 decode step: span {rec['batch1']['period_us']:.0f} us, kernels "
              f"{rec['batch1']['kernel_us']:.0f} us ({rec['batch1']['kernels_per_step']:.0f}/step): " +
              ", ".join(f"{g} {v:.0f}" for g, v in rec["batch1"]["groups_us"].items()), flush=True)
        for k in long["kernels"][:25]:
            print(f"    {k['us_per_step'] / n:8.1f} us/step {k['calls_per_step'] / n:5.1f}x {k['group']:<10} "
                  f"{k['name'][:90]}", flush=True)
    llm.shutdown()


B1_STEPS = 40  # decode steps of the batch-1 profile


def _profiled(llm, prompts: list, params, cuda: bool) -> dict | None:
    """step_profile's analysis of everything the device ran for one generate call (one span)."""
    from tokenmill.benchmarks import step_profile

    activity = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
    if cuda:
        torch.cuda.synchronize()
    with torch.profiler.profile(activities=[activity]) as prof:
        llm.generate(prompts, params, use_tqdm=False)
        if cuda:
            torch.cuda.synchronize()
    events = sorted(([e.name, float(e.time_range.start), float(e.time_range.elapsed_us())] for e in prof.events()
                     if (e.device_type == torch.autograd.DeviceType.CUDA) == cuda), key=lambda e: e[1])
    return step_profile.analyze({"events": events, "steps": 1, "rank": 0}) if events else None


def copy_bandwidth(device: str) -> float:
    """Bytes per second of a large device copy (read + write), the decode steps' ceiling."""
    if device != "cuda":
        return 50e9
    x = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(10):
        y.copy_(x)
    e.record()
    torch.cuda.synchronize()
    return 2 * 10 * x.numel() / (s.elapsed_time(e) / 1e3)


def model_figures(shape: dict) -> dict:
    h, i, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    kv_heads, heads, vocab = shape["num_key_value_heads"], shape["num_attention_heads"], shape["vocab_size"]
    head_dim = h // heads
    linear = layers * (h * (h + 2 * kv_heads * head_dim) + h * h + 2 * i * h + i * h)
    return {"linear_params": linear, "lm_head_params": vocab * h,
            "kv_bytes_per_token": 2 * layers * kv_heads * head_dim * 2}  # bf16 KV


def bounds(prof: dict, shape: dict, bandwidth: float) -> dict:
    """Per engine: the least time of each throughput workload the profiled GEMM rate and the copy
    bandwidth allow, as output tok/s. Prefill: prompt tokens x the prefill step's GEMM time per
    token; decode: each step max(bytes / bandwidth, FLOPs / the prefill GEMM FLOP rate), bytes =
    weights (fp8: linears at 1 byte, the LM head bf16) + every row's KV (bf16) + the LM head."""
    f = model_figures(shape)
    out = {}
    for label, rec in prof.items():
        pre = rec.get("prefill")
        if not pre:
            continue
        tokens = rec["prefill_tokens"]
        gemm_s_per_token = pre["groups_us"].get("gemm", 0.0) * 1e-6 / tokens
        flops_per_token = 2 * f["linear_params"]  # the prefill step's GEMMs (LM head: last tokens only)
        rate = flops_per_token / gemm_s_per_token if gemm_s_per_token else float("inf")
        wbytes = f["linear_params"] * (1 if label.startswith("fp8") else 2) + 2 * f["lm_head_params"]
        rec_b = {"gemm_tflops_prefill": rate / 1e12, "copy_tb_s": bandwidth / 1e12}
        for name, (num, inp, outp, seqs) in {"256x256x128": (256, 256, 128, 256),
                                              "1000x512x256": (1000, 512, 256, 256)}.items():
            prefill_s = num * inp * gemm_s_per_token
            rows = min(num, seqs)
            steps = num * (outp - 1) / rows  # decode steps (the first token comes with the prefill)
            decode_s = 0.0
            for j in range(outp - 1):  # a step at output position j: contexts inp + j (steady state)
                ctx = inp + j if num <= seqs else inp + (outp - 1) / 2
                b = wbytes + rows * ctx * f["kv_bytes_per_token"]
                fl = 2 * rows * (f["linear_params"] + f["lm_head_params"])
                decode_s += max(b / bandwidth, fl / rate) * steps / (outp - 1)
            rec_b[name] = {"prefill_s": prefill_s, "decode_s": decode_s,
                           "bound_tok_s": num * outp / (prefill_s + decode_s)}
        out[label] = rec_b
    return out


def profile(results: dict, device: str, smoke: bool, script: str, out: str, shape: dict) -> None:
    """Both engines, each in its own process; then the group table and the bounds."""
    prof = {}
    for label in ("bf16", "fp8"):
        cmd = [sys.executable, script, "--child", f"profile-one-{label}"] + (["--smoke"] if smoke else [])
        t0 = time.perf_counter()
        rc = subprocess.run(cmd, timeout=None if smoke else 75).returncode
        part = os.path.join(out, f"part-profile-one-{label}.json")
        if os.path.exists(part):
            with open(part) as f:
                prof.update(json.load(f).get("profile", {}))
        print(f"  profile {label}: rc {rc} in {time.perf_counter() - t0:.0f} s", flush=True)
    results["profile"] = prof
    print_group_table(prof)
    bw = copy_bandwidth(device)
    results["bounds"] = bounds(prof, shape, bw)
    for label, b in results["bounds"].items():
        print(f"  bound {label}: prefill GEMMs {b['gemm_tflops_prefill']:.0f} TFLOP/s, copy {b['copy_tb_s']:.2f} TB/s; "
              + "; ".join(f"{w} {v['bound_tok_s']:,.0f} tok/s (prefill {v['prefill_s']:.2f} s + decode "
                          f"{v['decode_s']:.2f} s)" for w, v in b.items() if isinstance(v, dict)), flush=True)


def group_table(prof: dict) -> list[str]:
    lines = []
    for phase in ("decode", "prefill", "batch1"):
        recs = {lab: r[phase] for lab, r in prof.items() if phase in r}
        if len(recs) < 2:
            continue
        b, f = recs.get("bf16"), recs.get("fp8")
        if not b or not f:
            continue
        groups = sorted(set(b["groups_us"]) | set(f["groups_us"]), key=lambda g: -b["groups_us"].get(g, 0.0))
        rows = [("device period", b["period_us"], f["period_us"]), ("kernels", b["kernel_us"], f["kernel_us"]),
                ("launch gaps", b["launch_gaps_us"], f["launch_gaps_us"]),
                ("host gaps in step", b["host_gaps_us"], f["host_gaps_us"]),
                ("between steps", b["between_steps_us"], f["between_steps_us"])]
        rows += [(g, b["groups_us"].get(g, 0.0), f["groups_us"].get(g, 0.0)) for g in groups]
        what = {"decode": f"decode step, {DECODE_ROWS} rows (graph)", "prefill": "prefill step (eager)",
                "batch1": "batch-1 decode step (graph; span = device time between the steps' first and last kernels)"
                }[phase]
        lines += ["", f"Profile, {what}: us per step", "", "| | bf16 | fp8 | fp8 / bf16 | fp8 - bf16 |",
                  "|---|---|---|---|---|"]
        for name, x, y in rows:
            lines.append(f"| {name} | {x:,.0f} | {y:,.0f} | {y / x if x else float('nan'):.2f} | {y - x:+,.0f} |")
        lines.append(f"| kernels per step | {b['kernels_per_step']:.0f} | {f['kernels_per_step']:.0f} | | |")
    return lines


def print_group_table(prof: dict) -> None:
    for line in group_table(prof):
        print("  " + line, flush=True)


# ---------------------------------------------------------------- w8a8 sweep

def gemm_variants(m: int, smoke: bool) -> list[tuple[int, ...]]:
    """(block_m, block_n, block_k, group_m, warps, stages) of the Triton fp8 GEMM to try at m rows."""
    if smoke:  # (block_k 32: the tiny K takes split-K too)
        return [(16, 32, 32, 2, 4, 2)]
    if m <= 64:
        return [(64, 64, 128, 1, 4, 4), (64, 128, 128, 1, 4, 4), (64, 64, 256, 1, 4, 3)]
    if m <= 1024:
        return [(64, 128, 128, 8, 4, 4), (128, 128, 128, 8, 8, 4), (64, 256, 128, 8, 8, 3), (128, 64, 128, 8, 4, 4),
                (128, 256, 128, 8, 8, 3)]
    return [(128, 256, 128, 8, 8, 3), (256, 128, 128, 8, 8, 3), (128, 128, 128, 8, 8, 4), (128, 256, 64, 8, 8, 4)]


def _splits(tiles: int, k: int, block_k: int, sms: int) -> list[int]:
    out = [1]
    for s in (2, 4, 8):
        if tiles * s <= 3 * sms and k // (s * block_k) >= 4 and tiles < 2 * sms:
            out.append(s)
    return out


def _compile_calls(device: str):
    from tokenmill.layers.quantization import fp8_ops
    from tokenmill.layers.quantization.triton_fp8_gemm import fp8_gemm

    n, k = 512, 2048
    wq, ws = fp8_ops.quantize_rows(torch.randn(n, k, device=device) * 0.02)
    xq, xs = fp8_ops.quantize_rows(torch.randn(300, k, device=device))
    counters = torch.zeros(4096, dtype=torch.int32, device=device)
    seen, calls = set(), []
    for m in (16, 256, 8192):
        for v in gemm_variants(m, False):
            for split in (1, 2):
                if (v, split) not in seen:
                    seen.add((v, split))
                    calls.append(lambda v=v, s=split: fp8_gemm(xq, xs, wq, ws, torch.bfloat16, *v, split=s,
                                                               counters=counters))
    return calls


def precompile_shard(shard: str) -> None:
    triton_precompile.compile_shard(_compile_calls("cuda"), shard)


def _precompile(shards: int = 12, timeout: float = 40.0) -> None:
    triton_precompile.compile_in_processes(__file__, "--precompile-w8a8", shards, timeout, "w8a8")


def w8a8(results: dict, device: str, time_ms, cycled, check) -> None:
    """time_ms(fn, device), cycled(tensors) and check(ok, what) come from gpu_quant.py."""
    from types import SimpleNamespace

    from tokenmill.layers.quantization import fp8_ops, stream_tiles
    from tokenmill.layers.quantization.fp8 import _w8a8_mm
    from tokenmill.layers.quantization.triton_fp8 import quantize_row_groups
    from tokenmill.layers.quantization.triton_fp8_gemm import fp8_gemm

    cuda = device == "cuda"
    shapes = SHAPES if cuda else SMOKE_SHAPES
    rows = (16, 32, 64, 128, 256, 512, 1024, 8192) if cuda else (16, 40)
    dt = torch.bfloat16 if cuda else torch.float32
    sms = stream_tiles.sm_count(torch.device(device))
    deadline = time.perf_counter() + float(os.environ.get("W8A8_BUDGET_S", "60"))
    if cuda:
        _precompile(timeout=min(40.0, 0.5 * float(os.environ.get("W8A8_BUDGET_S", "60"))))
    rec = results.setdefault("w8a8", {})
    best: dict = {}  # (bucket, n, k) -> (ms, choice)
    layer: dict = {}  # m -> {what: ms summed over the four linears}
    g = torch.Generator(device=device).manual_seed(0)
    one = torch.ones((), device=device)
    weights = {}
    for name, (n, k) in shapes.items():
        w = (torch.randn(n, k, device=device, generator=g) * 0.02).to(dt)
        wq, ws = fp8_ops.quantize_rows(w)
        weights[name] = (w, wq, ws, cycled([w]), cycled([wq, ws, ws.reshape(1, -1).contiguous()]),
                         stream_tiles.SplitCounters(n, torch.device(device)).tensor)
    # the decode and prefill row counts first (a budget cut loses the others)
    order = sorted(rows, key=lambda m: (m not in (256, 8192, 1024), m not in (64, 128, 512), m))
    for m in order:
        if time.perf_counter() > deadline:
            print(f"  w8a8: budget spent before m={m}", flush=True)
            break
        for name, (n, k) in shapes.items():
            w, wq, ws, bf16_w, fp8_w, counters = weights[name]
            x = torch.randn(m, k, device=device, dtype=dt, generator=g)
            xq, xs = quantize_row_groups(x, k) if cuda else fp8_ops.quantize_rows(x)
            ref = fp8_ops.scaled_mm_reference(xq, xs, wq, ws, torch.float32)
            r = {"bf16": time_ms(lambda: x @ bf16_w()[0].t(), device)}
            if cuda:
                r["quant"] = time_ms(lambda: quantize_row_groups(x, k), device)
                r["rowwise"] = time_ms(lambda: (lambda q, s, sr: torch._scaled_mm(
                    xq, q.t(), scale_a=xs, scale_b=sr, out_dtype=dt))(*fp8_w()), device)
                r["tensorwise"] = time_ms(lambda: (lambda q, s, sr: torch._scaled_mm(
                    xq, q.t(), scale_a=one, scale_b=one, out_dtype=dt).mul_(xs * sr))(*fp8_w()), device)
                lay = lambda q, s, sr: SimpleNamespace(weight=q, weight_scale=s, scale_row=sr, scale_one=one,
                                                       stream_counters=SimpleNamespace(tensor=counters))
                r["engine"] = time_ms(lambda: _w8a8_mm(lay(*fp8_w()), *quantize_row_groups(x, k), dt), device)
            for v in gemm_variants(m, not cuda):
                tiles = -(-m // v[0]) * -(-n // v[1])
                for split in _splits(tiles, k, v[2], sms):
                    label = "triton " + "x".join(map(str, v)) + f" s{split}"
                    try:
                        xin, win = (xq, wq) if cuda else (xq.float(), wq.float())
                        out = fp8_gemm(xin, xs, win, ws, dt, *v, split=split, counters=counters)
                        err = ((out.float() - ref).norm() / ref.norm()).item()
                        if err > 1e-2 or counters.any():
                            check(False, f"w8a8 {label} {name} m={m}: rel err {err:.1e}, counters zeroed "
                                         f"{not counters.any()}")
                            continue
                        r[label] = time_ms(lambda: (lambda q, s, _: fp8_gemm(
                            xin, xs, q if cuda else q.float(), s, dt, *v, split=split, counters=counters))(*fp8_w()),
                            device)
                    except Exception as e:  # noqa: BLE001 - a variant that fails is reported, not fatal
                        check(False, f"w8a8 {label} {name} m={m}: {type(e).__name__}: {str(e)[:200]}")
            rec[f"{name}_m{m}"] = r
            gemms = {key: v for key, v in r.items() if key in ("rowwise", "tensorwise") or key.startswith("triton")}
            win_label = min(gemms, key=gemms.get)
            bucket = stream_tiles.w8a8_bucket(m)
            choice = win_label if not win_label.startswith("triton") else tuple(
                int(t) for t in win_label.split()[1].split("x")) + (int(win_label.split()[2][1:]),)
            choice = {"rowwise": "scaled_mm"}.get(choice, choice) if isinstance(choice, str) else choice
            best[(bucket, n, k)] = (gemms[win_label], choice)
            t = layer.setdefault(m, {})
            for key in ("bf16", "quant", "rowwise", "engine"):
                if key in r:
                    t[key] = t.get(key, 0.0) + r[key]
            t["best_gemm"] = t.get("best_gemm", 0.0) + gemms[win_label]
            print(f"  w8a8 {name} {n}x{k} m={m}: bf16 {r['bf16'] * 1e3:.1f} us"
                  + (f", quant {r['quant'] * 1e3:.1f}, rowwise {r['rowwise'] * 1e3:.1f}, tensorwise "
                     f"{r['tensorwise'] * 1e3:.1f}, engine {r['engine'] * 1e3:.1f}" if cuda else "")
                  + "; best " + ", ".join(f"{lab} {v * 1e3:.1f}" for lab, v in sorted(gemms.items(), key=lambda kv: kv[1])[:3]),
                  flush=True)
    del weights
    if cuda:
        torch.cuda.empty_cache()
    results["w8a8_layer_us"] = {str(m): {k2: v * 1e3 for k2, v in t.items()} for m, t in layer.items()}
    for m, t in layer.items():
        print(f"  W8A8 layer m={m}: " + ", ".join(f"{k2} {v * 1e3:.0f} us" for k2, v in t.items())
              + (f" (best GEMM + quant {1e3 * (t['best_gemm'] + t.get('quant', 0)):.0f} vs bf16 {t['bf16'] * 1e3:.0f})"),
              flush=True)
    for (bucket, n, k), (ms, choice) in sorted(best.items()):
        print(f"  W8A8_MEASURED     ({bucket}, {n}, {k}): {choice!r},  # {ms * 1e3:.1f} us", flush=True)
    if cuda:
        fused_times(results, device, time_ms, check)
    gc.collect()


def fused_times(results: dict, device: str, time_ms, check=None) -> None:
    """RMSNorm (with its residual add) with the quantization fused, against the norm + quantization
    (and, with `check`, its output and codes bit for bit)."""
    from tokenmill.layers.quantization import fp8_ops
    from tokenmill.layers.quantization.triton_fp8 import quantize_row_groups
    from tokenmill.layers.quantization.triton_fp8_fused import rms_norm_quant
    from tokenmill.layers.triton_ops.rms_norm import fused_add_rms_norm, rms_norm

    rec = results.setdefault("fused_quant_us", {})
    bf = torch.bfloat16
    for m in (32, 256, 8192):
        x = torch.randn(m, 4096, device=device, dtype=bf)
        res = torch.randn(m, 4096, device=device)
        w = torch.ones(4096, device=device, dtype=bf)
        if check is not None:
            fused, ref = rms_norm_quant(x, None, w, 1e-5, bf), rms_norm(x, w, 1e-5)
            q, s = fp8_ops.attached(fused)
            rq, rs = quantize_row_groups(ref, ref.shape[1])
            check(torch.equal(fused, ref) and torch.equal(s, rs) and torch.equal(q.view(torch.uint8), rq.view(
                torch.uint8)), f"rms_norm_quant m={m}: output and codes = unfused + quantize_row_groups")
        r = {"norm": time_ms(lambda: fused_add_rms_norm(x, res, w, 1e-5), device),
             "norm+quant": time_ms(lambda: quantize_row_groups(fused_add_rms_norm(x, res, w, 1e-5)[0], 4096), device),
             "norm_quant fused": time_ms(lambda: rms_norm_quant(x, res, w, 1e-5, bf), device)}
        rec[str(m)] = {k: v * 1e3 for k, v in r.items()}
        print(f"  fused quant m={m}: " + ", ".join(f"{k} {v * 1e3:.1f} us" for k, v in r.items()), flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--precompile-w8a8":
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        os.environ["TRITON_INTERPRET"] = "0"
        precompile_shard(sys.argv[2])
