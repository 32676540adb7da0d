"""GPU checks and timings for the per-layer attention families (issue 20, part B), in one command.

Parts (default: all), each printing a table row and a JSON record under $OUT (default ./gpu-out):
  parity    every family of tests/helpers/tiny_models.FAMILY_ARCHS (windows, soft-caps, local
            rope bases, LongRoPE) on CUDA, float32, Triton + CUDA graphs, against HF float32 greedy
  bench     `tokenmill bench throughput` (dummy weights, bfloat16, Triton + graphs) at 256 prompts x
            256 in x 128 out and at batch 1 (512 in x 128 out) for Gemma-2-9B, Mistral-7B (4k window),
            Llama-3.1-8B, and Llama-with-Gemma-2-9B's-sizes (the soft-cap/window cost: Gemma 2 must be
            within 10% of it); output tok/s and the fraction of the physical bound (the bench's roofline)
  window    Mistral-7B shape with a 4096 window, 8 prompts of 16k tokens, 64 out: KV blocks held per
            request while decoding must stay <= 4096 / block_size + 2

    python scripts/gpu_families.py                 # on an H100: everything, under 8 minutes
    python scripts/gpu_families.py --parts parity  # one part
    python scripts/gpu_families.py --smoke         # on CPU: tiny shapes, to catch typos
    python scripts/gpu_families.py --parts bench --shapes gemma2_9b,gemma_sized_llama  # a subset
Exits non-zero when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tests.helpers.hf_reference import compare_greedy, hf_greedy  # noqa: E402
from tests.helpers.tiny_models import FAMILY_ARCHS, make_tiny_model_dir, make_tiny_tokenizer  # noqa: E402

OUT = os.environ.get("OUT", "./gpu-out")
_COMMON = dict(rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)
# Real models' shapes (HF config fields); "gemma_sized_llama" is Llama layers at Gemma-2-9B's sizes.
SHAPES = {
    "gemma2_9b": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        vocab_size=256000, hidden_size=3584, intermediate_size=14336, num_hidden_layers=42, num_attention_heads=16,
        num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256, sliding_window=4096,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, max_position_embeddings=8192,
        hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True, **_COMMON)),
    "gemma_sized_llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        vocab_size=256000, hidden_size=3584, intermediate_size=14336, num_hidden_layers=42, num_attention_heads=16,
        num_key_value_heads=8, head_dim=256, max_position_embeddings=8192, tie_word_embeddings=True, **_COMMON)),
    "mistral_7b": ("MistralConfig", "MistralForCausalLM", dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, sliding_window=4096, max_position_embeddings=32768, **_COMMON)),
    "llama31_8b": ("LlamaConfig", "LlamaForCausalLM", dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=131072, rope_theta=500000.0, **_COMMON)),
}
SMOKE_SIZES = dict(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2)


def config_dir(shape: str, smoke: bool, **overrides) -> str:
    import transformers
    config_cls, architecture, fields = SHAPES[shape]
    fields = {**fields, **(SMOKE_SIZES if smoke else {}), **overrides}
    if smoke and "head_dim" in fields:
        fields["head_dim"] = 16
    config = getattr(transformers, config_cls)(**fields)
    config.architectures = [architecture]
    path = tempfile.mkdtemp(prefix=f"{shape}-")
    config.save_pretrained(path)
    make_tiny_tokenizer().save_pretrained(path)
    return path


def parity(results: dict, failures: list[str], device: str) -> None:
    from transformers import AutoModelForCausalLM

    from tokenmill import LLM, SamplingParams
    rng = random.Random(0)
    # phi3-longrope: prompts past LongRoPE's original length (32), long factors from position 0,
    # prefilled in 16-token chunks, decoded by CUDA graphs.
    cases = [(arch, arch, {}, 64) for arch in FAMILY_ARCHS]
    cases.append(("phi3-longrope", "phi3", {"original_max_position_embeddings": 32}, 16))
    for label, arch, overrides, budget in cases:
        path = make_tiny_model_dir(arch, tempfile.mkdtemp(), **overrides)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
        hf = hf.to(device).eval()
        prompts = [[rng.randrange(3, 259) for _ in range(n)] for n in (3, 29, 45, 60)]
        refs = [hf_greedy(hf, p, 16) for p in prompts]
        engine = dict(dtype="float32", max_num_batched_tokens=budget, block_size=16)
        engine.update(gpu_memory_utilization=0.2) if device == "cuda" else engine.update(kv_cache_memory_gb=0.01)
        with LLM(path, **engine) as llm:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
        exact, notes = 0, []
        for i, (out, ref) in enumerate(zip(outs, refs)):
            try:
                note = compare_greedy(out.outputs[0].token_ids, ref, f"{label} prompt {i}")
            except AssertionError as exc:
                failures.append(str(exc).splitlines()[0])
                note = "MISMATCH"
            exact += note is None
            if note:
                notes.append(note)
        results[f"parity_{label}"] = {"exact": exact, "prompts": len(prompts), "notes": notes}
        print(f"parity {label:13s} exact {exact}/{len(prompts)} {'; '.join(notes)}", flush=True)


def measure_matmul_rate(device: str) -> float:
    """bf16 FLOP/s of a large matmul on the device (best of five), the compute ceiling."""
    if device != "cuda":
        return 1e11
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    a @ b
    best = 0.0
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            a @ b
        end.record()
        end.synchronize()
        best = max(best, 10 * 2 * 8192 ** 3 / (start.elapsed_time(end) / 1e3))
    return best


def physical_bound_tok_s(arch, num_prompts: int, input_len: int, output_len: int, bandwidth: float,
                         flops_rate: float, max_rows: int = 256) -> float:
    """Output tokens/s no engine can beat: prefill at the matmul rate; each decode step at
    max(bytes read / copy bandwidth, FLOPs / matmul rate), where a step reads every weight once
    and each row's KV (a sliding layer's only within its window)."""
    from tokenmill.benchmarks.roofline import kv_bytes_per_token, weight_bytes_read_per_step
    weights = weight_bytes_read_per_step(arch, "bfloat16")
    params = weights / 2
    kv_layer_token = kv_bytes_per_token(arch, "bfloat16") / arch.num_layers
    width = arch.num_heads * arch.head_dim

    windows = [arch.layer_spec(i).sliding_window for i in range(arch.num_layers)]

    def keys_seen(context: int) -> int:  # keys one query at `context` - 1 reads, summed over layers
        return sum(min(context, w or context) for w in windows)

    def keys_summed(length: int, w: int | None) -> int:  # sum over positions p < length of min(p + 1, w)
        w = w or length
        return length * (length + 1) // 2 if length <= w else w * (w + 1) // 2 + (length - w) * w

    prefill_flops = num_prompts * (2 * params * input_len + 4 * width * sum(keys_summed(input_len, w) for w in windows))
    seconds = prefill_flops / flops_rate
    waves = -(-num_prompts // max_rows)
    rows = min(num_prompts, max_rows)
    for step in range(output_len):
        keys = keys_seen(input_len + step + 1)
        step_bytes = weights + rows * keys * kv_layer_token
        step_flops = 2 * params * rows + rows * 4 * width * keys
        seconds += waves * max(step_bytes / bandwidth, step_flops / flops_rate)
    return num_prompts * output_len / seconds


def bench(results: dict, failures: list[str], smoke: bool, shapes: list[str]) -> None:
    from transformers import AutoConfig

    from tokenmill.benchmarks.roofline import measure_copy_bandwidth
    from tokenmill.model.arch import model_arch
    device = "cuda" if torch.cuda.is_available() and not smoke else "cpu"
    bandwidth = measure_copy_bandwidth() if device == "cuda" else 1e10
    flops_rate = measure_matmul_rate(device)
    results["measured"] = {"copy_bandwidth_GBps": bandwidth / 1e9, "bf16_matmul_TFLOPs": flops_rate / 1e12}
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s, bf16 matmul {flops_rate / 1e12:.0f} TFLOP/s", flush=True)
    runs = [(256, 256, 128), (1, 512, 128)] if not smoke else [(4, 32, 8), (1, 32, 8)]
    for shape in shapes:
        path = config_dir(shape, smoke)
        arch = model_arch(AutoConfig.from_pretrained(path))
        for num_prompts, input_len, output_len in runs:
            key = f"bench_{shape}_{num_prompts}x{input_len}x{output_len}"
            record = os.path.join(OUT, key + ".json")
            argv = [sys.executable, "-m", "tokenmill.cli", "--log-level", "WARNING", "bench", "throughput",
                    "--model", path, "--load-format", "dummy", "--dtype", "float32" if smoke else "bfloat16",
                    "--num-prompts", str(num_prompts), "--input-len", str(input_len),
                    "--output-len", str(output_len), "--ignore-eos",
                    "--max-model-len", str(input_len + output_len + 16), "--output-json", record]
            start = time.perf_counter()
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
            proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True)
            if proc.returncode != 0 or not os.path.exists(record):
                failures.append(f"{key}: bench failed: {proc.stderr[-1500:]}")
                results[key] = {"error": proc.stderr[-2000:]}
                continue
            with open(record) as f:
                rec = json.load(f)
            tm = rec.get("tokenmill") or {}
            tok_s = tm.get("output_tokens_per_s") or 0.0
            bound = physical_bound_tok_s(arch, num_prompts, input_len, output_len, bandwidth, flops_rate)
            decode_fraction = (rec.get("roofline") or {}).get("fraction_of_roofline_step_p50")
            results[key] = {"output_tok_s": tok_s, "physical_bound_tok_s": bound, "fraction_of_bound": tok_s / bound,
                            "decode_step_fraction_of_roofline": decode_fraction, "roofline": rec.get("roofline"),
                            "seconds": time.perf_counter() - start}
            print(f"{key:45s} {tok_s:9.1f} out tok/s  bound {bound:9.1f}  fraction {tok_s / bound:6.1%}  "
                  f"decode step vs roofline {decode_fraction}  [{time.perf_counter() - start:.0f} s]", flush=True)
    for num_prompts, input_len, output_len in runs:
        tag = f"{num_prompts}x{input_len}x{output_len}"
        gemma = (results.get(f"bench_gemma2_9b_{tag}") or {}).get("output_tok_s")
        llama = (results.get(f"bench_gemma_sized_llama_{tag}") or {}).get("output_tok_s")
        if gemma and llama:
            ratio = gemma / llama
            results[f"gemma2_vs_equal_llama_{tag}"] = ratio
            print(f"Gemma 2 / equal-sized Llama at {tag}: {ratio:.3f}", flush=True)
            if not smoke and ratio < 0.9:
                failures.append(f"Gemma 2 costs more than 10% over an equal-sized Llama at {tag}: {ratio:.3f}")


def window_blocks(results: dict, failures: list[str], smoke: bool, device: str) -> None:
    from tokenmill import LLM
    window, prompt_len, num_prompts, out_len, block_size = (4096, 16384, 8, 64, 16) if not smoke else (24, 100, 3, 12, 4)
    path = config_dir("mistral_7b", smoke, sliding_window=window)
    engine = dict(load_format="dummy", dtype="float32" if smoke else "bfloat16", block_size=block_size,
                  max_model_len=prompt_len + out_len + 16, single_process=True, max_num_batched_tokens=8192)
    engine.update(kv_cache_memory_gb=0.05) if device == "cpu" else None
    with LLM(path, **engine) as llm:
        _decode_with_window(llm, results, failures, window, prompt_len, num_prompts, out_len, block_size)


def _decode_with_window(llm, results, failures, window, prompt_len, num_prompts, out_len, block_size) -> None:
    from tokenmill import SamplingParams
    scheduler = llm.engine.scheduler
    held: list[int] = []
    schedule = scheduler.schedule

    def observed():
        out = schedule()
        t = scheduler.table
        for slot in t.order.tolist():
            if t.num_computed[slot] > t.num_prompt[slot]:
                held.append(scheduler.kv.num_held(int(t.handle[slot])))
        return out

    scheduler.schedule = observed
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 259) for _ in range(prompt_len)]} for _ in range(num_prompts)]
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True), use_tqdm=False)
    bound = window // block_size + 2
    results["window_blocks"] = {"window": window, "block_size": block_size, "prompt_len": prompt_len,
                                "max_held_while_decoding": max(held, default=None), "bound": bound,
                                "full_context_blocks": -(-(prompt_len + out_len) // block_size),
                                "pool_blocks": scheduler.kv.num_blocks, "seconds": time.perf_counter() - start}
    print(f"window: blocks held per decoding request <= {max(held, default=None)} (bound {bound}; "
          f"the whole context would take {-(-(prompt_len + out_len) // block_size)})", flush=True)
    if not held or max(held) > bound:
        failures.append(f"window: a decoding request held {max(held, default=None)} blocks > {bound}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="parity,bench,window")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: checks the script runs")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="bench: which shapes (comma-separated)")
    args = ap.parse_args()
    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    os.makedirs(OUT, exist_ok=True)
    results: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}
    failures: list[str] = []
    for part in args.parts.split(","):
        start = time.perf_counter()
        if part == "parity":
            parity(results, failures, device)
        elif part == "bench":
            bench(results, failures, args.smoke, args.shapes.split(","))
        elif part == "window":
            window_blocks(results, failures, args.smoke, device)
        else:
            raise SystemExit(f"unknown part {part!r}")
        print(f"[{part}: {time.perf_counter() - start:.0f} s]", flush=True)
    results["failures"] = failures
    with open(os.path.join(OUT, "gpu_families.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    print("\nFAILURES:\n" + "\n".join(failures) if failures else "\nall checks passed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
