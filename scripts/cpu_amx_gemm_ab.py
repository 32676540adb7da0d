"""A/B of `cpu_amx_gemm` builds, per linear, interleaved in one process: the working tree's kernel,
the kernel of another git revision and/or builds with other -D blocking constants, against oneDNN.

On a machine shared with other jobs one GEMM's wall-clock time swings 10x from call to call; with
`--threads 1` (the default) each call is timed in thread CPU time (`time.thread_time`), which moves
far less, and every variant is timed once per round, so each round's load falls on all of them.
Prints min / median ms per call and TMAC/s (of the min); writes a JSON record (`--out`).

    python scripts/cpu_amx_gemm_ab.py --variants "old=@0533ad4;new=" --rows 64,2048
    python scripts/cpu_amx_gemm_ab.py --variants "new=;small=B_L2=65536" --shapes gu:3072x576:silu
    python scripts/cpu_amx_gemm_ab.py --variants "old=PF_AHEAD=0;new=" --rows 1,64 --cold 30 \
        --shapes "qkv:960x576:bf16,gu:3072x576:silu,o:576x576:f32,down:576x1536:f32,head:49152x576:f32"

A variant is NAME=[@REV][,DEFINE...]: REV a git revision of this checkout whose kernel source is
built, DEFINE a NAME=VALUE constant of the source (`RP`, `PV_MAX`, `KCB_MAX`, `B_L2`). Shapes are
TAG:NxK:EPILOGUE (f32 adds a float32 residual, as o_proj / down_proj do; bf16; silu: [gate | up]
of N rows). `--cold L` times whole decode steps instead: L layers of the shapes (the last shape, the
LM head, once), every weight its own copy, so that they stream from memory as in an engine's step
(per shape called alone, the weights stay in the caches). Needs the AMX build (an AMX-BF16 CPU).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import os
import statistics
import subprocess
import time

import torch

from tokenmill.layers import c_build, cpu_amx_gemm, cpu_bf16_gemm
from tokenmill.layers import linear as L

SHAPES = "qkv:960x576:bf16,gu:3072x576:silu,o:576x576:f32,down:576x1536:f32"
MODES = {"f32": cpu_amx_gemm.OUT_F32, "bf16": cpu_amx_gemm.OUT_BF16, "silu": cpu_amx_gemm.OUT_SILU_MUL}


def build(name: str, spec: str) -> ctypes.CDLL:
    source, defines = cpu_amx_gemm._SOURCE, []
    for part in filter(None, spec.split(",")):
        if part.startswith("@"):
            root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
            text = subprocess.run(["git", "-C", root, "show", f"{part[1:]}:tokenmill/layers/cpu_amx_gemm.py"],
                                  capture_output=True, text=True, check=True).stdout
            # the revision's module run on its own (its source may be assembled from c_common's parts)
            namespace: dict = {"__name__": f"cpu_amx_gemm_at_{part[1:]}"}
            exec(compile(text, f"{part[1:]}:cpu_amx_gemm.py", "exec"), namespace)  # noqa: S102 - our own git history
            source = namespace["_SOURCE"]
        else:
            defines.append(f"-D{part}")
    lib = c_build.load_library(f"cpu_amx_gemm_ab_{name}", source,
                               (*c_build.BASE_FLAGS, *cpu_amx_gemm._NATIVE_FLAGS, *defines),
                               {"amx_gemm": cpu_amx_gemm._ARGTYPES, "amx_init": []})
    if lib is None:
        raise SystemExit(f"variant {name}: build failed")
    lib.amx_init.restype = lib.amx_gemm.restype = ctypes.c_int
    if lib.amx_init():
        raise SystemExit("AMX tiles refused")
    return lib


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="new=", help="NAME=[@REV][,DEFINE...] list, ';'-separated")
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--rows", default="1,16,64,256,2048")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cold", type=int, default=0, help="time decode steps of this many layers (see above)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if cpu_amx_gemm.native_library() is None:
        raise SystemExit("no AMX-BF16 build on this CPU")
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    libs = {name: build(name, spec) for name, _, spec in (v.partition("=") for v in args.variants.split(";"))}
    torch.manual_seed(0)
    if args.cold:
        return cold_steps(args, libs)
    records = []
    for shape in args.shapes.split(","):
        tag, nk, epi = shape.split(":")
        n, k = (int(v) for v in nk.split("x"))
        mode = MODES[epi]
        w = (torch.randn(n, k) * 0.05).to(torch.bfloat16)
        pk, pw, ps = cpu_bf16_gemm.PackedBf16(), L.PackedWeight(), (L.PackedWeight(), L.PackedWeight())
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k).to(torch.bfloat16)
            res = torch.randn(rows, n) if mode == cpu_amx_gemm.OUT_F32 else None
            x2, out, a2, width, gate_up = cpu_bf16_gemm.gemm_operands(x, w, mode, res, k_multiple=32)
            packed = pk.get(w, None, gate_up)

            cargs = (x2.data_ptr(), x2.stride(0), packed.data_ptr(), packed.shape[1], None, rows, x2.shape[1],
                     packed.shape[0], mode, out.data_ptr(), out.stride(0), width,
                     None if a2 is None else a2.data_ptr(), 0 if a2 is None else a2.stride(0), args.threads)
            fns = {name: functools.partial(lib.amx_gemm, *cargs) for name, lib in libs.items()}
            onednn = functools.partial(L.silu_mul_linear, x, w, None, ps) if epi == "silu" else \
                functools.partial(L.linear, x, w, None, pw)  # (f32: oneDNN's bf16 out, for scale)
            fns["onednn" if epi != "f32" else "onednn_bf16"] = onednn
            with torch.inference_mode():
                results = {}
                for name in libs:  # every build gives the same bits (same sums, same order)
                    fns[name]()
                    results[name] = out.clone()
                first = next(iter(results.values()))
                same = {name: bool(torch.equal(r, first)) for name, r in results.items()}
                for f in fns.values():
                    f()
                times: dict[str, list[float]] = {name: [] for name in fns}
                inner = max(1, min(50, int(3e9 // (rows * n * k + 1))))
                for _ in range(args.rounds):
                    for name, f in fns.items():
                        t = clock()
                        for _ in range(inner):
                            f()
                        times[name].append((clock() - t) / inner * 1e3)
            mac = rows * n * k
            print(f"{tag:5s} {n}x{k} rows {rows:5d}: " + "  ".join(
                f"{name} {min(v):.3f}/{statistics.median(v):.3f}ms ({mac / min(v) / 1e9:.2f}T)"
                for name, v in times.items()) + ("" if all(same.values()) else f"  DIFFERENT: {same}"), flush=True)
            records.append({"shape": shape, "rows": rows, "ms_min": {a: min(v) for a, v in times.items()},
                            "ms_median": {a: statistics.median(v) for a, v in times.items()}, "same_bits": same})
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"variants": args.variants, "threads": args.threads,
                       "clock": "thread CPU time" if args.threads == 1 else "wall", "records": records}, f, indent=1)


def _call(n: int, k: int, epi: str, rows: int, nthreads: int) -> tuple:
    """A prepared call of one linear: (ctypes arguments, output, tensors kept alive)."""
    mode = MODES[epi]
    w = (torch.randn(n, k) * 0.05).to(torch.bfloat16)
    x = torch.randn(rows, k).to(torch.bfloat16)
    res = torch.randn(rows, n) if mode == cpu_amx_gemm.OUT_F32 else None
    x2, out, a2, width, gate_up = cpu_bf16_gemm.gemm_operands(x, w, mode, res, k_multiple=32)
    packed = cpu_bf16_gemm.PackedBf16().get(w, None, gate_up)
    cargs = (x2.data_ptr(), x2.stride(0), packed.data_ptr(), packed.shape[1], None, rows, x2.shape[1],
             packed.shape[0], mode, out.data_ptr(), out.stride(0), width,
             None if a2 is None else a2.data_ptr(), 0 if a2 is None else a2.stride(0), nthreads)
    return cargs, out, (x2, a2, packed)


def cold_steps(args, libs: dict) -> None:
    """Decode steps over `args.cold` layers of the shapes (the last one once: the LM head), every
    weight its own copy; ms per step (layers, then the last shape) per variant, min / median."""
    shapes = [(s.split(":")[0], *(int(v) for v in s.split(":")[1].split("x")), s.split(":")[2])
              for s in args.shapes.split(",")]
    records = []
    for rows in (int(r) for r in args.rows.split(",")):
        layers = [_call(n, k, epi, rows, args.threads) for _ in range(args.cold) for _, n, k, epi in shapes[:-1]]
        last = _call(*shapes[-1][1:], rows, args.threads)
        clock = time.thread_time if args.threads == 1 else time.perf_counter
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in libs}
        outs = {}
        for _ in range(args.rounds):
            for name, lib in libs.items():
                t0 = clock()
                for cargs, _, _ in layers:
                    lib.amx_gemm(*cargs)
                t1 = clock()
                lib.amx_gemm(*last[0])
                times[name].append(((t1 - t0) * 1e3, (clock() - t1) * 1e3))
                outs[name] = (layers[-1][1].clone(), last[1].clone())
        first = next(iter(outs.values()))
        same = {name: all(torch.equal(a, b) for a, b in zip(o, first)) for name, o in outs.items()}
        print(f"rows {rows:4d}, {args.cold} layers + {shapes[-1][0]}: " + "  ".join(
            f"{name} {min(t[0] for t in v):.2f}/{statistics.median(t[0] for t in v):.2f} + "
            f"{min(t[1] for t in v):.2f}/{statistics.median(t[1] for t in v):.2f}ms" for name, v in times.items())
            + ("" if all(same.values()) else f"  DIFFERENT: {same}"), flush=True)
        records.append({"rows": rows, "layers_ms": {n: [t[0] for t in v] for n, v in times.items()},
                        "last_ms": {n: [t[1] for t in v] for n, v in times.items()}, "same_bits": same})
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"variants": args.variants, "cold_layers": args.cold, "shapes": args.shapes,
                       "threads": args.threads, "records": records}, f, indent=1)


if __name__ == "__main__":
    main()
