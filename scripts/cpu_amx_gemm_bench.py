"""Per-call time (ms, best of N) of the CPU bf16 GEMMs at SmolLM2 and Llama-1B-ish shapes.

Columns: the packed vdpbf16ps GEMM with float32 out (`cpu_bf16_gemm`), oneDNN bf16 hi+lo float32
(`wide_linear`'s fallback), oneDNN bf16 out (`linear.linear` on the packed path), oneDNN's fused
silu-mul (`linear.silu_mul_linear`, [gate|up] of 2N rows), and the AMX tile GEMM
(`cpu_amx_gemm`) with each epilogue (f32 out + residual add, bf16 out, silu-mul). Also the max
error of the float32 outputs against a float64 reference. Writes a JSON record (`--out`).

    python scripts/cpu_amx_gemm_bench.py --out /tmp/amx-bench.json [--rows 1,4,16,64,256,2048]
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import time

import torch

from tokenmill.layers import cpu_amx_gemm, cpu_bf16_gemm, cpu_isa, wide_linear
from tokenmill.layers import linear as L

SHAPES = ((576, 576), (576, 1536), (2048, 2048), (2048, 8192))  # (N out, K in)


def best_ms(fn, reps: int, budget_s: float) -> float:
    """Best time of up to `reps` calls (other processes share the cores: the best is the quiet one)."""
    fn()
    fn()
    best, start = float("inf"), time.perf_counter()
    for i in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
        if i >= 2 and time.perf_counter() - start > budget_s:
            break
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,4,16,64,256,2048")
    ap.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES), help="NxK list")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--budget-s", type=float, default=1.5, help="time cap per measurement")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    torch.manual_seed(0)
    amx = cpu_amx_gemm.library()
    print(cpu_isa.describe(), f"| threads {torch.get_num_threads()} | AMX GEMM {'on' if amx else 'off'}", flush=True)
    records = []
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        w = (torch.randn(n, k) * 0.05).to(torch.bfloat16)
        wg = (torch.randn(2 * n, k) * 0.05).to(torch.bfloat16)
        pk, pw, pg, ps = cpu_bf16_gemm.PackedBf16(), L.PackedWeight(), cpu_bf16_gemm.PackedBf16(), \
            (L.PackedWeight(), L.PackedWeight())
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k, dtype=torch.bfloat16)
            res = torch.randn(rows, n)
            ref = x.double() @ w.double().T + res.double()
            t: dict[str, float] = {}
            err: dict[str, float] = {}
            with torch.inference_mode():
                if cpu_bf16_gemm.available():
                    t["vdp_f32"] = best_ms(functools.partial(cpu_bf16_gemm.gemm_f32, x, w, pk, res), args.reps, args.budget_s)
                    err["vdp_f32"] = (cpu_bf16_gemm.gemm_f32(x, w, pk, res).double() - ref).abs().max().item()
                if L._use_packed(x, w, pw):
                    t["hilo_f32"] = best_ms(functools.partial(wide_linear.linear_f32, x, w, None, pw, None, res), args.reps,
                                            args.budget_s)
                    err["hilo_f32"] = (wide_linear.linear_f32(x, w, None, pw, None, res).double() - ref).abs().max().item()
                    t["onednn_bf16"] = best_ms(functools.partial(L.linear, x, w, None, pw), args.reps, args.budget_s)
                    t["onednn_silu"] = best_ms(functools.partial(L.silu_mul_linear, x, wg, None, ps), args.reps, args.budget_s)
                if amx is not None:
                    t["amx_f32"] = best_ms(functools.partial(cpu_amx_gemm.gemm, x, w, pk, add=res), args.reps, args.budget_s)
                    err["amx_f32"] = (cpu_amx_gemm.gemm(x, w, pk, add=res).double() - ref).abs().max().item()
                    t["amx_bf16"] = best_ms(functools.partial(cpu_amx_gemm.gemm, x, w, pk, mode=cpu_amx_gemm.OUT_BF16),
                                            args.reps, args.budget_s)
                    t["amx_silu"] = best_ms(functools.partial(cpu_amx_gemm.gemm, x, wg, pg, mode=cpu_amx_gemm.OUT_SILU_MUL),
                                            args.reps, args.budget_s)
            records.append({"rows": rows, "n": n, "k": k, "ms": t, "max_err": err})
            print(f"rows {rows:5d} {n}x{k}: " + "  ".join(f"{name} {v:.3f}" for name, v in t.items())
                  + "   err " + " ".join(f"{name} {v:.1e}" for name, v in err.items()), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": platform.processor() or platform.machine(), "path": cpu_isa.describe(),
                       "threads": torch.get_num_threads(), "unit": "ms per call, best of N",
                       "records": records}, f, indent=1)


if __name__ == "__main__":
    main()
