"""One-row linears of Llama-3.1-8B at TP=1 and TP=2 on one GPU: cuBLAS against the Triton GEMV's tiles.

    python scripts/gpu_gemv.py [--budget S] [--smoke]

For each weight shape (qkv, o, gate_up, down, LM head; full width and TP=2's halves), bf16: a
chain of distinct weights (more bytes than L2 holds, as a step's layers) captured in a CUDA graph
and replayed; microseconds per call and the weight bytes streamed per second, for `F.linear`
(cuBLAS), `torch.mv` (cuBLAS's GEMV) and each tile configuration of `triton_ops.gemv`. Each
candidate is checked against the float64 reference first (a wrong one is reported and not timed).
Prints a table and the `gemv.TABLE` entries that beat cuBLAS by at least 3%; writes
$OUT/gpu_gemv.json. --smoke: tiny shapes on the CPU under TRITON_INTERPRET=1 (checks only).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tokenmill.layers.triton_ops.gemv import GemvTiles, gemv, gemv_reference  # noqa: E402

import triton_attention_check  # noqa: E402  (scripts/: CUDA-graph timing)

# name: (N, K) of the weight at TP=2 (rank's share) and at TP=1
SHAPES = {
    "qkv": ((3072, 4096), (6144, 4096)),
    "o": ((4096, 2048), (4096, 4096)),
    "gate_up": ((14336, 4096), (28672, 4096)),
    "down": ((4096, 7168), (4096, 14336)),
    "lm_head": ((64128, 4096), (128256, 4096)),
}
SMOKE_SHAPES = {"a": ((24, 64), (48, 64)), "b": ((16, 96), (16, 192))}
CANDIDATES = [GemvTiles(n, k, w, s) for n, k, w, s in (
    (8, 512, 4, 1), (8, 1024, 4, 1), (4, 1024, 4, 1), (16, 512, 4, 1), (16, 256, 4, 1), (8, 256, 2, 1),
    (4, 512, 2, 1), (8, 512, 8, 1), (16, 512, 8, 1), (32, 256, 4, 1), (8, 512, 4, 3), (16, 256, 4, 3),
    (4, 1024, 4, 3), (2, 1024, 4, 1))]
SMOKE_CANDIDATES = [GemvTiles(8, 32, 1, 1), GemvTiles(4, 64, 2, 2)]
L2_DEFEAT_BYTES = 1 << 30


def time_chain(fn, weights, x, replays: int = 5) -> float:
    """Microseconds per call over a graph of one call per weight (distinct weights defeat L2)."""
    return triton_attention_check.time_graph(lambda: [fn(x, w) for w in weights], iters=replays) / len(weights)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--budget", type=float, default=60.0, help="seconds; shapes left when it runs out are skipped")
    ap.add_argument("--widths", default="tp2,tp1", help="which shapes: tp2 (a rank's half), tp1 (full width)")
    args = ap.parse_args()
    start = time.perf_counter()
    dev = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    candidates = SMOKE_CANDIDATES if args.smoke else CANDIDATES
    out_dir = os.environ.get("OUT", os.path.join(os.getcwd(), "gpu-out"))
    os.makedirs(out_dir, exist_ok=True)
    records, ok = [], True
    for width in args.widths.split(","):
        for name, pair in shapes.items():
            if time.perf_counter() - start > args.budget:
                print(f"budget spent: {width} {name} skipped", flush=True)
                continue
            n, k = pair[0] if width == "tp2" else pair[1]
            g = torch.Generator(device=dev).manual_seed(n + k)
            count = 1 if args.smoke else min(32, max(4, -(-L2_DEFEAT_BYTES // (n * k * 2))))
            weights = [(torch.randn(n, k, generator=g, device=dev) * 0.02).to(dtype) for _ in range(count)]
            x = torch.randn(1, k, generator=g, device=dev).to(dtype)
            want = gemv_reference(x, weights[0])
            scale = want.abs().max().item()
            fns = {"cublas": lambda x, w: torch.nn.functional.linear(x, w),
                   "cublas_mv": lambda x, w: torch.mv(w, x[0]).unsqueeze(0)}
            fns.update({t.label: (lambda x, w, t=t: gemv(x, w, tiles=t)) for t in candidates})
            row = {"width": width, "layer": name, "n": n, "k": k, "mb": n * k * 2 / 1e6, "us": {}, "errors": {}}
            for label, fn in fns.items():
                err = (fn(x, weights[0]).double() - want).abs().max().item() / scale
                row["errors"][label] = err
                if err > (1e-5 if args.smoke else 2e-2):
                    print(f"{width} {name} {label}: relative error {err:.2g} (FAILED)", flush=True)
                    if label not in ("cublas", "cublas_mv"):
                        ok = False
                    continue
                if not args.smoke:
                    row["us"][label] = time_chain(fn, weights, x)
            if row["us"]:
                base = row["us"]["cublas"]
                best = min((lbl for lbl in row["us"] if lbl not in ("cublas", "cublas_mv")), key=row["us"].get)
                row.update(best=best, best_us=row["us"][best], cublas_us=base,
                           best_gbps=n * k * 2 / row["us"][best] / 1e3, cublas_gbps=n * k * 2 / base / 1e3)
                print(f"{width:<4} {name:<8} {n:>6}x{k:<6} cublas {base:7.2f} us ({row['cublas_gbps']:5.0f} GB/s)  "
                      f"mv {row['us'].get('cublas_mv', float('nan')):7.2f}  best {best} {row['best_us']:7.2f} us "
                      f"({row['best_gbps']:5.0f} GB/s)  " + " ".join(f"{k_}={v:.1f}" for k_, v in row["us"].items()
                                                                  if k_ not in ("cublas", "cublas_mv")), flush=True)
            records.append(row)
            del weights
            with open(os.path.join(out_dir, "gpu_gemv.json"), "w") as f:
                json.dump({"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                           "records": records, "passed": ok}, f, indent=2)
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    wins = {(r["n"], r["k"]): r["best"] for r in records if r.get("best_us") and r["best_us"] < 0.97 * r["cublas_us"]}
    print("gemv.TABLE entries (beat cuBLAS by >= 3%): " + ", ".join(f"({n}, {k}): {lbl}" for (n, k), lbl in wins.items()))
    print(f"{'checks passed' if ok else 'CHECK FAILED'} in {time.perf_counter() - start:.0f} s", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
