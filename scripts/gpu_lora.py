"""Multi-LoRA on CUDA in one command: checks, then timings against the base model in the same run.
Prints a table per part, writes $OUT/gpu_lora.json (default ./gpu-out), exits 1 on a failed check.

Parts (--parts, comma-separated; default all):
  kernels    the Triton shrink/expand kernels vs the torch reference in bfloat16 on Llama-3.1-8B
             projection shapes (1 to 2048 tokens, 1/8/64 adapters mixed, tokens without one), and
             their time next to the base projection's GEMM
  tiny       a tiny random Llama, float32, CUDA graphs on (and eager): base and three adapters mixed
             in one batch vs HF + PEFT greedy; again with one slot (eviction and reload mid-run)
  throughput Llama-3.1-8B shape, dummy weights, rank-16 adapters on all seven projections (random,
             written here as PEFT folders): 1000 prompts x 512 in x 256 out, the base engine vs the
             LoRA engine (max_loras=64) with 1, 8 and 64 adapters mixed uniformly; goals 0.90x,
             0.85x, 0.80x the base's output tok/s
  batch1     one prompt, 512 in x 256 out: ms per output token, base engine vs an adapter (goal <= 1.10x)

    python scripts/gpu_lora.py                      # everything, on an H100 (under 8 minutes)
    python scripts/gpu_lora.py --parts kernels,tiny
    python scripts/gpu_lora.py --smoke              # CPU: tiny shapes, Triton interpreter, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

SMOKE = "--smoke" in sys.argv
if SMOKE:  # the kernels run under Triton's interpreter on CPU (read when they are defined)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))

from scripts.device_check import SHAPES, config_dir  # noqa: E402
from tokenmill.benchmarks.throughput import make_prompts, summarize  # noqa: E402

OUT = os.environ.get("OUT", os.path.join(os.getcwd(), "gpu-out"))
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GOALS = {1: 0.90, 8: 0.85, 64: 0.80}
FAILED: list[str] = []


def check(ok: bool, what: str) -> bool:
    print(f"  [{'ok' if ok else 'FAIL'}] {what}")
    if not ok:
        FAILED.append(what)
    return ok


# ---------------------------------------------------------------- adapters

def write_adapter(path: str, shape: dict, rank: int, seed: int, dtype=torch.bfloat16) -> str:
    """A random PEFT folder of rank `rank` on all seven projections of every layer."""
    from safetensors.torch import save_file

    h, inter = shape["hidden_size"], shape["intermediate_size"]
    heads, kv = shape["num_attention_heads"], shape["num_key_value_heads"]
    hd = shape.get("head_dim") or h // heads
    dims = {"q_proj": (h, heads * hd), "k_proj": (h, kv * hd), "v_proj": (h, kv * hd), "o_proj": (heads * hd, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(shape["num_hidden_layers"]):
        for name, (fan_in, fan_out) in dims.items():
            part = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{name}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=g) / fan_in ** 0.5).to(dtype)
            tensors[f"{key}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=g) * 0.02).to(dtype)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS),
                   "bias": "none"}, f)
    return path


# ---------------------------------------------------------------- kernels

def kernels(results: dict) -> None:
    from tokenmill.layers.lora.torch_lora import lora_reference
    from tokenmill.layers.lora.triton_lora import lora_expand, lora_shrink

    device = "cpu" if SMOKE else "cuda"
    dtype = torch.float32 if SMOKE else torch.bfloat16
    s = SHAPES["llama8b"]
    h, inter, q, kv = s["hidden_size"], s["intermediate_size"], 4096, 1024
    projections = {"qkv": (h, [q, kv, kv]), "o": (q, [h]), "gate_up": (h, [inter, inter]), "down": (inter, [h])}
    token_counts, adapter_counts, rank = (1, 16, 256, 2048), (1, 8, 64), 16
    if SMOKE:
        projections = {"qkv": (64, [64, 32, 32]), "down": (96, [64])}
        token_counts, adapter_counts = (1, 24), (1, 4)
    rows = []
    g = torch.Generator(device=device).manual_seed(0)
    for proj, (k, parts) in projections.items():
        starts = tuple(int(v) for v in torch.tensor([0] + parts).cumsum(0))
        n = starts[-1]
        slots = max(adapter_counts)
        a = (torch.randn(slots, len(parts) * rank, k, generator=g, device=device) / k ** 0.5).to(dtype)
        b = (torch.randn(slots, n, rank, generator=g, device=device) * 0.05).to(dtype)
        w = (torch.randn(n, k, generator=g, device=device) / k ** 0.5).to(dtype)
        for tokens in token_counts:
            x = torch.randn(tokens, k, generator=g, device=device).to(dtype)
            y = torch.randn(tokens, n, generator=g, device=device).to(dtype)
            for adapters in adapter_counts:
                token_slots = torch.randint(-1, adapters, (tokens,), generator=g, device=device)
                sorted_slots, order = torch.sort(token_slots.to(torch.int32), stable=True)
                order = order.to(torch.int32)

                def run():
                    out = y.clone()
                    return lora_expand(lora_shrink(x, a, order, sorted_slots), b, order, sorted_slots, out, starts)

                got = run().float()
                want = y.float() + lora_reference(x, a, b, starts, token_slots)
                err = (got - want).abs().max().item()
                scale = want.abs().max().item()
                ok = err <= (1e-4 if SMOKE else 2e-2) * max(scale, 1.0)
                check(ok, f"kernels {proj} T={tokens} adapters={adapters}: max error {err:.2e} (scale {scale:.2f})")
                row = {"proj": proj, "tokens": tokens, "adapters": adapters, "max_err": err, "ok": ok}
                if not SMOKE:
                    row["lora_us"] = _time_us(run)
                    row["gemm_us"] = _time_us(lambda: torch.nn.functional.linear(x, w))
                rows.append(row)
    results["kernels"] = rows
    if not SMOKE:
        print(f"  {'proj':8} {'T':>5} {'adapters':>8} {'lora us':>9} {'gemm us':>9} {'ratio':>6}")
        for r in rows:
            print(f"  {r['proj']:8} {r['tokens']:5} {r['adapters']:8} {r['lora_us']:9.1f} {r['gemm_us']:9.1f} "
                  f"{r['lora_us'] / r['gemm_us']:6.2f}")


def _time_us(fn, iters: int = 50) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


# ---------------------------------------------------------------- tiny: tokens vs HF + PEFT

def tiny(results: dict) -> None:
    from transformers import AutoModelForCausalLM

    from tests.helpers.hf_reference import compare_greedy
    from tests.helpers.lora_adapters import PeftAdapters
    from tests.helpers.tiny_models import make_tiny_model_dir
    from tokenmill import LLM, SamplingParams
    from tokenmill.lora.request import LoRARequest

    device = "cpu" if SMOKE else "cuda"
    root = tempfile.mkdtemp(prefix="lora-tiny-")
    path = make_tiny_model_dir("llama", root, num_hidden_layers=3)
    peft = PeftAdapters(AutoModelForCausalLM.from_pretrained(path, dtype="float32").eval().to(device))
    specs = {"a1": dict(rank=8, seed=1, std=0.3),
             "a2": dict(rank=16, alpha=8, targets=("q_proj", "v_proj", "down_proj"), seed=2, std=0.5, use_rslora=True),
             "a3": dict(rank=4, targets=("k_proj", "o_proj", "gate_proj", "up_proj"), seed=3, std=0.4)}
    loras = {n: LoRARequest(n, i + 1, peft.add(n, os.path.join(root, "adapters"), **spec))
             for i, (n, spec) in enumerate(specs.items())}
    names = [None, "a1", "a2", "a3"] * 6
    prompts = [[(7 * i + 3 * j) % 250 + 3 for j in range(3 + (5 * i) % 40)] for i in range(len(names))]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    refs = [peft.greedy(n, p, 24) for n, p in zip(names, prompts)]
    runs = {"graphs": dict(max_loras=3), "one_slot": dict(max_loras=1, max_cpu_loras=1)}
    if not SMOKE:
        runs["eager"] = dict(max_loras=3, enforce_eager=True)
    rows = {}
    for label, extra in runs.items():
        engine = dict(dtype="float32", enable_lora=True, max_lora_rank=16, **extra)
        if SMOKE:
            engine.update(single_process=True, kv_cache_memory_gb=0.02)
        else:
            engine.update(gpu_memory_utilization=0.3, max_model_len=256)
        with LLM(path, **engine) as llm:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                                lora_request=[None if n is None else loras[n] for n in names])
        exact, notes = 0, []
        for out, ref, n in zip(outs, refs, names):
            try:
                note = compare_greedy(list(out.outputs[0].token_ids), ref, f"{label} {n}")
            except AssertionError as exc:
                note = f"MISMATCH {exc}"[:300]
            exact += note is None
            if note:
                notes.append(note)
        mismatches = [x for x in notes if x.startswith("MISMATCH")]
        check(not mismatches and len(notes) <= 2,
              f"tiny {label}: {exact}/{len(names)} exact vs HF+PEFT, {len(notes)} near-tie notes"
              + (f"; {mismatches[0]}" if mismatches else ""))
        rows[label] = {"exact": exact, "rows": len(names), "notes": notes}
    results["tiny"] = rows


# ---------------------------------------------------------------- throughput and batch 1

def engines(results: dict, parts: set[str]) -> None:
    from tokenmill import LLM, SamplingParams
    from tokenmill.lora.request import LoRARequest

    shape_name = "llama1b" if SMOKE else "llama8b"
    shape = dict(SHAPES[shape_name])
    if SMOKE:
        shape.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, vocab_size=512)
        SHAPES["lora-smoke"] = shape
        shape_name = "lora-smoke"
    path = config_dir(shape_name)
    num, inp, out = (24, 32, 16) if SMOKE else (1000, 512, 256)
    counts = (1, 8, 64) if not SMOKE else (1, 4)
    max_loras = max(counts)
    root = tempfile.mkdtemp(prefix="lora-adapters-")
    start = time.perf_counter()
    folders = [write_adapter(os.path.join(root, f"f{i}"), shape, 16, i) for i in range(min(8, max_loras))]
    print(f"  wrote {len(folders)} rank-16 adapter folders in {time.perf_counter() - start:.1f} s")
    loras = [LoRARequest(f"adapter{i}", i + 1, folders[i % len(folders)]) for i in range(max_loras)]
    from transformers import AutoTokenizer
    prompts = [{"prompt_token_ids": p} for p in
               make_prompts(AutoTokenizer.from_pretrained(path), "random", num, inp, shape["vocab_size"])]
    params = SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True, detokenize=False)
    one_params = SamplingParams(temperature=0.0, max_tokens=256 if not SMOKE else 16, ignore_eos=True,
                                detokenize=False)
    one_prompt = [{"prompt_token_ids": prompts[0]["prompt_token_ids"][:inp]}]
    common = dict(load_format="dummy", dtype="float32" if SMOKE else "bfloat16", max_model_len=inp + out + 16)
    if SMOKE:
        common.update(single_process=True, kv_cache_memory_gb=0.05)
    figures: dict = {}

    def timed(llm, lora_request, label: str, batch=prompts, p=params) -> dict:
        t0 = time.perf_counter()
        outs = llm.generate(batch, p, use_tqdm=False, lora_request=lora_request)
        f = summarize(outs, time.perf_counter() - t0, inp)
        figures[label] = f
        print(f"  {label:24} {f['output_tokens_per_s']:10.1f} out tok/s  tpot {f['tpot_ms_mean']:.2f} ms  "
              f"({f['elapsed_s']:.1f} s)")
        return f

    with LLM(path, **common) as llm:  # the base model: no LoRA anywhere
        if "throughput" in parts:
            llm.generate(prompts[:8], params, use_tqdm=False)  # warm
            timed(llm, None, "base")
        if "batch1" in parts:
            llm.generate(one_prompt, one_params, use_tqdm=False)
            timed(llm, None, "batch1_base", one_prompt, one_params)
    with LLM(path, enable_lora=True, max_loras=max_loras, max_lora_rank=16, max_cpu_loras=max_loras,
             **common) as llm:
        # Every adapter read into host memory and a device slot once, before timing (as a server
        # that was given them with --lora-modules would have them after its first requests).
        start = time.perf_counter()
        llm.generate([prompts[0]] * max_loras, SamplingParams(max_tokens=1), use_tqdm=False, lora_request=loras)
        print(f"  loaded {max_loras} adapters in {time.perf_counter() - start:.1f} s")
        if "throughput" in parts:
            for count in counts:
                mix = [loras[i % count] for i in range(num)]
                timed(llm, mix, f"lora_{count}_adapters")
            timed(llm, None, "base_in_lora_engine")
        if "batch1" in parts:
            llm.generate(one_prompt, one_params, use_tqdm=False, lora_request=loras[0])
            timed(llm, loras[0], "batch1_lora", one_prompt, one_params)
    results["engines"] = figures
    base = figures.get("base")
    if base:
        print(f"  {'adapters':>8} {'out tok/s':>10} {'x base':>7} {'goal':>6}")
        for count in counts:
            f = figures[f"lora_{count}_adapters"]
            ratio = f["output_tokens_per_s"] / base["output_tokens_per_s"]
            goal = GOALS.get(count, 0.8)
            results[f"ratio_{count}_adapters"] = ratio
            print(f"  {count:8} {f['output_tokens_per_s']:10.1f} {ratio:7.3f} {goal:6.2f} "
                  f"{'met' if ratio >= goal else 'MISSED'}")
    if "batch1_base" in figures:
        ratio = figures["batch1_lora"]["tpot_ms_mean"] / figures["batch1_base"]["tpot_ms_mean"]
        results["batch1_tpot_ratio"] = ratio
        print(f"  batch 1: {figures['batch1_base']['tpot_ms_mean']:.2f} ms/token base, "
              f"{figures['batch1_lora']['tpot_ms_mean']:.2f} with an adapter: {ratio:.3f}x (goal <= 1.10) "
              f"{'met' if ratio <= 1.10 else 'MISSED'}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="kernels,tiny,throughput,batch1")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes (checks that the script runs)")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    os.makedirs(OUT, exist_ok=True)
    results: dict = {"device": "cpu (smoke)" if SMOKE else torch.cuda.get_device_name(0), "torch": torch.__version__,
                     "parts": sorted(parts)}
    start_all = time.perf_counter()
    for name, fn in (("kernels", kernels), ("tiny", tiny)):
        if name in parts:
            start = time.perf_counter()
            print(f"==== {name}")
            fn(results)
            print(f"[{name} took {time.perf_counter() - start:.0f} s]")
    if parts & {"throughput", "batch1"}:
        start = time.perf_counter()
        print("==== throughput / batch1")
        engines(results, parts)
        print(f"[engines took {time.perf_counter() - start:.0f} s]")
    results["failed"] = FAILED
    results["total_s"] = time.perf_counter() - start_all
    with open(os.path.join(OUT, "gpu_lora.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    print(f"total {results['total_s']:.0f} s; {len(FAILED)} failed check(s); wrote {OUT}/gpu_lora.json")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
