"""The `int4gemm` part of scripts/gpu_quant.py: the INT4 W4A16 GEMMs on the tensor-core GEMV's
layout against the engine's path (`mma_matmul`: the table's GEMM, else dequantize the mma layout
+ cuBLAS above 8 rows; the GEMV per 8 rows up to 32) and bf16 cuBLAS, per Llama-8B linear and row
count, each variant checked against a float32 reference, timed from CUDA-graph replays with
weights cycled past L2 (HBM-bound, as in a forward). Prints per (rows, linear) the ranking, the
layer's four linears at their best, and `triton_int4_dot_gemm.TABLE` lines; writes
`$OUT/int4gemm.json` after every linear (a killed run keeps what it measured).

By default (INT4_GEMM_SET unset or dot): the plain tl.dot GEMM (`triton_int4_dot_gemm`: x as A, the
weight dequantized as B, PTX or Triton dequantization) over its tiles, splits and pipeline depths.
(Session 6's swapped Triton GEMM, `triton_int4_mma_gemm`, was retired in session 11: 3-17x slower.)
INT4_GEMM_SET=gluon: the
Gluon GEMM (`gluon_int4_gemm`: the same dequantization with its wgmma kept in flight; GPUs only,
its own process so that a fault cannot cost the dot set's figures). INT4_GEMM_SET=swap: the swapped
Gluon GEMM (`gluon_int4_swap_gemm`: the weight dequantized into wgmma's register operand) beside the
table's launches (GPUs only).
INT4_GEMM_SET=swap2: the second round's launches for the skinny linears at 256 rows (`swap2_variants`).
INT4_GEMM_SET=ahead: session 9's deeper word prefetch at 256 rows (`ahead_variants`).
INT4_GEMM_LINEARS: only these linears (e.g. down,qkv,o). INT4_GEMM_ROWS: the row counts, in order (default 256,64,1024,128,16,512: what the budget leaves out is
the last); INT4_GEMM_BUDGET_S caps the timing (default 60 s after compiling); INT4_GEMM_COMPILE_S the
parallel compile (default 30 s).
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

import triton_precompile  # scripts/: compiles a sweep's kernels in parallel processes

LLAMA_SHAPES = {"gate_up": (28672, 4096), "down": (4096, 14336), "qkv": (6144, 4096), "o": (4096, 4096)}
SMOKE_SHAPES = {"gate_up": (256, 256), "down": (128, 512)}
GROUP = 128
SMOKE_GROUP = 64


def variants(m: int, smoke: bool) -> list:
    """The launches to try at m rows (INT4_GEMM_SET: see the module's docstring)."""
    if os.environ.get("INT4_GEMM_SET") == "gluon":  # GPUs only (a smoke run falls back to the dot set)
        return dot_variants(m, smoke) if smoke else list(dict.fromkeys(gluon_variants(m)))
    if os.environ.get("INT4_GEMM_SET") == "swap":  # GPUs only (a smoke run falls back to the dot set)
        return dot_variants(m, smoke) if smoke else list(dict.fromkeys(swap_variants(m)))
    if os.environ.get("INT4_GEMM_SET") == "swap2":  # session 8's second round: 256 rows, down / qkv / o
        return dot_variants(m, smoke) if smoke else list(dict.fromkeys(swap2_variants(m)))
    if os.environ.get("INT4_GEMM_SET") == "ahead":  # session 9: the deeper word prefetch, fewer splits
        return dot_variants(m, smoke) if smoke else list(dict.fromkeys(ahead_variants(m)))
    return dot_variants(m, smoke)


def dot_variants(m: int, smoke: bool) -> list:
    """`triton_int4_dot_gemm.DotTiles` (block_m, block_n, block_k, warps, stages, split, group_n, deq)
    to try at m rows: one or two CTAs an SM (a CTA's dequantization then overlaps the other's
    wgmma: Triton waits for each wgmma whose operand was made in registers), K tiles of one or two
    layout steps, split-K for the linears of few output tiles, and the Triton dequantization beside
    the PTX one."""
    from tokenmill.layers.quantization.triton_int4_dot_gemm import DotTiles as D

    if smoke:
        return [D(16, 32, 64, 4, 1, deq=1), D(16, 32, 64, 4, 1, split=2, deq=1), D(32, 32, 64, 4, 2)]
    if m <= 64:
        return [D(64, 128, 64, 4, 4), D(64, 128, 128, 4, 3), D(64, 256, 64, 4, 4), D(64, 128, 64, 4, 4, split=2),
                D(64, 64, 128, 4, 4, split=2), D(64, 64, 64, 4, 4, split=4), D(64, 128, 128, 4, 3, split=4),
                D(64, 128, 64, 4, 4, deq=1)]
    if m <= 128:
        return [D(128, 128, 64, 4, 4), D(128, 128, 64, 4, 3), D(128, 128, 128, 4, 2), D(128, 64, 64, 4, 4),
                D(64, 128, 64, 4, 4), D(128, 256, 64, 8, 3), D(128, 128, 64, 4, 4, split=2),
                D(128, 128, 64, 4, 4, split=4), D(128, 64, 64, 4, 4, split=2), D(128, 64, 128, 4, 3, split=2),
                D(128, 128, 64, 4, 4, deq=1)]
    return [D(128, 128, 64, 4, 4), D(128, 128, 64, 4, 3), D(128, 128, 128, 4, 2), D(128, 128, 128, 4, 3),
            D(128, 64, 64, 4, 4), D(256, 64, 64, 8, 3), D(256, 64, 128, 8, 3), D(256, 128, 64, 8, 3),
            D(128, 256, 64, 8, 3), D(128, 128, 64, 8, 4), D(128, 128, 64, 4, 4, group_n=4),
            D(128, 128, 64, 4, 4, split=2), D(128, 128, 64, 4, 4, split=4), D(256, 64, 64, 8, 3, split=2),
            D(128, 128, 64, 4, 4, deq=1)]


def _table_launches(m: int) -> list:
    """The launches `triton_int4_dot_gemm.TABLE` lists for this row count (timed beside the new ones;
    compiling them here also warms the cache the engine's self-test reads)."""
    from tokenmill.layers.quantization.triton_int4_dot_gemm import TABLE

    return list(dict.fromkeys(t for (bucket, _, _), t in TABLE.items() if bucket == m))


def gluon_variants(m: int) -> list:
    """`gluon_int4_gemm.GluonTiles` (block_m, block_n, stages, warps, split): the Gluon GEMM whose wgmma
    stays in flight while the next tile is dequantized (bf16, GPUs only)."""
    from tokenmill.layers.quantization.triton_int4_dot_gemm import GluonTiles as G

    if os.environ.get("INT4_GEMM_GLUON") == "round2":  # deeper pipelines and K tiles of 128 (session 7's second run)
        if m <= 64:
            return [*_table_launches(m), G(64, 128, 5, 4), G(64, 128, 6, 4), G(64, 128, 3, 4, 1, 128),
                    G(64, 128, 4, 4, 1, 128), G(64, 256, 4, 4), G(64, 128, 5, 4, 2), G(64, 128, 5, 4, 4),
                    G(64, 128, 3, 4, 4, 128)]
        if m <= 128:
            return [*_table_launches(m), G(128, 128, 4, 8), G(128, 128, 5, 8), G(128, 128, 2, 8, 1, 128),
                    G(128, 128, 3, 8, 1, 128), G(128, 256, 4, 8), G(128, 128, 4, 8, 4), G(128, 128, 5, 8, 4),
                    G(128, 128, 3, 8, 4, 128), G(128, 128, 4, 8, 2)]
        return [*_table_launches(m), G(256, 128, 3, 8), G(256, 128, 4, 8), G(256, 128, 5, 8), G(256, 128, 2, 8, 1, 128),
                G(128, 128, 4, 8), G(128, 128, 5, 8), G(128, 128, 3, 8, 1, 128), G(128, 256, 4, 8),
                G(128, 128, 4, 8, 4), G(128, 128, 5, 8, 4), G(256, 128, 4, 8, 2), G(256, 128, 4, 8, 4),
                G(128, 128, 3, 8, 4, 128)]
    if m <= 64:
        return [G(64, 128, 4, 4), G(64, 128, 3, 4), G(64, 256, 3, 4), G(64, 128, 4, 4, 2), G(64, 128, 4, 4, 4)]
    if m <= 128:
        return [G(128, 128, 3, 4), G(64, 128, 4, 4), G(128, 128, 3, 8), G(128, 256, 3, 8), G(128, 128, 3, 8, 2),
                G(128, 128, 3, 8, 4)]
    return [G(128, 128, 3, 4), G(128, 128, 4, 4), G(128, 128, 3, 8), G(128, 256, 3, 8), G(256, 128, 3, 8),
            G(128, 128, 3, 8, 2), G(128, 128, 3, 8, 4), G(128, 128, 3, 4, 2)]


def swap_variants(m: int) -> list:
    """`SwapTiles` (block_t, warps, stages, split, block_k, ahead) of the swapped Gluon GEMM
    (`gluon_int4_swap_gemm`: the weight dequantized into wgmma's register A operand, x through
    shared memory) beside the launches the table routes now (bf16, GPUs only). 16 x warps channels a
    CTA (x cpw: two 16-channel blocks a warp, fewer x bytes per FLOP); split-K for the linears of few
    channel tiles (down, qkv, o); xnat: x gathered in the kernel (4-byte cp.asyncs) instead of
    permuted by a copy first; wtop: wgmma i - 2 retired after the step's barrier (no barrier waits on
    the other warpgroup's wgmma)."""
    from tokenmill.layers.quantization.triton_int4_dot_gemm import SwapTiles as S

    if m <= 64:
        return [*_table_launches(m), S(64, 4, 4), S(64, 8, 4), S(64, 4, 4, 2), S(64, 4, 4, 4), S(64, 8, 4, 4),
                S(64, 4, 4, xnat=True), S(64, 4, 4, 4, xnat=True), S(64, 4, 4, cpw=2), S(64, 4, 4, 2, cpw=2),
                S(64, 4, 5, wtop=True), S(64, 4, 5, 4, wtop=True)]
    if m <= 128:
        return [*_table_launches(m), S(128, 8, 4), S(128, 4, 4), S(128, 8, 4, 2), S(128, 8, 4, 4), S(128, 4, 4, 2),
                S(128, 8, 4, xnat=True), S(128, 8, 4, 4, xnat=True), S(128, 8, 5, wtop=True),
                S(128, 8, 5, 4, wtop=True), S(128, 8, 5, 2, wtop=True)]
    if m <= 256:
        return [*_table_launches(m), S(256, 8, 4), S(256, 8, 4, ahead=1), S(256, 4, 3), S(128, 4, 4),
                S(256, 8, 4, 2), S(256, 8, 4, 4), S(256, 8, 4, xnat=True), S(256, 8, 4, 4, xnat=True),
                S(128, 8, 4, xnat=True), S(128, 8, 4, ahead=1, cpw=2), S(128, 8, 4, 2, ahead=1, cpw=2),
                S(256, 8, 5, wtop=True), S(256, 8, 4, wtop=True), S(256, 8, 6, wtop=True), S(256, 8, 5, 2, wtop=True),
                S(256, 8, 5, 4, wtop=True), S(256, 8, 5, xnat=True, wtop=True), S(256, 8, 5, 4, xnat=True, wtop=True)]
    return [S(256, 8, 4), S(256, 8, 5, wtop=True), S(128, 4, 4), S(256, 8, 5, 2, wtop=True),
            S(128, 8, 4, ahead=1, cpw=2)]


def swap2_variants(m: int) -> list:
    """The later rounds' `SwapTiles` for the skinny linears at 256 rows (down, qkv, o: few channel
    tiles): two token tiles of 128 with split-K 2 instead of split 4 (half the fp32 partials), the
    late retire (wtop) and the gathered x, beside the table's launches (x permuted by the Triton
    pass now)."""
    from tokenmill.layers.quantization.triton_int4_dot_gemm import SwapTiles as S

    if m != 256:  # the table's launches only (compiling them warms the cache an engine started next reads)
        return _table_launches(m)
    return [*_table_launches(m), S(128, 8, 4, 2), S(128, 8, 5, 2, wtop=True), S(128, 8, 4, 2, xnat=True),
            S(128, 4, 4, 2), S(128, 8, 4), S(128, 8, 5, wtop=True), S(128, 8, 5, xnat=True, wtop=True),
            S(128, 4, 4), S(256, 8, 5, 4, wtop=True), S(128, 8, 4, 4), S(128, 8, 5, 4, wtop=True),
            S(128, 4, 4, 2, xnat=True), S(64, 4, 4, 2), S(256, 8, 4, ahead=1)]


def ahead_variants(m: int) -> list:
    """Session 9's `SwapTiles` at 256 rows: the words' register prefetch 3 or 4 steps deeper (ahead
    3, 4: a step of a small tile is shorter than HBM's latency, the loop waits on its words), which
    may let the skinny linears (down, qkv, o) drop split-K (its fp32 partials cost 15-30 us a call in
    session 8's sweeps) or take tiles of 64 channels (c64: twice the CTAs), beside the table's."""
    from tokenmill.layers.quantization.triton_int4_dot_gemm import SwapTiles as S

    if m != 256:
        return _table_launches(m)
    return [*_table_launches(m), S(256, 8, 4, 1, 64, 3), S(128, 8, 5, 2, 64, 4, wtop=True), S(128, 8, 4, 1, 64, 4),
            S(128, 8, 6, 1, 64, 4, wtop=True), S(128, 4, 4, 1, 64, 4), S(128, 4, 6, 1, 64, 4),
            S(128, 4, 4, 2, 64, 4)]  # (t256 c64 a4 spills: not listed)


def run_tiles(t, x, qm, scales, zeros, group, counters, pso=None):
    """One launch of any GEMM: `DotTiles` (triton_int4_dot_gemm), `GluonTiles` (gluon_int4_gemm) or
    `SwapTiles` (gluon_int4_swap_gemm)."""
    from tokenmill.layers.quantization.triton_int4_dot_gemm import GluonTiles, SwapTiles, dot_gemm

    if isinstance(t, GluonTiles):
        from tokenmill.layers.quantization.gluon_int4_gemm import gluon_gemm

        return gluon_gemm(x, qm, scales, zeros, group, t, sz=pso, counters=counters)
    if isinstance(t, SwapTiles):
        from tokenmill.layers.quantization.gluon_int4_swap_gemm import swap_gemm

        return swap_gemm(x, qm, scales, zeros, group, t, sz=pso, counters=counters)
    return dot_gemm(x, qm, scales, zeros, group, t, counters, sz=pso)


def _rows(cuda: bool) -> tuple[int, ...]:
    return tuple(int(r) for r in os.environ.get("INT4_GEMM_ROWS", "256,64,1024,128,16,512" if cuda else "16,48").split(","))


def _calls(device: str, smoke: bool):
    """One small call per compiled variant (sizes multiples of 16, as the Llama shapes)."""
    from tokenmill.layers.quantization import int4_packing as packing
    from tokenmill.layers.quantization import triton_int4_mma as mma
    group = SMOKE_GROUP if smoke else GROUP
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    n, k = (256, 256) if smoke else (1024, 4096)
    wt = packing.from_codes(packing.quantize_int4(torch.randn(n, k, device=device), group, sym=False), dt,
                            act_order=False)
    qm = packing.to_mma(wt.qweight)
    counters = torch.zeros(4096, dtype=torch.int32, device=device)
    calls, seen = [], set()
    for m in _rows(device == "cuda"):
        x = torch.randn(m, k, device=device, dtype=dt)
        for t in variants(m, smoke):
            if t in seen:
                continue
            seen.add(t)
            calls.append((f"gemm {t.label()} m{m}", lambda t=t, x=x: run_tiles(t, x, qm, wt.scales, wt.zeros, group,
                                                                               counters)))
    calls.append(("mma dequant", lambda: mma.mma_dequantize(qm, wt.scales, wt.zeros, group, dt)))
    return calls


def precompile_shard(shard: str) -> None:
    triton_precompile.compile_shard(_calls("cuda", False), shard)


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def sweep(results: dict, device: str, time_ms, cycled, check, out_dir: str) -> None:
    """time_ms(fn, device[, reps]), cycled(tensors) and check(ok, what) come from gpu_quant.py."""
    from tokenmill.layers.quantization import int4_packing as packing
    from tokenmill.layers.quantization import stream_tiles
    from tokenmill.layers.quantization import triton_int4_mma as mma
    from tokenmill.layers.quantization.triton_int4_dot_gemm import packed_scale_offset

    cuda = device == "cuda"
    smoke = not cuda
    shapes = SMOKE_SHAPES if smoke else LLAMA_SHAPES
    if os.environ.get("INT4_GEMM_LINEARS") and not smoke:  # e.g. down,qkv,o: these linears only
        shapes = {nm: shapes[nm] for nm in os.environ["INT4_GEMM_LINEARS"].split(",")}
    group = SMOKE_GROUP if smoke else GROUP
    dt = torch.bfloat16 if cuda else torch.float32
    if cuda:
        triton_precompile.compile_in_processes(__file__, "--precompile", min(15, max(1, (os.cpu_count() or 2) - 1)),
                                               float(os.environ.get("INT4_GEMM_COMPILE_S", "30")), "int4gemm")
    deadline = time.perf_counter() + float(os.environ.get("INT4_GEMM_BUDGET_S", "60"))
    rec = results.setdefault("int4gemm", {})
    best: dict = {}  # (m, name) -> (ms, tiles)
    rows = _rows(cuda)
    data = {}
    for name, (n, k) in shapes.items():
        g = torch.Generator(device=device).manual_seed(0)
        w = torch.randn(n, k, device=device, generator=g).to(dt) * 0.02
        wt = packing.from_codes(packing.quantize_int4(w, group, sym=False), dt, act_order=False)
        qm = packing.to_mma(wt.qweight)
        data[name] = (packing.dequantize(wt, group, torch.float32), qm, wt.scales, wt.zeros,
                      stream_tiles.SplitCounters(n, torch.device(device)).tensor, cycled([w]),
                      cycled([qm, wt.scales, wt.zeros, packed_scale_offset(wt.scales, wt.zeros) if cuda else wt.scales]))
        if cuda:  # every copy's scales carry their packed scales, as the engine's do from load: "engine
            for _ in range(12):  # before" must not pack them inside its timed graph (session 9: +10 us on qkv)
                c = data[name][6]()
                c[1]._int4_dot_sz = c[3]
        del w, wt
    # rows outside, linears inside: the first row count for all four linears first (the budget's cut)
    for m, (name, (n, k)) in [(m, s) for m in rows for s in shapes.items()]:
        if time.perf_counter() > deadline:
            break
        ref_w, qm, scales, zeros, counters, bf16_w, mma_w = data[name]
        x = torch.randn(m, k, device=device, dtype=dt)
        ref = x.float() @ ref_w
        r = rec.setdefault(f"m{m}/{name}", {})

        def note(label, fn, tiles=None, r=r, m=m, name=name):
            if time.perf_counter() > deadline:
                return
            ms = time_ms(fn, device)
            r[label] = ms * 1000
            if tiles is not None and ms < best.get((m, name), (float("inf"),))[0]:
                best[(m, name)] = (ms, tiles)
        note("bf16", lambda: x @ bf16_w()[0].t())
        err = _rel(mma.mma_matmul(x, qm, scales, zeros, group, counters), ref)
        check(err < 1e-2 and not counters.any(), f"int4 mma_matmul (engine before) {name} m={m}: rel err {err:.1e}")
        note("engine before", lambda: mma.mma_matmul(x, *mma_w()[:3], group, counters))
        if m > mma.ROWS:
            note("dequant + mm", lambda: x @ mma.mma_dequantize(*mma_w()[:3], group, dt))
        for t in variants(m, smoke):
            try:
                err = _rel(run_tiles(t, x, qm, scales, zeros, group, counters), ref)
                if err > 1e-2 or counters.any():
                    check(False, f"int4 mma GEMM {name} m={m} {t.label()}: rel err {err:.1e}, counters zeroed "
                                 f"{not counters.any()}")
                    continue
                note(t.label(), lambda t=t: _gemm_on(mma_w(), x, group, t, counters), t)
            except Exception as e:  # noqa: BLE001 - a variant that fails is reported, not fatal
                check(False, f"int4 mma GEMM {name} m={m} {t.label()}: {type(e).__name__}: {str(e)[:400]}")
        ranked = sorted((v, lab) for lab, v in r.items())
        print(f"  m{m} {name} {n}x{k}: " + "; ".join(f"{lab} {v:.1f}" for v, lab in ranked), flush=True)
        _write(results, out_dir)
    if cuda and time.perf_counter() < deadline:  # in a CUDA graph, replayed: split-K counters reset every time
        ref_w, qm, scales, zeros, counters, _, _ = data["qkv"]
        xs = [torch.randn(64, qm.shape[1] * 64, device=device, dtype=dt) for _ in range(3)]
        if os.environ.get("INT4_GEMM_SET") == "ahead":  # the deeper prefetch, split-K, in a graph
            from tokenmill.layers.quantization.triton_int4_dot_gemm import SwapTiles
            t = SwapTiles(128, 4, 4, 2, 64, 4)  # (a listed launch: compiled already; 64 rows, a ragged tile)
        elif os.environ.get("INT4_GEMM_SET") == "gluon":
            from tokenmill.layers.quantization.triton_int4_dot_gemm import GluonTiles
            t = GluonTiles(64, 128, 4, 4, 2)
        elif os.environ.get("INT4_GEMM_SET") in ("swap", "swap2", "ahead"):
            from tokenmill.layers.quantization.triton_int4_dot_gemm import SwapTiles
            t = SwapTiles(64, 4, 4, 2)
        else:  # the dot set
            from tokenmill.layers.quantization.triton_int4_dot_gemm import DotTiles
            t = DotTiles(64, 128, 64, 4, 4, split=2)
        run_tiles(t, xs[0], qm, scales, zeros, group, counters)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = [run_tiles(t, xi, qm, scales, zeros, group, counters) for xi in xs]
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        errs = [_rel(o, xi.float() @ ref_w) for o, xi in zip(outs, xs)]
        check(max(errs) < 1e-2 and not counters.any(), f"int4 GEMM {t.label()} replayed in a CUDA graph: "
                                                       f"rel err {max(errs):.1e}")
        del graph, outs
    summary = {}
    for m in rows:
        per = {nm: rec.get(f"m{m}/{nm}", {}) for nm in shapes}
        if not all(per.values()) or not all((m, nm) in best for nm in shapes):
            continue
        tot = {key: sum(per[nm].get(key, float("nan")) for nm in shapes) for key in ("bf16", "engine before")}
        tot["gemm best each"] = sum(best[(m, nm)][0] for nm in shapes) * 1000
        summary[f"m{m}"] = tot
        print(f"  INT4GEMM m{m}: the layer's four linears: bf16 {tot['bf16']:.0f} us, engine before "
              f"{tot['engine before']:.0f}, GEMM best each {tot['gemm best each']:.0f} "
              f"({tot['gemm best each'] / tot['bf16']:.2f}x bf16)", flush=True)
    for (m, nm), (ms, t) in sorted(best.items()):
        n, k = shapes[nm]
        before = rec[f"m{m}/{nm}"].get("engine before", float("inf"))
        print(f"  GEMM TABLE ({m}, {n}, {k}): {t.code()},  # {ms * 1000:.1f} us (engine before {before:.1f})",
              flush=True)
    results["int4gemm_summary_us"] = summary
    _write(results, out_dir)


def _gemm_on(w, x, group, t, counters):
    """The GEMM on one cycled copy (qm, scales, zeros, packed scales and offsets)."""
    return run_tiles(t, x, w[0], w[1], w[2], group, counters, pso=w[3] if w[3].dtype == torch.int32 else None)


def _write(results: dict, out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "int4gemm.json"), "w") as f:
        json.dump({k: v for k, v in results.items() if k.startswith("int4gemm")}, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--precompile":
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        os.environ["TRITON_INTERPRET"] = "0"
        precompile_shard(sys.argv[2])
