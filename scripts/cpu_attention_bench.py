"""Per-step cost of CPU attention at the shapes of the CPU side by side (SmolLM2-135M: 9 heads, 3 KV
heads, head dim 64, 30 layers): decode over the paged cache (the C kernel, `cpu_decode`) and the
fresh prefill chunk (SDPA in `torch_ref`), in ms per model step (one layer's call x layers), best of N.

    python scripts/cpu_attention_bench.py --baseline main --out after.json   # this tree vs main's kernel
    python scripts/cpu_attention_bench.py --dtype float32 --batch 1 --context 192
    python scripts/cpu_attention_bench.py --threads 1 --cpu-time --baseline main  # on a busy machine
    python scripts/cpu_attention_bench.py --cold --baseline main --no-prefill  # K/V from memory, as in a model

Prints one line per case and a JSON record (also written to --out). Run it on a quiet machine:
the figures are the best of --repeat timed runs of --iters calls each. `--baseline REF` also
times the decode kernel as git REF has it (`cpu_decode.py` loaded from `git show`), in the same
process on the same inputs. On a shared machine, `--threads 1 --cpu-time` counts only this
thread's CPU time (other processes taking the core between calls do not count). `--cold`
times decode as a model runs it: each of the --layers layers has its own cache, and ~9 MB of
"weights" pass through the CPU caches before each call, so K/V come from memory (warm runs
keep one layer's 8 MB in L2/L3 and flatter a kernel).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

# As the engine's processes do (`tokenmill.cpu_threads`): idle OpenMP threads sleep, so a busy
# machine does not stall every parallel region a scheduler time slice. Set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
import torch.nn.functional as F

from tokenmill.layers import cpu_isa
from tokenmill.layers.attention import cpu_decode
from tokenmill.layers.attention.backend import kv_cache_shape

_CLOCK = time.perf_counter


def _best_ms(fn, iters: int, repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        t = _CLOCK()
        for _ in range(iters):
            fn()
        best = min(best, (_CLOCK() - t) / iters)
    return best * 1e3


def _module_at(ref: str, name: str):
    """tokenmill/layers/attention/NAME.py as git `ref` has it, loaded as a module of its own; None
    where `ref` has no such file."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    got = subprocess.run(["git", "-C", root, "show", f"{ref}:tokenmill/layers/attention/{name}.py"],
                         check=False, capture_output=True, text=True)
    if got.returncode:
        return None
    path = os.path.join(tempfile.mkdtemp(), f"{name}_baseline.py")
    with open(path, "w") as f:
        f.write(got.stdout)
    spec = importlib.util.spec_from_file_location(f"{name}_baseline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _baseline_module(ref: str):
    """cpu_decode.py as git `ref` has it, as a module of its own (its C library builds under its own
    key), with the kernel's source as `ref` has it (in cpu_decode_source.py since that file exists)."""
    module = _module_at(ref, "cpu_decode")
    if module is None:
        raise SystemExit(f"{ref} has no cpu_decode.py")
    source = _module_at(ref, "cpu_decode_source")
    if source is not None:
        module._SOURCE = source.SOURCE
    return module


def _call_ms(fn, cache: torch.Tensor, iters: int, repeat: int, step_fn=None) -> float:
    """Best ms per call of fn(cache); with step_fn (cold runs), only the calls themselves are timed."""
    if step_fn is None:
        return _best_ms(lambda: fn(cache), iters, repeat)
    run = step_fn(fn)
    run()
    return min(sum(run() for _ in range(iters)) / iters for _ in range(repeat)) * 1e3


def decode_case(batch: int, context: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                block_size: int, iters: int, repeat: int, layers: int, baseline=None, cold: bool = False,
                cold_mb: int = 9) -> dict:
    g = torch.Generator().manual_seed(0)
    nb_seq = -(-context // block_size)
    num_blocks = batch * nb_seq
    cache = torch.randn(kv_cache_shape(num_blocks, block_size, kv_heads, head_dim), generator=g).to(dtype)
    table = torch.randperm(num_blocks, generator=g).view(batch, nb_seq).int().contiguous()
    # contexts spread around `context` (as in a batch whose requests started at different steps)
    lens = torch.tensor([max(1, context - (i * 37) % (context // 3 + 1)) for i in range(batch)], dtype=torch.int32)
    q = torch.randn(batch, heads, head_dim, generator=g).to(dtype)
    scale = head_dim ** -0.5
    if cold:  # as in a model: `layers` caches, and each layer's weights read between two calls
        caches = [cache] + [torch.randn_like(cache, dtype=torch.float32).to(dtype) for _ in range(layers - 1)]
        weights = torch.zeros(layers, cold_mb * 2**20 // 4)
        state = {"l": 0}

        def step_fn(fn):
            def run():
                layer = state["l"] = (state["l"] + 1) % layers
                weights[layer].sum()
                t = time.perf_counter()
                fn(caches[layer])
                return time.perf_counter() - t
            return run
    ms = _call_ms(lambda c: cpu_decode.decode_attention(q, c, table, lens, scale), cache, iters, repeat,
                  step_fn if cold else None)
    flops = 4 * heads * head_dim * int(lens.sum())
    record = {"case": "decode", "cold": cold, "batch": batch, "context": context, "mean_len": float(lens.float().mean()),
              "dtype": str(dtype).split(".")[-1], "call_ms": ms, "step_ms": ms * layers,
              "gflops": flops / ms / 1e6}
    if baseline is not None:
        out, ref = (cpu_decode.decode_attention(q, cache, table, lens, scale),
                    baseline.decode_attention(q, cache, table, lens, scale))
        record["max_abs_diff_vs_baseline"] = float((out.float() - ref.float()).abs().max())
        base = _call_ms(lambda c: baseline.decode_attention(q, c, table, lens, scale), cache, iters, repeat,
                        step_fn if cold else None)
        record.update(baseline_call_ms=base, baseline_step_ms=base * layers, speedup=base / ms)
    return record


def prefill_case(batch: int, q_len: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 iters: int, repeat: int, layers: int) -> dict:
    g = torch.Generator().manual_seed(1)
    q = torch.randn(batch, q_len, heads, head_dim, generator=g).to(dtype).transpose(1, 2)
    k = torch.randn(batch, q_len, kv_heads, head_dim, generator=g).to(dtype).transpose(1, 2)
    v = torch.randn(batch, q_len, kv_heads, head_dim, generator=g).to(dtype).transpose(1, 2)
    gqa = heads != kv_heads
    # what torch_ref's fresh prefill runs, and the same with K/V expanded to the query heads
    ms = _best_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa), iters, repeat)
    rep = heads // kv_heads
    ke, ve = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    ms_exp = _best_ms(lambda: F.scaled_dot_product_attention(q, ke, ve, is_causal=True), iters, repeat)
    flops = 2 * heads * head_dim * batch * q_len * (q_len + 1)  # causal QK and PV
    return {"case": "prefill", "batch": batch, "q_len": q_len, "dtype": str(dtype).split(".")[-1],
            "call_ms": ms, "step_ms": ms * layers, "expanded_kv_call_ms": ms_exp, "gflops": flops / ms / 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", choices=["bfloat16", "float32", "both"], default="both")
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 1])
    ap.add_argument("--context", type=int, default=192, help="decode context (lengths spread below it)")
    ap.add_argument("--prefill-len", type=int, default=128)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--no-prefill", action="store_true")
    ap.add_argument("--baseline", default="", help="git ref whose decode kernel to time alongside (e.g. main)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    ap.add_argument("--cpu-time", action="store_true", help="time this thread's CPU time (with --threads 1)")
    ap.add_argument("--cold", action="store_true",
                    help="decode as in a model: one cache per layer, --cold-mb of weights read before each call")
    ap.add_argument("--cold-mb", type=int, default=9, help="MB read between calls (SmolLM2 bf16: ~9 per layer)")
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default="")
    ns = ap.parse_args()
    global _CLOCK
    if ns.threads:
        torch.set_num_threads(ns.threads)
    if ns.cpu_time:
        _CLOCK = time.thread_time
    baseline = _baseline_module(ns.baseline) if ns.baseline else None
    dtypes = [torch.bfloat16, torch.float32] if ns.dtype == "both" else [getattr(torch, ns.dtype)]
    cases = []
    for dtype in dtypes:
        for b in ns.batch:
            cases.append(decode_case(b, ns.context, ns.heads, ns.kv_heads, ns.head_dim, dtype, ns.block_size,
                                     ns.iters, ns.repeat, ns.layers, baseline, ns.cold, ns.cold_mb))
            if not ns.no_prefill:
                cases.append(prefill_case(b, ns.prefill_len, ns.heads, ns.kv_heads, ns.head_dim, dtype,
                                          max(2, ns.iters // 10 if b > 8 else ns.iters), ns.repeat, ns.layers))
    for c in cases:
        extra = f" expanded-KV {c['expanded_kv_call_ms']:.3f} ms" if "expanded_kv_call_ms" in c else ""
        if "baseline_call_ms" in c:
            extra = (f" | before ({ns.baseline}) {c['baseline_call_ms']:.3f} ms/call, {c['baseline_step_ms']:.2f} "
                     f"ms/step: {c['speedup']:.2f}x (max diff {c['max_abs_diff_vs_baseline']:.1e})")
        print(f"{c['case']:8s} {c['dtype']:8s} batch {c['batch']:3d}: {c['call_ms']:.3f} ms/call, "
              f"{c['step_ms']:.2f} ms/step ({c['gflops']:.1f} GFLOP/s){extra}")
    record = {"label": ns.label, "baseline": ns.baseline, "clock": "thread_time" if ns.cpu_time else "wall", "cpu_path": cpu_isa.kernel_path().name, "machine": platform.processor() or
              platform.machine(), "threads": torch.get_num_threads(), "torch": torch.__version__, "cases": cases}
    print(json.dumps(record))
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
