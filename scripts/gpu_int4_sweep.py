"""The `int4sweep` part of scripts/gpu_quant.py: the INT4 kernels where INT4 loses, per Llama-8B
linear, each checked against a float32 reference and timed from CUDA-graph replays with weights
cycled past L2 (HBM-bound, as in a forward), bf16 cuBLAS and the engine's current path measured
in the same process.

- one row: the register-prefetched GEMV (`triton_int4_prefetch_gemv`): panel width, arithmetic
  MODE, BLOCK_K, warps, PREFETCH depth (or cp.async stages), SPLIT; each linear's time against
  its int4 bytes (fraction of the copy bandwidth `--copy` measures in the same run);
- 256 rows (and 64, 1024): dequantize + cuBLAS and the engine's path (the swapped and fused
  Triton GEMMs timed here before lost everywhere; retired in session 11).
It prints, per section, each linear's best variants, the layer's four linears at their best, and
the table lines for `triton_int4_prefetch_gemv.TABLE`.
Compiling is most of the time: every variant compiles first in parallel processes.
INT4_SWEEP_SPLITS=wide tries 4x and 8x more K slices on the winners' bases.
INT4_SWEEP_SET=stream (one row): the table's launch per shape with what changes its access pattern
(STAGGER, L1 prefetch of the tiles ahead, cp.async stages, an unrolled loop, PDL, split x2 / /2,
arithmetic MODE 6: mode 3 with the rows summed before offsets, zeros and scales),
the read probes of `int4_read_probe` (the pattern's ceiling without arithmetic; a flat layout's),
and chains behind an elementwise kernel (PDL on / off; a PDL run checked in a replayed graph).
INT4_SWEEP_BUDGET_S caps the timing loop (default 80 s after compiling); INT4_SWEEP_ROWS the row
counts (default 1,256,64,1024, in that order: what the budget leaves out is the last).
"""

from __future__ import annotations

import os
import sys
import time

import torch

import triton_precompile  # scripts/: compiles a sweep's kernels in parallel processes

LLAMA_SHAPES = {"gate_up": (28672, 4096), "down": (4096, 14336), "qkv": (6144, 4096), "o": (4096, 4096)}
SMOKE_SHAPES = {"gate_up": (512, 256), "down": (128, 512), "qkv": (256, 256), "o": (128, 256)}
GROUP = 128
SMOKE_GROUP = 64


def gemv_bases(smoke: bool):
    """(panel, block_k, warps) of the GEMV to try; each with every (mode, prefetch) below. Warps
    lie along the panel where panel >= 128 * warps (an sm_90 compile: then the scales and zeros
    need no layout conversion, which costs two CTA barriers per K step); where panel = 256 *
    warps a thread holds two 16-byte vectors per row of 8 channels, halving the x work per word."""
    if smoke:
        return [(32, 64, 2), (64, 32, 4)]
    if os.environ.get("INT4_SWEEP_SPLITS") == "wide":  # the mid-session winners' bases, and a smaller tile
        return [(128, 64, 1), (128, 32, 1), (256, 32, 2), (512, 32, 4)]
    return [(64, 64, 1), (128, 64, 1), (256, 32, 1), (256, 32, 2), (512, 32, 2), (512, 32, 4)]


def gemv_kinds(smoke: bool):
    """(mode, prefetch, stages)."""
    if smoke:
        return [(3, 1, 1), (4, 2, 1), (0, 0, 2)]
    if os.environ.get("INT4_SWEEP_SPLITS") == "wide":
        return [(3, 1, 1), (4, 1, 1), (5, 1, 1)]
    return [(3, 1, 1), (3, 2, 1), (3, 0, 3), (4, 1, 1)]


def gemv_splits(panels: int, k: int, block_k: int, sms: int, warps: int = 4, panel_width: int = 128) -> list[int]:
    """Powers of two dividing the K tiles: the smallest giving at least one program per SM (two
    for one-warp programs) and the next one."""
    tiles = k // block_k
    want = sms * (2 if warps == 1 else 1)
    s = 1
    while panels * s < want and tiles % (2 * s) == 0:
        s *= 2
    # INT4_SWEEP_SPLITS=wide: also 4x and 8x that (more warps per SM scheduler: the mid-session run
    # had 2-4 per scheduler at the winners, too few to hide the arithmetic's latencies)
    cands = (s, 2 * s, 4 * s, 8 * s) if os.environ.get("INT4_SWEEP_SPLITS") == "wide" else (s, 2 * s)
    return [c for c in cands if tiles % c == 0 and c * panel_width <= 8192]  # the last program's sum


def stream_variants(n: int, k: int, smoke: bool) -> list:
    """INT4_SWEEP_SET=stream: the table's launch for this shape (or a small one under --smoke)
    with what changes its access pattern: STAGGER (slices rotated per panel), PDL, deeper
    prefetch or cp.async stages, twice / half the K slices."""
    from dataclasses import replace

    from tokenmill.layers.quantization import triton_int4_prefetch_gemv as pf

    base = pf.PrefetchGemv(32, 3, 32, 2, 1, 1) if smoke else pf.TABLE.get((n, k))
    if base is None:
        return []
    tiles = k // base.block_k
    base = replace(base, prefetch=1)
    vs = [base, replace(base, stagger=0), replace(base, stagger=1), replace(base, l1_ahead=0), replace(base, pdl=True),
          replace(base, stagger=1, pdl=True),
          replace(base, l1_ahead=3), replace(base, l1_ahead=3, stagger=1), replace(base, l1_ahead=5, stagger=1),
          replace(base, prefetch=0, stages=4, stagger=1), replace(base, prefetch=0, stages=6, stagger=1),
          replace(base, prefetch=-2, stagger=1), replace(base, mode=6), replace(base, mode=6, stagger=1),
          replace(base, mode=6, l1_ahead=0)]
    if tiles % (2 * base.split) == 0 and 2 * base.split * base.panel <= 8192:
        vs.append(replace(base, split=2 * base.split, stagger=1, l1_ahead=3))
    if base.split >= 2:
        vs.append(replace(base, split=base.split // 2, stagger=1, l1_ahead=3))
    return [v for v in dict.fromkeys(vs) if pf.fits(n, k, SMOKE_GROUP if smoke else GROUP, v)]


def gemv_variants(shapes: dict, smoke: bool, sms: int):
    """{shape name: [PrefetchGemv]}."""
    from tokenmill.layers.quantization.triton_int4_prefetch_gemv import PrefetchGemv

    if os.environ.get("INT4_SWEEP_SET") == "stream":
        return {name: stream_variants(n, k, smoke) for name, (n, k) in shapes.items()}
    out = {}
    for name, (n, k) in shapes.items():
        vs = []
        for panel, bk, warps in gemv_bases(smoke):
            if n % panel:
                continue
            for split in gemv_splits(n // panel, k, bk, sms, warps, panel):
                for mode, pf, st in gemv_kinds(smoke):
                    vs.append(PrefetchGemv(panel, mode, bk, split, warps, pf, st))
                if not smoke and (panel, warps) in ((128, 1), (256, 2)):  # float32 arithmetic, no inline PTX
                    vs.append(PrefetchGemv(panel, 0, bk, split, warps, 1, 1))
        out[name] = vs
    return out


def probe_variants(n: int, k: int, smoke: bool) -> list[tuple]:
    """(block_k, split, stages, stagger, warps) of the panel read probe (`int4_read_probe`) at the
    table's panel and grid for this shape: no pipelining, 3 and 5 cp.async stages, staggered."""
    from tokenmill.layers.quantization import triton_int4_prefetch_gemv as pf

    base = pf.PrefetchGemv(32, 3, 32, 2, 1, 1) if smoke else pf.TABLE.get((n, k))
    if base is None:
        return []
    b = (base.block_k, base.split)
    return [(*b, 1, 0, base.warps), (*b, 3, 0, base.warps), (*b, 3, 1, base.warps), (*b, 5, 1, base.warps)]


FLAT_PROBES = ((1056, 2048, 4, 4), (264, 4096, 4, 8))  # (programs, block, stages, warps): 8 and 2 per SM


def _compile_calls(device: str, smoke: bool):
    """One small call per compiled variant (the same specializations: sizes multiples of 16)."""
    from tokenmill.layers.quantization import int4_packing as packing
    from tokenmill.layers.quantization import stream_tiles
    from tokenmill.layers.quantization.triton_int4_prefetch_gemv import prefetch_gemv

    shapes = SMOKE_SHAPES if smoke else LLAMA_SHAPES
    group = SMOKE_GROUP if smoke else GROUP
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    sms = stream_tiles.sm_count(torch.device(device))
    n, k = (256, 512) if smoke else (512, 4096)
    w = torch.randn(n, k, device=device) * 0.02
    wt = packing.from_codes(packing.quantize_int4(w, group, sym=True), dt, act_order=False)
    counters = torch.zeros(4096, dtype=torch.int32, device=device)
    x1 = torch.randn(1, k, device=device, dtype=dt)
    seen, calls = set(), []
    panels = {}
    for vs in gemv_variants(shapes, smoke, sms).values():
        for c in vs:
            if c in seen or (k // c.block_k) % c.split:
                continue
            seen.add(c)
            if c.panel not in panels:
                panels[c.panel] = packing.to_panels(wt.qweight, c.panel)
            calls.append((f"gemv {c.label()}", lambda c=c: prefetch_gemv(
                x1, panels[c.panel], wt.scales, wt.zeros, group, c, counters)))
    import int4_read_probe as probe

    for name, (pn, pk) in shapes.items():
        for v in probe_variants(pn, pk, smoke):
            panel = pf_table_panel(pn, pk, smoke)
            qpp = torch.zeros((2, k // 8, panel), dtype=torch.int32, device=device)
            calls.append((f"probe {v}", lambda v=v, qpp=qpp: probe.panel_probe(qpp, *v)))
    x1c = torch.randn(1, k, device=device, dtype=dt)
    calls += [("copy", lambda: probe.copy_ahead(x1c, False)), ("copy trigger", lambda: probe.copy_ahead(x1c, True))]
    for v in FLAT_PROBES:
        calls.append((f"flat probe {v}", lambda v=v: probe.flat_probe(wt.qweight, v[0], v[1] if not smoke else 64,
                                                                       v[2], v[3])))
    return calls


def pf_table_panel(n: int, k: int, smoke: bool) -> int:
    from tokenmill.layers.quantization import triton_int4_prefetch_gemv as pf

    return 32 if smoke else pf.TABLE[(n, k)].panel


def precompile_shard(shard: str) -> None:
    triton_precompile.compile_shard(_compile_calls("cuda", False), shard)


def _precompile(shards: int, timeout: float) -> None:
    triton_precompile.compile_in_processes(__file__, "--precompile", shards, timeout, "int4sweep")


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def _copy_bandwidth(device: str, time_ms) -> float:
    """Bytes per second of a device-to-device copy of 1 GiB (read + write): the floor's yardstick."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    ms = time_ms(lambda: b.copy_(a), device, reps=5)
    return 2 * a.numel() / (ms / 1000)


def _probes_and_chain(name, n, k, wt, x, group, counters, smoke, note, r, check, cycled, deadline) -> None:
    """One row, after the GEMV variants: the read probes (the access pattern's own ceiling) and the
    engine's launch for this shape in a chain behind an elementwise kernel (as in a forward, where
    a norm or an activation writes x), with and without PDL."""
    from dataclasses import replace

    import int4_read_probe as probe
    from tokenmill.layers.quantization import int4_packing as packing
    from tokenmill.layers.quantization import triton_int4_prefetch_gemv as pf

    panel = pf_table_panel(n, k, smoke)
    qp = packing.to_panels(wt.qweight, panel)
    cyc = cycled([qp])
    for v in probe_variants(n, k, smoke):
        if time.perf_counter() > deadline:
            return
        label = "probe k{} s{} st{} rot{} w{}".format(*v)
        try:
            ok = torch.equal(probe.panel_probe(qp, *v), probe.panel_probe_reference(qp, v[1]))
            check(ok, f"int4 read probe {name} {label}")
            if ok:
                note(label, lambda v=v: probe.panel_probe(cyc()[0], *v))
        except Exception as e:  # noqa: BLE001
            check(False, f"int4 read probe {name} {label}: {type(e).__name__}: {str(e)[:300]}")
    for v in FLAT_PROBES:
        v = (v[0], v[1] if not smoke else 64, v[2], v[3])
        label = "flat probe p{} b{} st{} w{}".format(*v)
        try:
            ok = torch.equal(probe.flat_probe(qp, *v), probe.flat_probe_reference(qp, v[0], v[1]))
            check(ok, f"int4 read probe {name} {label}")
            if ok:
                note(label, lambda v=v: probe.flat_probe(cyc()[0], *v))
        except Exception as e:  # noqa: BLE001
            check(False, f"int4 read probe {name} {label}: {type(e).__name__}: {str(e)[:300]}")
    base = pf.PrefetchGemv(32, 3, 32, 2, 1, 1) if smoke else pf.TABLE.get((n, k))
    if base is None:
        return
    wcyc = cycled([qp, wt.scales, wt.zeros])
    for c in (base, replace(base, pdl=True)):
        if time.perf_counter() > deadline:
            return
        # x + 0.0: an elementwise kernel that writes the GEMV's input, as the norm / activation does
        note(f"chain {c.label()}", lambda c=c: pf.prefetch_gemv(x + 0.0, *wcyc(), group, c, counters))
    note("chain elementwise alone", lambda: x + 0.0)
    if x.is_cuda:  # PDL is only safe if the wait sits before every read of x: replayed back to back, checked
        c = replace(base, pdl=True)
        ref_w = packing.dequantize(wt, group, torch.float32)
        xs = [torch.randn_like(x) for _ in range(4)]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = [pf.prefetch_gemv(probe.copy_ahead(xi, True), qp, wt.scales, wt.zeros, group, c, counters)
                    for xi in xs]
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        errs = [_rel(o, xi.float() @ ref_w) for o, xi in zip(outs, xs)]
        check(max(errs) < 1e-2 and not counters.any(), f"int4 GEMV {name} with PDL in a graph, behind a "
                                                       f"triggering kernel: rel errs {max(errs):.1e}")
        del graph, outs
    # a Triton copy ahead instead, without and with the early trigger a norm could add
    for c, trig in ((base, False), (replace(base, pdl=True), False), (replace(base, pdl=True), True)):
        if time.perf_counter() > deadline:
            return
        note(f"chain copy{' trigger' if trig else ''} {c.label()}",
             lambda c=c, trig=trig: pf.prefetch_gemv(probe.copy_ahead(x, trig), *wcyc(), group, c, counters))


def sweep(results: dict, device: str, time_ms, cycled, check) -> None:
    """time_ms(fn, device[, reps]), cycled(tensors) and check(ok, what) come from gpu_quant.py."""
    if os.environ.get("INT4_SWEEP_SET") == "mma":
        return mma_sweep(results, device, time_ms, cycled, check)
    from tokenmill.layers.quantization import int4_packing as packing
    from tokenmill.layers.quantization import stream_tiles, triton_int4
    from tokenmill.layers.quantization.int4 import for_device
    from tokenmill.layers.quantization.triton_int4_prefetch_gemv import prefetch_gemv

    cuda = device == "cuda"
    smoke = not cuda
    shapes = SMOKE_SHAPES if smoke else LLAMA_SHAPES
    group = SMOKE_GROUP if smoke else GROUP
    dt = torch.bfloat16 if cuda else torch.float32
    sms = stream_tiles.sm_count(torch.device(device))
    if cuda:
        _precompile(min(15, max(1, (os.cpu_count() or 2) - 1)), timeout=float(os.environ.get("INT4_SWEEP_COMPILE_S", "45")))
    budget = float(os.environ.get("INT4_SWEEP_BUDGET_S", "80"))
    deadline = time.perf_counter() + budget
    one_row_deadline = time.perf_counter() + 0.6 * budget  # the rest is for the many-row sections
    rec = results.setdefault("int4sweep", {})
    copy_bps = _copy_bandwidth(device, time_ms) if cuda else None
    if copy_bps:
        rec["copy_GBps"] = copy_bps / 1e9
        print(f"  copy bandwidth {copy_bps / 1e12:.2f} TB/s (read + write)", flush=True)
    variants = gemv_variants(shapes, smoke, sms)
    if os.environ.get("INT4_SWEEP_SET") == "stream":
        from tokenmill.layers.quantization.triton_panels import pdl_supported
        rec["pdl_supported"] = pdl_supported(torch.device(device))
        print(f"  PDL launches supported here: {rec['pdl_supported']} (else the 'pdl' variants launch plainly)",
              flush=True)
    best: dict = {}  # (section, name) -> (ms, label, variant)
    rows_list = tuple(int(r) for r in os.environ.get("INT4_SWEEP_ROWS", "1,256,64,1024" if cuda else "1,16").split(","))
    # rows outside, linears inside: one row for all four linears first (what the budget must cover)
    for name, (n, k), rows in [(nm, shp, (m,)) for m in rows_list for nm, shp in shapes.items()]:
        g = torch.Generator(device=device).manual_seed(0)
        w = torch.randn(n, k, device=device, generator=g).to(dt) * 0.02
        wt = packing.from_codes(packing.quantize_int4(w, group, sym=False), dt, act_order=False)
        ref_w = packing.dequantize(wt, group, torch.float32)  # [K, N]
        counters = stream_tiles.SplitCounters(n, torch.device(device)).tensor
        bf16_w = cycled([w])
        int4_w = cycled([wt.qweight, wt.scales, wt.zeros])
        wd = for_device(wt, group)  # the engine's layout now
        engine_w = cycled([wd.qweight, wd.scales, wd.zeros])
        floor_ms = (n * k / 2) / copy_bps * 1000 if copy_bps else None  # the int4 bytes at copy's bytes per second
        for m in rows:
            x = torch.randn(m, k, device=device, dtype=dt)
            ref = x.float() @ ref_w
            sec = f"m{m}"
            r = rec.setdefault(f"{sec}/{name}", {})

            def note(label, fn, variant=None, r=r, sec=sec):
                if time.perf_counter() > deadline:
                    return
                ms = time_ms(fn, device)
                r[label] = ms
                if variant is not None and ms < best.get((sec, name), (float("inf"),))[0]:
                    best[(sec, name)] = (ms, label, variant)
            note("bf16", lambda: x @ bf16_w()[0].t())
            err = _rel(triton_int4.int4_matmul(x, wd.qweight, wd.scales, wd.zeros, None, group, counters), ref)
            check(err < 1e-2 and not counters.any(), f"int4 engine path {name} m={m}: rel err {err:.1e}")
            note("engine", lambda: triton_int4.int4_matmul(x, *engine_w(), None, group, counters))
            if m == 1:
                panels = {}
                for c in variants[name]:
                    if time.perf_counter() > one_row_deadline:
                        print(f"  int4sweep: one-row budget spent in {name}", flush=True)
                        break
                    if c.panel not in panels:
                        qp = packing.to_panels(wt.qweight, c.panel)
                        panels[c.panel] = (qp, cycled([qp, wt.scales, wt.zeros]))
                    qp, cyc = panels[c.panel]
                    try:
                        out = prefetch_gemv(x, qp, wt.scales, wt.zeros, group, c, counters)
                        err = _rel(out, ref)
                        if err > (1e-2 if c.mode >= 4 else 5e-3) or counters.any():  # bf16 output: ~1e-3
                            check(False, f"int4 GEMV {name} {c.label()}: rel err {err:.1e}, "
                                         f"counters zeroed {not counters.any()}")
                            continue
                        note(c.label(), lambda c=c, cyc=cyc: prefetch_gemv(x, *cyc(), group, c, counters), c)
                    except Exception as e:  # noqa: BLE001 - a variant that fails is reported, not fatal
                        check(False, f"int4 GEMV {name} {c.label()}: {type(e).__name__}: {str(e)[:300]}")
                del panels
                _probes_and_chain(name, n, k, wt, x, group, counters, smoke, note, r, check, cycled,
                                  one_row_deadline)
            elif m >= 64:
                note("dequant + mm", lambda: x @ triton_int4.dequantize_int4(*int4_w(), None, group, dt))
            ranked = sorted(((v, lab) for lab, v in r.items()), key=lambda t: t[0])
            frac = (lambda ms: f" ({floor_ms / ms:.0%} of copy bw)") if floor_ms and m == 1 else (lambda ms: "")
            print(f"  {sec} {name} {n}x{k}: bf16 {r.get('bf16', 0) * 1000:.1f} us, engine {r.get('engine', 0) * 1000:.1f}"
                  f"{frac(r['engine']) if 'engine' in r else ''}; best: " +
                  "; ".join(f"{lab} {v * 1000:.1f}{frac(v)}" for v, lab in ranked[:5]), flush=True)
            if os.environ.get("INT4_SWEEP_SET") == "stream":  # every figure: the probes and chains steer the design
                print(f"  ALL {sec} {name}: " + "; ".join(f"{lab} {v * 1000:.1f}" for lab, v in r.items()), flush=True)
        del w, wt, wd, ref_w, bf16_w, int4_w, engine_w
        if cuda:
            torch.cuda.empty_cache()
    summary: dict = {}
    for m in rows_list:
        sec = f"m{m}"
        per = {nm: rec.get(f"{sec}/{nm}", {}) for nm in shapes}
        if not all(per.values()):
            continue
        tot = {key: sum(per[nm].get(key, float("nan")) for nm in shapes) * 1000 for key in ("bf16", "engine")}
        tot["best_each"] = sum(best[(sec, nm)][0] for nm in shapes if (sec, nm) in best) * 1000
        summary[sec] = tot
        print(f"  INT4SWEEP {sec}: the layer's four linears: bf16 {tot['bf16']:.0f} us, engine {tot['engine']:.0f}, "
              f"best each {tot['best_each']:.0f} ({tot['best_each'] / tot['bf16']:.2f}x bf16)", flush=True)
    for (sec, nm), (ms, label, v) in sorted(best.items()):
        n, k = shapes[nm]
        if sec == "m1":
            print(f"  TABLE ({n}, {k}): {v!r},  # {ms * 1000:.1f} us", flush=True)
        else:
            print(f"  BEST {sec} {nm}: {label} {ms * 1000:.1f} us", flush=True)
    results["int4sweep_summary_us"] = summary



# ---------------------------------------------------------------- INT4_SWEEP_SET=mma

def mma_variants(n: int, k: int, group: int, smoke: bool) -> list:
    """The tensor-core GEMV's launches for one row of this shape: WARPS 4 / 8, SPLIT half / the
    default's / twice, GPC 1 / 2, zero points by subtraction / by a second mma; and the default
    with its loads left where ptxas puts them (early off), with the L1 / L2 load hints, with 4
    groups a step, with 2 warps a CTA."""
    from dataclasses import replace

    from tokenmill.layers.quantization import triton_int4_mma as mma

    d = mma.default_config(n, k, group)
    if smoke:  # the interpreter is slow: the default and its other arithmetic
        return [v for v in (d, replace(d, zmma=True)) if mma.fits(n, k, group, v)]
    vs = [replace(d, early=False), replace(d, hint=True), replace(d, hint=True, zmma=True),
          replace(d, gpc=4), replace(d, warps=2), replace(d, warps=2, split=2 * d.split)]
    for warps in (4, 8):
        for split in dict.fromkeys((max(1, d.split // 2), d.split, 2 * d.split)):
            for gpc in (1, 2):
                for zmma in (False, True):
                    vs.append(mma.MmaGemv(warps, split, gpc, True, zmma))
    return [v for v in dict.fromkeys(vs) if mma.fits(n, k, group, v)]


def _mma_calls(device: str, smoke: bool):
    """One small call per compiled mma variant (one row and eight) and the dequantization."""
    from tokenmill.layers.quantization import int4_packing as packing
    from tokenmill.layers.quantization import triton_int4_mma as mma

    shapes = SMOKE_SHAPES if smoke else LLAMA_SHAPES
    group = SMOKE_GROUP if smoke else GROUP
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    calls, seen = [], set()
    n, k = 1024, 4096
    wt = packing.from_codes(packing.quantize_int4(torch.randn(n, k, device=device), group, sym=False), dt,
                            act_order=False)
    qm = packing.to_mma(wt.qweight)
    counters = torch.zeros(4096, dtype=torch.int32, device=device)
    for m in (1, 8):
        x = torch.randn(m, k, device=device, dtype=dt)
        for sn, sk in shapes.values():  # eight rows: the default launch (and zmma) only, as the sweep times
            d = mma.config_for(sn, sk, group)
            for c in (mma_variants(sn, sk, group, smoke) if m == 1 else (d, replace_zmma(d))):
                key = (c, m)
                if key in seen or not mma.fits(n, k, group, c):
                    continue
                seen.add(key)
                calls.append((f"mma {c.label()} m{m}", lambda c=c, x=x: mma.mma_gemv(x, qm, wt.scales, wt.zeros, group,
                                                                                     c, counters)))
    calls.append(("mma dequant", lambda: mma.mma_dequantize(qm, wt.scales, wt.zeros, group, dt)))
    return calls


def mma_precompile_shard(shard: str) -> None:
    triton_precompile.compile_shard(_mma_calls("cuda", False), shard)


def mma_sweep(results: dict, device: str, time_ms, cycled, check) -> None:
    """INT4_SWEEP_SET=mma: per Llama-8B linear, bf16 cuBLAS, the engine's one-row GEMV of today
    (the prefetching GEMV's table launch on its panels) and the tensor-core GEMV's variants, each
    checked against a float32 reference; then 8 rows, 16 rows (two launches) and 256 rows
    (dequantize the mma layout + cuBLAS against the panel layout's dequantize + cuBLAS)."""
    from tokenmill.layers.quantization import int4_packing as packing
    from tokenmill.layers.quantization import stream_tiles, triton_int4
    from tokenmill.layers.quantization import triton_int4_mma as mma
    from tokenmill.layers.quantization import triton_int4_prefetch_gemv as pf

    cuda = device == "cuda"
    smoke = not cuda
    shapes = SMOKE_SHAPES if smoke else LLAMA_SHAPES
    group = SMOKE_GROUP if smoke else GROUP
    dt = torch.bfloat16 if cuda else torch.float32
    if cuda:
        triton_precompile.compile_in_processes(__file__, "--mma-precompile", min(15, max(1, (os.cpu_count() or 2) - 1)),
                                               float(os.environ.get("INT4_SWEEP_COMPILE_S", "40")), "int4sweep mma")
    deadline = time.perf_counter() + float(os.environ.get("INT4_SWEEP_BUDGET_S", "60"))
    rec = results.setdefault("int4sweep_mma", {})
    copy_bps = _copy_bandwidth(device, time_ms) if cuda else None
    if copy_bps:
        rec["copy_GBps"] = copy_bps / 1e9
        print(f"  copy bandwidth {copy_bps / 1e12:.2f} TB/s (read + write)", flush=True)
    best: dict = {}
    for name, (n, k) in shapes.items():
        g = torch.Generator(device=device).manual_seed(0)
        w = torch.randn(n, k, device=device, generator=g).to(dt) * 0.02
        wt = packing.from_codes(packing.quantize_int4(w, group, sym=False), dt, act_order=False)
        ref_w = packing.dequantize(wt, group, torch.float32)
        counters = stream_tiles.SplitCounters(n, torch.device(device)).tensor
        qm = packing.to_mma(wt.qweight)
        bf16_w = cycled([w])
        mma_w = cycled([qm, wt.scales, wt.zeros])
        x = torch.randn(1, k, device=device, dtype=dt)
        ref = x.float() @ ref_w
        r = rec.setdefault(f"m1/{name}", {})

        def note(label, fn, r=r, variant=None, name=name):
            if time.perf_counter() > deadline:
                return
            ms = time_ms(fn, device)
            r[label] = ms
            if variant is not None and ms < best.get(name, (float("inf"),))[0]:
                best[name] = (ms, label, variant)
        note("bf16", lambda: x @ bf16_w()[0].t())
        pc = pf.config_for(n, k, group) if not smoke else None
        if pc is not None:  # today's engine path for one row
            qp = packing.to_panels(wt.qweight, pc.panel)
            err = _rel(pf.prefetch_gemv(x, qp, wt.scales, wt.zeros, group, pc, counters), ref)
            check(err < 1e-2 and not counters.any(), f"int4 prefetch GEMV {name}: rel err {err:.1e}")
            pf_w = cycled([qp, wt.scales, wt.zeros])
            note("prefetch (engine today)", lambda: pf.prefetch_gemv(x, *pf_w(), group, pc, counters))
            del qp, pf_w
        for c in mma_variants(n, k, group, smoke):
            try:
                out = mma.mma_gemv(x, qm, wt.scales, wt.zeros, group, c, counters)
                err = _rel(out, ref)
                if err > 1e-2 or counters.any():
                    check(False, f"int4 mma GEMV {name} {c.label()}: rel err {err:.1e}, counters zeroed "
                                 f"{not counters.any()}")
                    continue
                note(c.label(), lambda c=c: mma.mma_gemv(x, *mma_w(), group, c, counters), variant=c)
            except Exception as e:  # noqa: BLE001 - a variant that fails is reported, not fatal
                check(False, f"int4 mma GEMV {name} {c.label()}: {type(e).__name__}: {str(e)[:400]}")
        if name in best:
            check(True, f"int4 mma GEMV {name}: every variant within 1e-2 of the reference")
        floor = (lambda ms: f" ({(n * k / 2) / copy_bps * 1000 / ms:.0%} of copy bw)") if copy_bps else (lambda ms: "")
        ranked = sorted((v, lab) for lab, v in r.items())
        print(f"  m1 {name} {n}x{k}: " + "; ".join(f"{lab} {v * 1000:.1f}{floor(v)}" for v, lab in ranked), flush=True)
        # more rows: 8 (one launch), 16 (two), 256 (dequantize + cuBLAS, mma layout against panels)
        c = mma.config_for(n, k, group)
        for m in (8, 16, 256):
            if time.perf_counter() > deadline:
                break
            xm = torch.randn(m, k, device=device, dtype=dt)
            refm = xm.float() @ ref_w
            rm = rec.setdefault(f"m{m}/{name}", {})
            err = _rel(mma.mma_matmul(xm, qm, wt.scales, wt.zeros, group, counters), refm)
            check(err < 1e-2 and not counters.any(), f"int4 mma_matmul {name} m={m}: rel err {err:.1e}")
            note("bf16", lambda: xm @ bf16_w()[0].t(), r=rm)
            note("mma_matmul", lambda: mma.mma_matmul(xm, *mma_w(), group, counters), r=rm)
            if m <= 8:
                note("mma zmma", lambda: mma.mma_gemv(xm, *mma_w(), group, replace_zmma(c), counters), r=rm)
            words_w = cycled([wt.qweight, wt.scales, wt.zeros])
            if m == 256:
                note("dequant(words) + mm", lambda: xm @ triton_int4.dequantize_int4(*words_w(), None, group, dt), r=rm)
            else:
                note("engine today", lambda: triton_int4.int4_matmul(xm, *words_w(), None, group, counters), r=rm)
            print(f"  m{m} {name}: " + "; ".join(f"{lab} {v * 1000:.1f}" for lab, v in rm.items()), flush=True)
        if cuda and name == "qkv":  # in a CUDA graph, replayed: split-K counters reset every time
            xs = [torch.randn(1, k, device=device, dtype=dt) for _ in range(3)]
            mma.mma_gemv(xs[0], qm, wt.scales, wt.zeros, group, c, counters)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outs = [mma.mma_gemv(xi, qm, wt.scales, wt.zeros, group, c, counters) for xi in xs]
            for _ in range(3):
                graph.replay()
            torch.cuda.synchronize()
            errs = [_rel(o, xi.float() @ ref_w) for o, xi in zip(outs, xs)]
            check(max(errs) < 1e-2 and not counters.any(), f"int4 mma GEMV {c.label()} replayed in a CUDA graph: "
                                                           f"rel err {max(errs):.1e}")
            del graph, outs
        del w, wt, ref_w, qm, bf16_w, mma_w
        if cuda:
            torch.cuda.empty_cache()
    tot = {key: sum(rec.get(f"m1/{nm}", {}).get(key, float("nan")) for nm in shapes) * 1000
           for key in ("bf16", "prefetch (engine today)")}
    tot["mma best each"] = sum(best[nm][0] for nm in shapes if nm in best) * 1000
    results["int4sweep_mma_summary_us"] = tot
    print(f"  INT4SWEEP mma m1: the layer's four linears: " + ", ".join(f"{k_} {v:.1f} us" for k_, v in tot.items()),
          flush=True)
    for nm, (ms, label, v) in sorted(best.items()):
        print(f"  MMA TABLE {shapes[nm]}: {v!r},  # {ms * 1000:.1f} us", flush=True)


def replace_zmma(c):
    from dataclasses import replace

    return replace(c, zmma=not c.zmma)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] in ("--precompile", "--mma-precompile"):
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        os.environ["TRITON_INTERPRET"] = "0"
        (precompile_shard if sys.argv[1] == "--precompile" else mma_precompile_shard)(sys.argv[2])
