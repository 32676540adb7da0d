"""`tokenmill bench throughput`: offline throughput on a fixed workload, optionally against HF transformers.

Prints requests/s, output tokens/s, total tokens/s and time per output token (and, with
`--speculative-config`, the timed run's speculative decoding figures), and writes a JSON
record naming the workload, the machine, the versions and the baseline that ran beside it in
the same process.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time

import numpy as np

from tokenmill.benchmarks.record import machine_info, versions
from tokenmill.config import add_engine_flags, engine_args_from_flags
from tokenmill.metrics.spec_decode import format_spec_figures, spec_figures

_TEXT = ("In the quiet valley the river bends twice before it reaches the old mill, where the wheel "
         "still turns on spring mornings. Travellers stop to watch the water, talk about the harvest, "
         "and argue about the best road to the coast. ")


def add_parser(sub) -> None:
    p = sub.add_parser("throughput", help="offline throughput of LLM.generate on a fixed workload",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=64, help="generated tokens per request")
    p.add_argument("--dataset", choices=["random", "text"], default="random",
                   help="random token ids, or slices of a built-in English text")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --output-len tokens")
    p.add_argument("--baseline", choices=["none", "hf"], default="none",
                   help="also run Hugging Face transformers' generate on the same prompts")
    p.add_argument("--hf-dtype", default="bfloat16", help="dtype of the HF baseline")
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed passes of the whole workload before the timed one (the HF baseline gets as many)")
    p.add_argument("--output-json", default=None, help="write the JSON record here")
    p.add_argument("--profile", default=None, metavar="PATH",
                   help="profile the timed run with cProfile and write the top functions to PATH "
                        "(single-process mode shows the model; otherwise only the front-end)")
    add_engine_flags(p)
    p.set_defaults(func=run)


def make_prompts(tokenizer, kind: str, num: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    if kind == "random":
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        pool = [t for t in range(min(vocab_size, len(tokenizer))) if t not in special]
        return [[rng.choice(pool) for _ in range(length)] for _ in range(num)]
    ids = tokenizer(_TEXT * (length // 30 + 4)).input_ids
    out = []
    for _ in range(num):
        start = rng.randrange(0, max(1, len(ids) - length))
        out.append(ids[start:start + length])
    return out


def run(ns) -> int:
    from tokenmill.entrypoints.llm import LLM
    from tokenmill.sampling_params import SamplingParams

    engine_args = engine_args_from_flags(ns, ns.model)
    llm = LLM(**dataclasses.asdict(engine_args))
    tokenizer = llm.get_tokenizer()
    vocab = llm.config.model.vocab_size
    prompts = make_prompts(tokenizer, ns.dataset, ns.num_prompts, ns.input_len, vocab)
    params = SamplingParams(temperature=0.0, max_tokens=ns.output_len, ignore_eos=ns.ignore_eos)
    batch = [{"prompt_token_ids": p} for p in prompts]
    # Warm-up passes run the workload's shapes (same counts and lengths) on other prompts: the
    # timed pass must not find its prompts in the prefix cache.
    warm_runs = []
    for i in range(ns.warmup):
        warm = make_prompts(tokenizer, ns.dataset, ns.num_prompts, ns.input_len, vocab, seed=i + 1)
        llm.reset_telemetry()
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in warm], params, use_tqdm=False)
        warm_runs.append(summarize(outputs, time.perf_counter() - start, ns.input_len))
        warm_runs[-1].update(step_figures(llm.telemetry(), llm.config.parallel.driver_rank))
        print(f"warm-up pass {i + 1}: {warm_runs[-1]['output_tokens_per_s']:.1f} output tok/s")
    profiler = None
    if ns.profile:
        import cProfile
        profiler = cProfile.Profile()
        profiler.enable()
    llm.reset_telemetry()
    before = llm.scheduler_stats()
    start = time.perf_counter()
    outputs = llm.generate(batch, params)
    elapsed = time.perf_counter() - start
    after = llm.scheduler_stats()
    if profiler is not None:
        profiler.disable()
        write_profile(profiler, ns.profile)
    figures = summarize(outputs, elapsed, ns.input_len)
    report = llm.telemetry()
    figures.update(step_figures(report, llm.config.parallel.driver_rank))
    if llm.config.parallel.pipeline_parallel_size > 1:
        from tokenmill.metrics.pipeline import pipeline_figures
        figures["pipeline"] = pipeline_figures(report, llm.config.parallel)
    figures["prefix_cache_hit_tokens"] = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    if report.speculation is not None:  # the timed run's (the telemetry was reset before it)
        figures["speculative_decoding"] = spec_figures(report.speculation)
    record = {
        "benchmark": "throughput",
        "workload": {"model": ns.model, "num_prompts": ns.num_prompts, "input_len": ns.input_len,
                     "output_len": ns.output_len, "dataset": ns.dataset, "ignore_eos": ns.ignore_eos,
                     "sampling": "greedy"},
        "engine_args": dataclasses.asdict(engine_args),
        "machine": machine_info(), "versions": versions(),
        "tokenmill": figures,
        "tokenmill_warmup_passes": warm_runs,
    }
    if warm_runs:
        record["first_over_timed_run"] = warm_runs[0]["output_tokens_per_s"] / figures["output_tokens_per_s"]
    print_figures("tokenmill", figures)
    config = llm.config
    if not config.device.startswith("cuda"):
        record["cpu"] = cpu_figures(config.model.dtype)
        print_cpu(record["cpu"])
    llm.shutdown()
    if config.device.startswith("cuda"):
        record["roofline"] = roofline_figures(config, ns, figures)
        print_roofline(record["roofline"])
    if ns.baseline == "hf":
        from tokenmill.benchmarks.hf_baseline import run_hf_generate
        hf = run_hf_generate(config.model, prompts, ns.output_len, ns.hf_dtype, ns.ignore_eos,
                             warmup_passes=max(ns.warmup, 1))
        record["baseline"] = hf
        print_figures(f"HF transformers ({ns.hf_dtype}, static batch, warmed)", hf)
        ratio = figures["output_tokens_per_s"] / hf["output_tokens_per_s"]
        record["ratio_output_tokens_per_s"] = ratio
        print(f"tokenmill / HF output tokens/s: {ratio:.2f}x")
    print(json.dumps(record))
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(record, f, indent=2)
    return 0


def cpu_figures(dtype: str) -> dict:
    """The CPU the figures came from: model, the flags that decide the kernel path, the path, the dtype."""
    from tokenmill.benchmarks.record import machine_info
    from tokenmill.layers import cpu_isa
    info = machine_info()
    return {"cpu_model": info["cpu_model"], "cpu_flags": info["cpu_flags"],
            "kernel_path": cpu_isa.kernel_path().name, "dtype": dtype, "threads": info["torch_threads"]}


def print_cpu(c: dict) -> None:
    print(f"  CPU {c['cpu_model']} ({c['threads']} threads), flags: {' '.join(c['cpu_flags']) or '-'}; "
          f"kernel path {c['kernel_path']}, {c['dtype']}")


def step_figures(report, driver_rank: int = 0) -> dict:
    """The driver worker's per-step device time and idle gaps (CUDA events), and the core's step time."""
    worker = next((p for p in report.processes if p.role == f"worker{driver_rank}"), None)
    out = {}
    if worker is not None:
        for name in ("device_step", "device_idle", "forward", "prepare", "sample"):
            t = worker.timings.get(name)
            if t is not None and t.count:
                out[f"{name}_ms_p50"], out[f"{name}_ms_p99"] = t.p50_us / 1e3, t.p99_us / 1e3
                out[f"{name}_ms_mean"], out[f"{name}_count"] = t.mean_us / 1e3, t.count
    if "device_step_ms_p50" in out and "device_idle_ms_p50" in out:
        out["device_idle_fraction_p50"] = out["device_idle_ms_p50"] / out["device_step_ms_p50"]
    return out


def roofline_figures(config, ns, figures: dict) -> dict:
    """Decode at full batch: the floor step time over the measured p50 device step time.

    The device step is rank 0's: with tensor parallelism each GPU reads 1/tp of the weights and
    of the KV; with pipeline parallelism a stage step runs one micro-batch (1/pp of the rows)
    through 1/pp of the layers. So a GPU's floor step is (weights + KV of a micro-batch's rows) /
    (tp * pp) over the bandwidth, and one micro-batch's tokens come out per stage step."""
    from tokenmill.benchmarks.roofline import decode_roofline, measure_copy_bandwidth
    bandwidth = measure_copy_bandwidth()
    tp, pp = config.parallel.tensor_parallel_size, config.parallel.pipeline_parallel_size
    batch = min(ns.num_prompts, config.scheduler.max_num_seqs)
    batches = max(pp, config.scheduler.pp_microbatches) if pp > 1 else 1
    rows = batch / batches  # per micro-batch
    roof = decode_roofline(config.model.arch, config.model.dtype, bandwidth, rows)
    context = ns.input_len + ns.output_len / 2
    floor_s = roof.step_time_s(rows, context) / (tp * pp)
    out = {"bandwidth_GBps": bandwidth / 1e9, "weight_GB": roof.weight_bytes / 1e9,
           "kv_bytes_per_token": roof.kv_bytes_per_token, "batch": batch, "mean_context": context,
           "gpus": tp * pp, "rows_per_micro_batch": rows,
           "floor_step_ms": floor_s * 1e3, "roofline_output_tokens_per_s": rows / floor_s}
    step = figures.get("device_step_ms_p50")
    if step:
        out["fraction_of_roofline_step_p50"] = floor_s * 1e3 / step
    return out


def print_roofline(r: dict) -> None:
    print("== decode roofline ==")
    print(f"  copy bandwidth     {r['bandwidth_GBps']:.0f} GB/s (read + write)")
    print(f"  weights read/step  {r['weight_GB']:.2f} GB; KV {r['kv_bytes_per_token']} B/token")
    gpus = r.get("gpus", 1)
    where = f" per GPU ({gpus} GPUs, {r['rows_per_micro_batch']:.0f} rows per micro-batch)" if gpus > 1 else ""
    print(f"  floor step at batch {r['batch']}, context {r['mean_context']:.0f}{where}: {r['floor_step_ms']:.2f} ms")
    if "fraction_of_roofline_step_p50" in r:
        print(f"  fraction reached (p50 step)   {r['fraction_of_roofline_step_p50']:.1%}")


def write_profile(profiler, path: str) -> None:
    import io
    import pstats
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    for key in ("tottime", "cumulative"):
        text.write(f"==== top 40 by {key} ====\n")
        stats.sort_stats(key).print_stats(40)
    with open(path, "w") as f:
        f.write(text.getvalue())
    print(f"profile written to {path}")


def summarize(outputs, elapsed: float, input_len: int) -> dict:
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    tpot = []
    for o in outputs:
        n = len(o.outputs[0].token_ids)
        m = o.metrics
        if n > 1 and "first_token_time" in m and "last_token_time" in m:
            tpot.append((m["last_token_time"] - m["first_token_time"]) / (n - 1))
    tpot_ms = np.array(tpot) * 1e3 if tpot else np.array([float("nan")])
    return {
        "elapsed_s": elapsed,
        "requests_per_s": len(outputs) / elapsed,
        "output_tokens_per_s": num_out / elapsed,
        "total_tokens_per_s": (num_out + input_len * len(outputs)) / elapsed,
        "num_output_tokens": num_out,
        "tpot_ms_mean": float(np.mean(tpot_ms)), "tpot_ms_p50": float(np.percentile(tpot_ms, 50)),
        "tpot_ms_p99": float(np.percentile(tpot_ms, 99)),
    }


def print_figures(name: str, f: dict) -> None:
    print(f"== {name} ==")
    print(f"  elapsed            {f['elapsed_s']:.2f} s")
    print(f"  requests/s         {f['requests_per_s']:.2f}")
    print(f"  output tokens/s    {f['output_tokens_per_s']:.1f}")
    print(f"  total tokens/s     {f['total_tokens_per_s']:.1f}")
    if "prefix_cache_hit_tokens" in f:
        print(f"  prefix-cache hits  {f['prefix_cache_hit_tokens']} tokens")
    if "tpot_ms_mean" in f:
        print(f"  TPOT ms mean/p50/p99  {f['tpot_ms_mean']:.2f} / {f['tpot_ms_p50']:.2f} / {f['tpot_ms_p99']:.2f}")
    if "device_step_ms_p50" in f:
        print(f"  device step ms p50/p99  {f['device_step_ms_p50']:.3f} / {f['device_step_ms_p99']:.3f}")
    if "device_idle_ms_p50" in f:
        print(f"  device idle ms p50/mean  {f['device_idle_ms_p50']:.3f} / {f['device_idle_ms_mean']:.3f}"
              + (f"  ({f['device_idle_fraction_p50']:.1%} of a step)" if "device_idle_fraction_p50" in f else ""))
    if "pipeline" in f:
        from tokenmill.metrics.pipeline import format_pipeline
        print("  pipeline stages (TP rank 0 of each):")
        print(format_pipeline(f["pipeline"]))
    if "speculative_decoding" in f:
        print(format_spec_figures(f["speculative_decoding"]))
