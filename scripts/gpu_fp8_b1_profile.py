"""The `b1profile` part of scripts/gpu_quant.py: where a batch-1 decode step's time goes, fp8 beside bf16.

One process, engines built one after the other as the `fp8engines` part builds them (Llama-3.1-8B
shape, dummy weights, graphs on, prefix caching off), each shut down before the next
(B1_ENGINES, default fp8,bf16,fp8nopdl: fp8 W8A8, bf16, and fp8 with programmatic dependent launch
off, built with max_num_seqs 1 for a shorter start-up):
1. each engine's batch-1 ms per output token (`gpu_quant.ms_per_token`: 512-token prompt, 256
   tokens), the goal's figure, bf16's measured in the same process, and 32 greedy tokens of one
   prompt: every fp8 engine's must be the same (PDL changes no arithmetic; B1_TOKENS_PLANT=1
   gives the later engines another prompt, so the check must fail);
2. during its warm-up run, a torch.profiler window over STEPS graph-replayed batch-1 decode
   steps (`worker/device_profile`): the step's period, busy and idle time and kernel groups
   (`benchmarks/step_profile`), and per kernel and slot (qkv / o / gate_up / down of the one
   GEMV kernel, the LM head as its tail) what it adds to the step when PDL overlaps kernels
   (`benchmarks/step_path`);
3. unless B1_GEMVS=0, each fp8 linear at one row on its own (CUDA-graph replays, weights cycled
   past L2) with the engine's tiles: microseconds and the fraction of this card's copy bandwidth.
B1_MAX_SEQS=1 builds the engines with one decode graph (a shorter start-up). Every figure is
written to $OUT/part-b1profile-partial.json as it comes.
"""

from __future__ import annotations

import gc
import json
import os
import time
import traceback

import torch

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
SMOKE_SHAPES = {"qkv": (256, 128), "o": (128, 128), "gate_up": (512, 128), "down": (128, 256), "lm_head": (320, 128)}
SKIP, STEPS = 40, 24  # decode steps before the window, and in it (all inside the 256-token warm-up run)


def _save(results: dict, out: str) -> None:
    with open(os.path.join(out, "part-b1profile-partial.json"), "w") as f:
        json.dump(results, f, indent=2)


def _engine(config_dir, shape, smoke: bool, label: str, window: dict):
    from tokenmill import LLM
    from tokenmill.layers.triton_ops import pdl
    from tokenmill.worker.device_profile import ENV_VAR

    kwargs = {"quantization": "fp8"} if label.startswith("fp8") else {}
    extra = dict(device="cpu", enforce_eager=True, kv_cache_memory_gb=0.05) if smoke else {}
    os.environ[ENV_VAR] = json.dumps(window)  # read by the worker when it starts (a child inherits it)
    # fp8nopdl: fp8 with programmatic dependent launch off (its tokens are the reference)
    before = os.environ.get(pdl.ENV_VAR)
    if label == "fp8nopdl":
        os.environ[pdl.ENV_VAR], pdl.FORCE = "0", False
    if os.environ.get("B1_MAX_SEQS"):  # fewer decode graphs to capture (a shorter start-up)
        extra["max_num_seqs"] = int(os.environ["B1_MAX_SEQS"])
    if label == "fp8nopdl":  # the tokens' reference: one decode graph (its PDL-off kernels compile anew)
        extra["max_num_seqs"] = 1
    try:
        start = time.perf_counter()
        # as gpu_fp8_engines._engine builds the goal's engines (max_model_len 16k + 272)
        llm = LLM(config_dir(shape), load_format="dummy", dtype="bfloat16",
                  max_model_len=(1024 if smoke else 16384) + 272, disable_log_stats=True,
                  enable_prefix_caching=False, **kwargs, **extra)
    finally:
        os.environ.pop(ENV_VAR, None)
        pdl.FORCE = None
        os.environ.pop(pdl.ENV_VAR, None)
        if before is not None:
            os.environ[pdl.ENV_VAR] = before
    print(f"  {label}: engine up in {time.perf_counter() - start:.0f} s", flush=True)
    return llm, time.perf_counter() - start


def _greedy_tokens(llm, prompt_len: int, n: int = 32, seed: int = 11) -> list[int]:
    from tokenmill import SamplingParams

    import gpu_quant
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)
    out = llm.generate(gpu_quant._prompts(1, prompt_len, seed=seed), params, use_tqdm=False)[0]
    return list(out.outputs[0].token_ids)


def _free(llm) -> None:
    llm.shutdown()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _profile(rec: dict, label: str, folder: str, layers: int) -> None:
    from tokenmill.benchmarks import step_path, step_profile

    path = os.path.join(folder, "rank0.json")
    if not os.path.exists(path):
        print(f"  {label}: no profile window written ({path})", flush=True)
        return
    with open(path) as f:
        record = json.load(f)
    a = step_profile.analyze(record)
    rec["step"] = {k: v for k, v in a.items() if k != "kernels"}
    rec["kernels"] = a["kernels"]
    print(step_profile.format_report(f"{label} batch-1 decode step", a, top=12), flush=True)
    try:
        p = step_path.attribute(record, layers)
    except ValueError as exc:  # (CPU smoke: no markers)
        print(f"  {label}: {exc}", flush=True)
        return
    rec["path"] = p
    print(f"{label}: what each kernel adds to the step (PDL overlap charged once)", flush=True)
    print(step_path.format_table(p, top=24), flush=True)


def _gemvs(results: dict, device: str, smoke: bool, time_ms, cycled) -> None:
    """Each fp8 linear at one row with the engine's tiles, against this card's copy bandwidth."""
    from tokenmill.layers.quantization import fp8_ops, stream_tiles
    from tokenmill.layers.quantization.triton_fp8_stream import fp8_stream_gemm

    rec = results.setdefault("b1_gemvs", {})
    if device == "cuda":
        a = torch.empty(1 << 30, dtype=torch.uint8, device=device)
        b = torch.empty_like(a)
        rec["copy_tb_s"] = 2 * a.numel() / (time_ms(lambda: b.copy_(a), device, reps=5) * 1e-3) / 1e12
        del a, b
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    counters = stream_tiles.SplitCounters(128256, torch.device(device)).tensor
    for name, (n, k) in (SMOKE_SHAPES if smoke else SHAPES).items():
        q, s = fp8_ops.quantize_rows(torch.randn(n, k, device=device) * 0.02)
        x = torch.randn(1, k, device=device, dtype=dt)
        weights = cycled([q, s])
        out_dtype = torch.float32 if name == "lm_head" else None
        t = stream_tiles.fp8_tiles(1, n, k, None, stream_tiles.sm_count(torch.device(device)))

        def call(t=t, weights=weights, out_dtype=out_dtype):
            w, sc = weights()
            fp8_stream_gemm(x, w, sc, None, counters, tiles=t, out_dtype=out_dtype)
        us = 1e3 * time_ms(call, device)
        bytes_ = n * k + 4 * n
        row = {"tiles": t.label(), "us": us, "fp8_bytes": bytes_}
        if "copy_tb_s" in rec:
            row["fraction_of_copy"] = bytes_ / (us * 1e-6) / (rec["copy_tb_s"] * 1e12)
        rec[name] = row
        print(f"  {name} {n}x{k} {t.label()}: {us:.1f} us"
              + (f" ({row['fraction_of_copy']:.0%} of copy)" if "fraction_of_copy" in row else ""), flush=True)
        del q, s


def profile_part(results: dict, device: str, smoke: bool, shape: dict, config_dir, out: str, ms_per_token,
                 time_ms, cycled, check) -> None:
    """The part (module docstring); raises at the end if an engine or the GEMV timing failed."""
    scale = (lambda n: max(1, n // 64)) if smoke else (lambda n: n)
    skip, steps = (2, 3) if smoke else (SKIP, STEPS)
    timings = results.setdefault("timings", {})
    results["b1_device"] = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"  b1profile on {results['b1_device']}", flush=True)  # (the part's record names the card too)
    tokens: dict[str, list[int]] = {}
    failed = []
    for label in os.environ.get("B1_ENGINES", "fp8,bf16,fp8nopdl").split(","):
        folder = os.path.join(out, f"b1profile_{label}")
        window = {"out_dir": folder, "batch": 1, "skip": skip, "steps": steps}
        try:
            llm, up = _engine(config_dir, shape, smoke, label, window)
            t0 = time.perf_counter()
            ms = ms_per_token(llm, scale(512), scale(256) if not smoke else 8)
            timings.setdefault(label, {})["batch1"] = ms
            timings[label]["engine_up_s"] = up
            # B1_TOKENS_PLANT=1: engines after the first read another prompt (the check must fail)
            planted = os.environ.get("B1_TOKENS_PLANT") == "1" and bool(tokens)
            tokens[label] = _greedy_tokens(llm, scale(512), seed=12 if planted else 11)
            print(f"  {label} batch1: {ms:.3f} ms/token ({time.perf_counter() - t0:.0f} s)", flush=True)
            _save(results, out)
            _free(llm)
            _profile(results.setdefault("b1profile", {}).setdefault(label, {}), label, folder,
                     shape["num_hidden_layers"])
        except Exception:  # noqa: BLE001 - the next engine still runs; the part fails at the end
            traceback.print_exc()
            failed.append(label)
        _save(results, out)
    fp8_runs = {k: v for k, v in tokens.items() if k.startswith("fp8")}
    if len(fp8_runs) > 1:  # PDL changes no arithmetic: the same greedy tokens
        first = next(iter(fp8_runs))
        for label, toks in fp8_runs.items():
            check(toks == fp8_runs[first], f"{label}: the same {len(toks)} greedy tokens as {first}")
    results["b1_tokens"] = tokens
    for label in ("fp8", "fp8nopdl"):
        if label in timings and "bf16" in timings:
            r = timings[label]["batch1"] / timings["bf16"]["batch1"]
            results.setdefault("b1_ratio", {})[label] = r
            print(f"  {label} / bf16 batch-1 ms/token: {timings[label]['batch1']:.3f} / "
                  f"{timings['bf16']['batch1']:.3f} = {r:.3f} (goal <= 0.6)", flush=True)
    _save(results, out)
    if os.environ.get("B1_GEMVS", "1") == "0":
        if failed:
            raise RuntimeError(f"b1profile: {failed} failed")
        return
    try:
        _gemvs(results, device, smoke, time_ms, cycled)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        failed.append("gemvs")
    _save(results, out)
    if failed:
        raise RuntimeError(f"b1profile: {failed} failed")
