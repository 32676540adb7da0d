"""The `int4b1` part of scripts/gpu_quant.py: INT4 W4A16 at batch 1 (issue 22), in one process.

1. kernels: each Llama-8B linear's tensor-core GEMV (`triton_int4_mma`) in launch variants (PDL
   on / off, the first step preloaded or not, load hints, split-K, warps, groups a step, words
   prefetched 1-2 steps ahead into L2 / L1, words through a cp.async ring of shared memory), each
   checked against a float32 reference, then timed as the engine runs it: 16 distinct weights
   (past L2) each behind an RMSNorm that writes its x (a PDL kernel, as in a layer), in one CUDA
   graph; us per norm + GEMV pair. The best launch per shape makes a table
   (TOKENMILL_INT4_MMA_TABLE) for the engines below. With PDL, a race check: x written by a
   kernel that lets its dependents start at once and spins before writing (x NaN before each
   replay): the GEMV must read only the written x; the same check on a GEMV launched with PDL
   but without its wait (planted) must fail; and on gate_up's SiLU-and-mul epilogue (split-K
   and one slice). INT4_B1_VARIANTS picks the launches (`variants`).
2. layers: 8 distinct Llama-8B layers' GEMVs with RMSNorm / SiLU-and-mul between them (an
   attention stand-in: an RMSNorm over q) in one graph: us per layer for main's launch (no PDL
   in the GEMVs), the default launch, the committed TABLE and the sweep's table, each of the
   last two also with SiLU-and-mul in gate_up's epilogue (no SiLU kernel); main's and the
   default's outputs must be bitwise equal (PDL changes no arithmetic).
3. engines (Llama-3.1-8B shape, dummy weights, graphs on, GPTQ group 128, prefix caching off):
   INT4 with the table (and a torch.profiler window over its batch-1 decode steps: kernel groups
   and what each kernel adds under PDL, `benchmarks/step_path`), bf16, and INT4 with main's
   launches, and INT4 with the committed TABLE (int4head); batch-1 ms per output token each
   (`gpu_quant.ms_per_token`), ratios to bf16. INT4_B1_ENGINES picks them (default
   bf16,int4head,int4branch,int4: int4head is main's engine (its TABLE, no SiLU epilogue),
   int4branch this branch's (the committed TABLE, SiLU in gate_up's epilogue; int4silu the same),
   int4 the sweep's table with the SiLU epilogue; `ENGINE_ENV`). INT4_B1_PROFILE names the engine
   profiled (default int4). The engines' self-tests run first in this process (their outcome printed).
   Session 9: int4nofold (and int4nofold2) / int4scale (and int4scaleprof) / int4fold / int4row
   (TOKENMILL_INT4_NORM_FOLD=0 / scale / prologue / row: `int4_norm_fold`'s modes); the INT4
   engines' greedy tokens on one prompt are compared (`int4b1_greedy_equal`). INT4_B1_SKIP_KERNELS=1:
   parts 1 and 2 skipped.
INT4_B1_BUDGET_S (default 140) stops starting things past it. Figures go to
$OUT/part-int4b1-partial.json as they come.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from dataclasses import replace

import torch

# the largest first: a sweep cut by its deadline leaves the defaults on the smallest
SHAPES = {"gate_up": (28672, 4096), "down": (4096, 14336), "qkv": (6144, 4096), "o": (4096, 4096)}
SMOKE_SHAPES = {"gate_up": (512, 256), "down": (256, 512), "qkv": (384, 256), "o": (256, 256)}
GROUP, SMOKE_GROUP = 128, 64
CHAIN, LAYERS = 16, 8  # weights per shape's chain; layers in the layer chain
ENV = "TOKENMILL_INT4_MMA_TABLE"


def _save(results: dict, out: str) -> None:
    with open(os.path.join(out, "part-int4b1-partial.json"), "w") as f:
        json.dump(results, f, indent=2)


def variants(n: int, k: int, group: int) -> list:
    """The launches tried per shape. INT4_B1_VARIANTS=pipe (the default): the committed TABLE's
    launch with and without the pipelined loop, and the loop at other warps, splits, hints and
    with one step of L2 prefetch; =regs (round 1): the TABLE's launch, and it with fewer registers
    a thread (`maxnreg`: more CTAs resident an SM) at its split and at twice it, with two groups a
    loop step under a register cap, and pipelined (`pipe`: each step loads the next one's words);
    =all: main's (no PDL), the default, and around it (session 7's sweep)."""
    from tokenmill.layers.quantization import triton_int4_mma as mma

    d = mma.default_config(n, k, group)
    which = os.environ.get("INT4_B1_VARIANTS", "pipe")
    t = mma.TABLE.get((n, k), d)
    s2 = 2 * t.split
    if which == "pipe":  # session 8, round 2: the pipelined loop around the committed TABLE
        vs = [t, replace(t, pipe=not t.pipe), replace(t, pipe=True, warps=8), replace(t, pipe=True, hint=not t.hint),
              replace(t, pipe=True, ahead=1), replace(t, split=s2, pipe=False), replace(t, split=s2, pipe=True),
              replace(t, split=max(1, t.split // 2), pipe=True)]
        return [v for v in dict.fromkeys(vs) if mma.fits(n, k, group, v)]
    if which == "regs":  # session 8, round 1 (the TABLE then: without the pipelined loop)
        t = replace(t, pipe=False)
        # two groups a loop step (a small GEMV's whole K slice loaded before the PDL wait) need ~94
        # registers: capped so that the grid stays one wave (ptxas spills a few)
        vs = [t, replace(t, maxnreg=48), replace(t, split=s2, maxnreg=48), replace(t, split=s2), replace(t, gpc=2, maxnreg=72),
              replace(t, gpc=2, maxnreg=64), replace(t, split=s2, gpc=2, maxnreg=72),
              replace(t, warps=4, gpc=2, maxnreg=64), replace(t, split=max(1, t.split // 2), gpc=2, maxnreg=72),
              replace(t, pipe=True), replace(t, split=max(1, t.split // 2), pipe=True), replace(t, pipe=True, ahead=1),
              replace(t, pipe=True, ahead=2)]
        return [v for v in dict.fromkeys(vs) if mma.fits(n, k, group, v)]
    vs = [replace(d, pdl=False), d, replace(d, pre=False), replace(d, hint=True),
          replace(d, split=d.split * 2), replace(d, split=max(1, d.split // 2)),
          replace(d, warps=8), replace(d, warps=2, split=d.split * 2), replace(d, gpc=2),
          replace(d, ahead=1), replace(d, ahead=2), replace(d, ahead=1, ahead_l1=True), replace(d, ahead=1, hint=True),
          replace(d, split=max(1, d.split // 2), ahead=1), replace(d, split=max(1, d.split // 4), ahead=2),
          replace(d, ring=4), replace(d, ring=8), replace(d, ring=16), replace(d, ring=8, hint=True),
          replace(d, ring=8, split=max(1, d.split // 2)), replace(d, ring=16, split=max(1, d.split // 2)),
          replace(d, ring=8, warps=8)]
    return [v for v in dict.fromkeys(vs) if mma.fits(n, k, group, v)]


def _compile_calls(smoke: bool = False) -> list:
    """One small call per launch `kernels` times (the same specializations: one row, N and K
    multiples of 16, aligned), the race check's kernels and the layer chain's norms."""
    from tokenmill.layers.quantization import triton_int4_mma as mma
    from tokenmill.layers.triton_ops.rms_norm import fused_add_rms_norm, rms_norm
    from tokenmill.layers.triton_ops.silu_and_mul import silu_and_mul

    shapes, group = (SMOKE_SHAPES, SMOKE_GROUP) if smoke else (SHAPES, GROUP)
    dt, dev = torch.bfloat16, "cuda"
    calls, seen = [], set()
    counters = torch.zeros(4096, dtype=torch.int32, device=dev)
    for n, k in shapes.values():
        qm, s, z = _weights(128, k, group, 1, dev, dt)[0]
        x = torch.randn(1, k, device=dev, dtype=dt)
        launches = variants(n, k, group)
        if (n, k) == shapes["gate_up"]:  # the SiLU epilogue: the sweep's launches, the race check's one slice
            launches += [replace(c, split=1) for c in launches]
        for c in launches:
            for silu in (False, True) if (n, k) == shapes["gate_up"] else (False,):
                if (c, silu) not in seen and mma.fits(128, k, group, c):
                    seen.add((c, silu))
                    calls.append((c.label() + (" silu" if silu else ""),
                                  lambda c=c, x=x, qm=qm, s=s, z=z, silu=silu: mma.mma_gemv(x, qm, s, z, group, c, counters,
                                                                                         silu=silu)))
        calls.append(("norm", lambda x=x, k=k: rms_norm(x, torch.ones(k, device=dev, dtype=dt), 1e-5)))
    h = torch.randn(1, shapes["o"][0], device=dev, dtype=dt)
    calls.append(("add norm", lambda: fused_add_rms_norm(h, h.clone(), torch.ones_like(h[0]), 1e-5)))
    calls.append(("silu", lambda: silu_and_mul(torch.randn(1, 2 * shapes["down"][1], device=dev, dtype=dt))))
    return calls


def precompile_shard(shard: str) -> None:
    import triton_precompile
    triton_precompile.compile_shard(_compile_calls(), shard)


def _table_text(best: dict) -> str:
    return ";".join(f"{n}x{k}={c.label()}" for (n, k), c in best.items())


def _weights(n: int, k: int, group: int, count: int, device: str, dt):
    """`count` random mma-layout weights (words, scales ~0.01, zeros 8) of one shape."""
    g = torch.Generator(device=device).manual_seed(n + k)
    out = []
    for _ in range(count):
        qm = torch.randint(-2**31, 2**31 - 1, (n // 16, k // 64, 32, 4), dtype=torch.int32, device=device, generator=g)
        s = (torch.rand(k // group, n, device=device, generator=g) * 0.02 + 0.005).to(dt)
        z = torch.full((k // group, n), 8.0, device=device, dtype=dt)
        out.append((qm, s, z))
    return out


def _race_check(name, n, k, group, c, device, dt, check, planted: bool, silu: bool = False) -> bool:
    """x NaN before each replay; in the graph a slow writer then the GEMV (module docstring).
    silu: the GEMV's SiLU-and-mul epilogue on the weight in `gate_up_pairs` order."""
    from tokenmill.layers.quantization import int4_packing as packing
    from tokenmill.layers.quantization import stream_tiles
    from tokenmill.layers.quantization import triton_int4_mma as mma
    from pdl_slow_writer import slow_write  # scripts/

    g = torch.Generator(device=device).manual_seed(7)
    w = torch.randn(n, k, device=device, generator=g) * 0.02
    wt = packing.from_codes(packing.quantize_int4(w, group, sym=True), dt, act_order=False)
    ref_w = packing.dequantize(wt, group, torch.float32)
    if silu:
        order = packing.gate_up_pairs(n).to(device)
        wt = packing.Int4Weights(wt.qweight[:, order], wt.scales[:, order].contiguous(),
                                 wt.zeros[:, order].contiguous(), None)
    qm = packing.to_mma(wt.qweight)
    counters = stream_tiles.SplitCounters(n, torch.device(device)).tensor
    xs = [torch.randn(1, k, device=device, dtype=dt) for _ in range(3)]

    def ref(x):
        r = x.float() @ ref_w
        return torch.nn.functional.silu(r[:, :n // 2]) * r[:, n // 2:] if silu else r
    ys = [torch.empty_like(x) for x in xs]

    def gemv(y):
        if not planted:
            return mma.mma_gemv(y, qm, wt.scales, wt.zeros, group, c, counters, silu=silu)
        # planted: launched with PDL, but the kernel never waits (USE_PDL off inside)
        out = torch.empty((1, n), dtype=dt, device=device)
        part = torch.empty((c.split, 1, n), dtype=torch.float32, device=device) if c.split > 1 else out
        setup, step, store, store32 = mma._asm_texts(group // 64, c.gpc, dt == torch.float16, c.early, c.zmma, c.hint)
        mma._mma_gemv_kernel[(n // (16 * c.warps), c.split)](
            y, qm, wt.scales, wt.zeros, out, part, counters if c.split > 1 else out, 1, n, k, y.stride(0),
            wt.scales.stride(0), GROUP=group, SPLIT=c.split, WARPS=c.warps, GPC=c.gpc, ASM=True, ASM_SETUP=setup,
            ASM_STEP=step, ASM_STORE=store, ASM_STORE_F32=store32, num_warps=c.warps, USE_PDL=False, launch_pdl=True)
        return out

    def body(ys=ys):
        outs = []
        for x, y in zip(xs, ys):
            slow_write(x, y)
            outs.append(gemv(y))
        return outs
    body()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = body()
    errs = []
    for _ in range(3):
        for y in ys:
            y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        errs.append(max(((o.float() - ref(x)).norm() / ref(x).norm()).nan_to_num(9.0).item()
                        for o, x in zip(outs, xs)))
    ok = max(errs) < 1e-2 and not counters.any()
    what = (f"int4 mma GEMV {name} {c.label()}{' silu' if silu else ''} behind a slow PDL writer"
            f"{' (planted: no wait)' if planted else ''}")
    check(ok != planted, f"{what}: worst rel err {max(errs):.1e}{' (must fail)' if planted else ''}")
    del graph
    return ok


def kernels(results: dict, device: str, smoke: bool, check, deadline: float) -> dict:
    """Part 1; returns the best launch per (N, K)."""
    from tokenmill.benchmarks.graph_timing import graph_us
    from tokenmill.layers.quantization import int4_packing as packing
    from tokenmill.layers.quantization import stream_tiles
    from tokenmill.layers.quantization import triton_int4_mma as mma
    from tokenmill.layers.triton_ops.rms_norm import rms_norm

    cuda = device == "cuda"
    shapes, group = (SMOKE_SHAPES, SMOKE_GROUP) if smoke else (SHAPES, GROUP)
    dt = torch.bfloat16 if cuda else torch.float32
    if cuda:  # compiling is most of this part's kernel time: in parallel processes, into Triton's cache
        import triton_precompile
        triton_precompile.compile_in_processes(__file__, "--precompile", min(12, max(1, (os.cpu_count() or 2) - 2)),
                                               float(os.environ.get("INT4_B1_COMPILE_S", "30")), "int4b1")
    rec = results.setdefault("int4b1_gemvs", {})
    best: dict = {}
    for name, (n, k) in shapes.items():
        r = rec.setdefault(name, {})
        # correctness of every variant: one weight, float32 reference
        g = torch.Generator(device=device).manual_seed(1)
        w = torch.randn(n, k, device=device, generator=g) * 0.02
        wt = packing.from_codes(packing.quantize_int4(w, group, sym=True), dt, act_order=False)
        qm = packing.to_mma(wt.qweight)
        ref_w = packing.dequantize(wt, group, torch.float32)
        counters = stream_tiles.SplitCounters(n, torch.device(device)).tensor
        x = torch.randn(1, k, device=device, dtype=dt)
        ref = x.float() @ ref_w
        good = []
        for c in variants(n, k, group):
            try:
                err = ((mma.mma_gemv(x, qm, wt.scales, wt.zeros, group, c, counters).float() - ref).norm()
                       / ref.norm()).item()
                if err < 1e-2 and not counters.any():
                    good.append(c)
                else:
                    check(False, f"int4 mma GEMV {name} {c.label()}: rel err {err:.1e}")
            except Exception as e:  # noqa: BLE001 - a variant that fails is reported, not fatal
                check(False, f"int4 mma GEMV {name} {c.label()}: {type(e).__name__}: {str(e)[:300]}")
        check(len(good) == len(variants(n, k, group)), f"int4 mma GEMV {name}: {len(good)} launches within 1e-2")
        del w, wt, qm, ref_w
        if not cuda or time.perf_counter() > deadline:
            best[(n, k)] = mma.default_config(n, k, group)
            continue
        d = mma.default_config(n, k, group)
        if name == "down":  # PDL races: x written late must still be read after the wait (split-K too)
            _race_check(name, n, k, group, d, device, dt, check, planted=False)
            _race_check(name, n, k, group, d, device, dt, check, planted=True)
            if mma.fits(n, k, group, replace(d, pipe=True)):  # the pipelined loop's first loads precede the wait
                _race_check(name, n, k, group, replace(d, pipe=True), device, dt, check, planted=False)
            if mma.fits(n, k, group, replace(d, ring=8)):  # the ring's launch waits before its loop
                _race_check(name, n, k, group, replace(d, ring=8), device, dt, check, planted=False)
        if name == "gate_up":  # the SiLU-and-mul epilogue (its split-K sum and its one-slice store)
            t = mma.config_for(n, k, group)
            _race_check(name, n, k, group, t, device, dt, check, planted=False, silu=True)
            _race_check(name, n, k, group, replace(t, split=1), device, dt, check, planted=False, silu=True)
        # timing: CHAIN distinct weights, each behind an RMSNorm writing its x (a PDL kernel)
        ws = _weights(n, k, group, CHAIN, device, dt)
        x0 = torch.randn(1, k, device=device, dtype=dt)
        nw = torch.ones(k, device=device, dtype=dt)
        for c in good:
            if time.perf_counter() > deadline:
                break

            def chain(c=c, ws=ws, x0=x0, nw=nw, counters=counters):
                for qm_, s_, z_ in ws:
                    mma.mma_gemv(rms_norm(x0, nw, 1e-5), qm_, s_, z_, group, c, counters)
            r[c.label()] = graph_us(chain, replays=10) / CHAIN
        r["norm alone"] = graph_us(lambda x0=x0, nw=nw: rms_norm(x0, nw, 1e-5), replays=10)
        timed = [(r[c.label()], c) for c in good if c.label() in r]
        if timed:
            best[(n, k)] = min(timed, key=lambda t: t[0])[1]
        mb = (n * k / 2 + 4 * n * k / group) / 1e6
        ranked = sorted((v, lab) for lab, v in r.items())
        print(f"  {name} {n}x{k} ({mb:.1f} MB), us per norm + GEMV: "
              + "; ".join(f"{lab} {v:.2f}" for v, lab in ranked), flush=True)
        del ws
        torch.cuda.empty_cache()
    results["int4b1_table"] = _table_text(best)
    print(f"  INT4 MMA TABLE: {results['int4b1_table']}", flush=True)
    return best


def layers(results: dict, device: str, smoke: bool, best: dict, check) -> None:
    """Part 2: the layer chain per launch set (module docstring)."""
    from tokenmill.benchmarks.graph_timing import graph_us
    from tokenmill.layers.quantization import stream_tiles
    from tokenmill.layers.quantization import triton_int4_mma as mma
    from tokenmill.layers.triton_ops.rms_norm import fused_add_rms_norm, rms_norm
    from tokenmill.layers.triton_ops.silu_and_mul import silu_and_mul

    shapes, group = (SMOKE_SHAPES, SMOKE_GROUP) if smoke else (SHAPES, GROUP)
    dt = torch.bfloat16
    hidden = shapes["o"][0]
    ws = {name: _weights(n, k, group, LAYERS, device, dt) for name, (n, k) in shapes.items()}
    counters = {name: stream_tiles.SplitCounters(n, torch.device(device)).tensor for name, (n, _) in shapes.items()}
    nw = torch.ones(hidden, device=device, dtype=dt)
    x0 = torch.randn(1, hidden, device=device, dtype=dt)
    sets = {"main (GEMVs without PDL)": {s: replace(mma.default_config(*s, group), pdl=False) for s in shapes.values()},
            "default": {s: mma.default_config(*s, group) for s in shapes.values()},
            "main's TABLE (no pipelined loop)": {s: replace(mma.config_for(*s, group), pipe=False) for s in shapes.values()},
            "committed TABLE": {s: mma.config_for(*s, group) for s in shapes.values()},
            "committed TABLE, SiLU in gate_up's epilogue": {s: mma.config_for(*s, group) for s in shapes.values()},
            "table": dict(best), "table, SiLU in gate_up's epilogue": dict(best)}
    rec = results.setdefault("int4b1_layers", {})
    outs = {}
    for label, launches in sets.items():
        silu = "SiLU" in label  # gate_up's GEMV writes silu(gate) * up (the random words: any channel order)

        def layer_chain(launches=launches, silu=silu):
            res = x0.clone()
            h = rms_norm(res, nw, 1e-5)
            for i in range(LAYERS):
                def lin(name, t, i=i):
                    qm_, s_, z_ = ws[name][i]
                    return mma.mma_gemv(t, qm_, s_, z_, group, launches[shapes[name]], counters[name])
                qkv = lin("qkv", h)
                a = rms_norm(qkv[:, :hidden], nw, 1e-5)  # attention's stand-in: a PDL kernel over q
                h, res = fused_add_rms_norm(lin("o", a), res, nw, 1e-5)
                if silu:
                    qm_, s_, z_ = ws["gate_up"][i]
                    act = mma.mma_gemv(h, qm_, s_, z_, group, launches[shapes["gate_up"]], counters["gate_up"], silu=True)
                else:
                    act = silu_and_mul(lin("gate_up", h))
                h, res = fused_add_rms_norm(lin("down", act), res, nw, 1e-5)
            return h
        outs[label] = layer_chain()
        rec[label] = graph_us(layer_chain, replays=10) / LAYERS
        print(f"  layer chain, {label}: {rec[label]:.1f} us per layer", flush=True)
    a, b = outs["main (GEMVs without PDL)"], outs["default"]
    check(torch.equal(a, b) and bool(torch.isfinite(a).all()),
          "layer chain: main's launches and the default (PDL) give bitwise equal outputs")


# Engines' switches beside the launch table: main's engines keep gate_up in natural order (the
# SiLU-and-mul kernel after it); int4silu: the committed TABLE with SiLU in gate_up's epilogue.
ENGINE_ENV = {"int4main": {"TOKENMILL_INT4_SILU_PAIRS": "0"}, "int4head": {"TOKENMILL_INT4_SILU_PAIRS": "0"},
              # session 9: the committed TABLE without / with the norms and residual adds in the GEMVs
              "int4nofold": {"TOKENMILL_INT4_NORM_FOLD": "0"}, "int4nofold2": {"TOKENMILL_INT4_NORM_FOLD": "0"},
              "int4fold": {"TOKENMILL_INT4_NORM_FOLD": "prologue"},
              "int4scale": {"TOKENMILL_INT4_NORM_FOLD": "scale"}, "int4scale2": {"TOKENMILL_INT4_NORM_FOLD": "scale"},
              "int4scaleprof": {"TOKENMILL_INT4_NORM_FOLD": "scale"},
              "int4row": {"TOKENMILL_INT4_NORM_FOLD": "row"},  # (row: each norm a pass over the row)
              # the scale fold with torch's argmax instead of the greedy kernel
              "int4scalegreedy0": {"TOKENMILL_INT4_NORM_FOLD": "scale", "TOKENMILL_TRITON_GREEDY": "0"},
              # decode attention's split rule: at least 128 / 256 keys a share (batch 1 x ~768 keys: 4 / 2 splits, not 8)
              "bf16k256": {"TOKENMILL_ATTN_MIN_KEYS_PER_SPLIT": "256"},
              "int4scalek128": {"TOKENMILL_INT4_NORM_FOLD": "scale", "TOKENMILL_ATTN_MIN_KEYS_PER_SPLIT": "128"},
              "int4scalek256": {"TOKENMILL_INT4_NORM_FOLD": "scale", "TOKENMILL_ATTN_MIN_KEYS_PER_SPLIT": "256"},
              # session 10: decode attention's reads before the PDL wait (PREWAIT) and the rotary + KV write inside
              # it (ROPE), both on by default (int4new, bf16): main's path (int4off, bf16off), PREWAIT alone (int4pw)
              "int4off": {"TOKENMILL_ATTN_PREWAIT": "0", "TOKENMILL_ATTN_ROPE": "0"},
              "bf16off": {"TOKENMILL_ATTN_PREWAIT": "0", "TOKENMILL_ATTN_ROPE": "0"},
              "int4pw": {"TOKENMILL_ATTN_ROPE": "0"},
              "int4n64": {"TOKENMILL_ATTN_PREWAIT": "64"}}
# int4head runs main's TABLE (this branch's without the pipelined loop); int4branch and int4silu this
# branch's committed TABLE (""); int4 the sweep's table.


def _engine(config_dir, shape, label: str, table: str, window: dict | None):
    import gpu_quant

    from tokenmill import LLM
    from tokenmill.worker.device_profile import ENV_VAR
    path = config_dir(shape, gpu_quant.GPTQ_CONFIG) if label.startswith("int4") else config_dir(shape)
    switches = ENGINE_ENV.get(label, {})
    saved = {k: os.environ.get(k) for k in (ENV, ENV_VAR, *switches)}
    os.environ.update(switches)
    if label.startswith("int4"):
        os.environ[ENV] = table
    if window:
        os.environ[ENV_VAR] = json.dumps(window)
    try:
        start = time.perf_counter()
        llm = LLM(path, load_format="dummy", dtype="bfloat16", max_model_len=512 + 256 + 16, disable_log_stats=True,
                  enable_prefix_caching=False, max_num_seqs=int(os.environ.get("INT4_B1_MAX_SEQS", "1")))
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None)
            if v is not None:
                os.environ[k] = v
    print(f"  {label}: engine up in {time.perf_counter() - start:.0f} s"
          + (f" ({ENV}={table})" if label.startswith("int4") else "") + (f" {switches}" if switches else ""), flush=True)
    return llm, time.perf_counter() - start


def _greedy_tokens(llm, input_len: int, output_len: int) -> list[int]:
    import gpu_quant

    from tokenmill import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True, detokenize=False)
    return list(llm.generate(gpu_quant._prompts(1, input_len, seed=7), params, use_tqdm=False)[0].outputs[0].token_ids)


def engines(results: dict, smoke: bool, shape: dict, config_dir, out: str, ms_per_token, best: dict,
            deadline: float) -> list[str]:
    """Part 3; returns the engines that failed."""
    import gpu_fp8_b1_profile as b1

    from tokenmill.layers.quantization import triton_int4_mma as mma
    group = SMOKE_GROUP if smoke else GROUP
    shapes = SMOKE_SHAPES if smoke else SHAPES
    tables = {"int4": _table_text(best), "int4branch": "", "int4silu": "",  # "": the committed TABLE
              "int4head": ";".join(f"{n}x{k}={replace(mma.config_for(n, k, group), pipe=False).label()}"
                                   for n, k in shapes.values()),
              "int4main": ";".join(f"{n}x{k}={replace(mma.default_config(n, k, group), pdl=False).label()}"
                                   for n, k in shapes.values())}
    timings = results.setdefault("timings", {})
    greedy = results.setdefault("int4b1_greedy", {})
    failed = []
    profiled = os.environ.get("INT4_B1_PROFILE", "int4")  # the engine whose decode steps are profiled
    if not smoke:  # the engines' self-tests, here in this process (an engine runs them in its worker)
        from tokenmill.layers.quantization import int4
        ok = int4.mma_selftest(torch.device("cuda"), torch.bfloat16)
        silu = int4.silu_selftest(torch.device("cuda"), torch.bfloat16)
        from tokenmill.layers.quantization import int4_norm_fold
        fold = int4_norm_fold.selftest(torch.device("cuda"), torch.bfloat16)
        results["int4b1_selftests"] = {"mma": ok, "pipe": mma.PIPE_ENABLED, "silu": silu, "norm_fold": fold}
        print(f"  self-tests on this GPU: mma GEMV {ok}, pipelined loop {mma.PIPE_ENABLED}, SiLU epilogue {silu}, "
              f"folded norms / adds {fold}", flush=True)
    for label in os.environ.get("INT4_B1_ENGINES", "bf16,int4head,int4branch,int4").split(","):
        if time.perf_counter() > deadline:
            print(f"  {label}: skipped (budget)", flush=True)
            continue
        folder = os.path.join(out, f"int4b1_{label}")
        window = {"out_dir": folder, "batch": 1, "skip": 2 if smoke else 40, "steps": 3 if smoke else 24}
        try:
            llm, up = _engine(config_dir, shape, label, tables.get(label, ""), window if label == profiled else None)
            t0 = time.perf_counter()
            ms = ms_per_token(llm, 8 if smoke else 512, 8 if smoke else 256)
            timings[label] = {"batch1": ms, "engine_up_s": up}
            results.setdefault("int4b1_engine_tables", {})[label] = tables.get(label, "")
            print(f"  {label} batch1: {ms:.3f} ms/token ({time.perf_counter() - t0:.0f} s)", flush=True)
            greedy[label] = _greedy_tokens(llm, 8 if smoke else 512, 8 if smoke else 64)
            b1._free(llm)
            if label == profiled:
                b1._profile(results.setdefault("int4b1_profile", {}).setdefault(label, {}), label, folder,
                            shape["num_hidden_layers"])
        except Exception:  # noqa: BLE001 - the next engine still runs; the part fails at the end
            traceback.print_exc()
            failed.append(label)
        _save(results, out)
    int4s = [k for k in greedy if k.startswith("int4")]
    if len(int4s) > 1:  # the INT4 engines' greedy tokens (one batch-1 prompt): equal, position of the first difference
        a = greedy[int4s[0]]
        for k in int4s[1:]:
            diff = next((i for i, (u, v) in enumerate(zip(a, greedy[k])) if u != v), None)
            results.setdefault("int4b1_greedy_equal", {})[f"{int4s[0]}={k}"] = diff is None
            print(f"  greedy tokens {int4s[0]} vs {k}: " + ("equal" if diff is None else f"differ from token {diff}"),
                  flush=True)
    pairs = {"off": ("int4nofold", "int4nofold2"), "scale": ("int4scale", "int4scale2"),  # means over instances
             "new": ("int4new", "int4new2")}  # (session 10: against the mean of bf16 and bf16b where both ran)
    bf16s = [timings[lb]["batch1"] for lb in ("bf16", "bf16b") if lb in timings]
    for mode, labels in pairs.items():
        got = [timings[lb]["batch1"] for lb in labels if lb in timings]
        if got and bf16s:
            mean, base = sum(got) / len(got), sum(bf16s) / len(bf16s)
            results.setdefault("int4b1_mean", {})[mode] = {"ms": mean, "x_bf16": mean / base, "instances": got,
                                                           "bf16_instances": bf16s}
            print(f"  INT4 {mode}: mean of {len(got)} engines {mean:.3f} ms/token = {mean / base:.3f} x bf16 "
                  f"(mean of {len(bf16s)}: {base:.3f})", flush=True)
    for label in ("int4", "int4main", "int4head", "int4silu", "int4branch", "int4nofold", "int4fold", "int4row",
                  "int4scale", "int4nofold2", "int4scale2", "int4scaleprof",
                  "int4scalegreedy0", "bf16k256", "int4scalek128", "int4scalek256", "int4new", "int4off", "int4pw",
                  "bf16off", "int4new2", "bf16b", "int4n64"):
        if label in timings and "bf16" in timings:
            r = timings[label]["batch1"] / timings["bf16"]["batch1"]
            results.setdefault("int4b1_ratio", {})[label] = r
            print(f"  {label} / bf16 batch-1 ms/token: {timings[label]['batch1']:.3f} / "
                  f"{timings['bf16']['batch1']:.3f} = {r:.3f} (goal <= 0.4)", flush=True)
    return failed


def b1_part(results: dict, device: str, smoke: bool, shape: dict, config_dir, out: str, ms_per_token,
            check) -> None:
    """The part (module docstring); raises at the end if something failed to run."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    start = time.perf_counter()
    budget = float(os.environ.get("INT4_B1_BUDGET_S", "140"))
    results["int4b1_device"] = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"  int4b1 on {results['int4b1_device']}", flush=True)
    failed = []
    best: dict = {}
    try:
        if os.environ.get("INT4_B1_SKIP_KERNELS") != "1":  # (1: the engines alone)
            best = kernels(results, device, smoke, check, start + float(os.environ.get("INT4_B1_KERNELS_S", "45")))
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        failed.append("kernels")
    _save(results, out)
    print(f"  int4b1: kernels done at {time.perf_counter() - start:.0f} s", flush=True)
    if device == "cuda" and best:
        try:
            layers(results, device, smoke, best, check)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            failed.append("layers")
        _save(results, out)
        torch.cuda.empty_cache()
    print(f"  int4b1: layers done at {time.perf_counter() - start:.0f} s", flush=True)
    # an engine takes ~25 s: none starts past the budget or within 28 s of the part's kill time
    kill = float(os.environ.get("GPU_QUANT_PART_DEADLINE", "inf"))
    failed += engines(results, smoke, shape, config_dir, out, ms_per_token, best,
                      min(start + budget, start + (kill - time.time()) - 28))
    _save(results, out)
    if failed:
        raise RuntimeError(f"int4b1: {failed} failed")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--precompile":
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        os.environ["TRITON_INTERPRET"] = "0"
        precompile_shard(sys.argv[2])
