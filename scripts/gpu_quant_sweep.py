"""The `sweep` part of scripts/gpu_quant.py: kernel variants and tile configurations per Llama-8B
linear at the row counts where the quantized paths lose, each checked against its reference and
timed from CUDA-graph replays with weights cycled past L2 (HBM-bound, as in a forward). One run
prints which variant wins where; the winners go into `stream_tiles` (GEMV_TABLE and friends).

- int4 one row: the panel GEMV (`triton_int4_gemv`: panel width, arithmetic MODE, BLOCK_K,
  warps, pipeline stages, split-K) against bf16 cuBLAS and the engine's current int4 path;
- fp8 one row: the streaming kernel with and without a software-pipelined K loop;
- fp8 at 256 / 1024 rows: where the time of W8A8 goes (activation quantization alone,
  row-wise `_scaled_mm` alone and with it, tensor-wise `_scaled_mm` + a scaling pass, the Triton
  fp8 GEMM with the scales in its epilogue, per tile);
- int4 at 256 / 1024 rows: dequantize + cuBLAS and the streaming kernel's tensor-core tiles (the
  swapped Triton GEMM timed here before, `triton_int4_swap`, lost everywhere: retired in session 11).
Compiling is most of the time: every variant compiles first in parallel processes (`--precompile`).
"""

from __future__ import annotations

import os
import re
import sys
import time

import torch

import triton_precompile  # scripts/: compiles a sweep's kernels in parallel processes

LLAMA_SHAPES = {"gate_up": (28672, 4096), "down": (4096, 14336), "qkv": (6144, 4096), "o": (4096, 4096)}
SMOKE_SHAPES = {"gate_up": (512, 128), "down": (128, 256), "qkv": (256, 128), "o": (128, 128)}


def gemv_variants(smoke: bool):
    """(panel, mode, block_k, warps, stages) of the int4 GEMV to try."""
    if smoke:
        return [(64, 0, 32, 2, 2), (64, 2, 32, 2, 2)]
    out = []
    for panel in (128, 256, 512):
        out += [(panel, 0, 64, 4, 3), (panel, 0, 32, 2, 4), (panel, 2, 64, 4, 3), (panel, 2, 32, 2, 4),
                (panel, 2, 32, 4, 4), (panel, 2, 128, 4, 3)]
    return out + [(128, 1, 64, 4, 3), (256, 2, 64, 8, 2), (512, 2, 32, 4, 2)]


def fp8_gemv_variants(smoke: bool):
    from tokenmill.layers.quantization.stream_tiles import Tiles as T
    if smoke:
        return [T(1, 16, 64, warps=2), T(1, 16, 64, warps=2, pipe=True)]
    return [T(1, 16, 256, warps=2), T(1, 16, 256, warps=2, pipe=True), T(1, 16, 256, warps=2, stages=4, pipe=True),
            T(1, 32, 256, pipe=True), T(1, 16, 512, pipe=True), T(1, 32, 512, warps=8, pipe=True),
            T(1, 64, 128, pipe=True), T(1, 16, 128, warps=1, stages=4, pipe=True)]


def fp8_gemm_variants(smoke: bool):
    """(block_m, block_n, block_k, group_m, warps, stages) of the Triton fp8 GEMM."""
    if smoke:
        return [(16, 32, 64, 2, 4, 2)]
    return [(128, 128, 128, 8, 8, 4), (128, 256, 128, 8, 8, 3), (64, 128, 128, 8, 4, 4), (128, 128, 64, 8, 4, 5),
            (64, 256, 128, 8, 8, 4), (256, 128, 128, 8, 8, 3)]


def int4_tc_variants(smoke: bool):
    from tokenmill.layers.quantization.stream_tiles import Tiles as T
    if smoke:
        return [T(64, 32, 64)]
    return [T(64, 128, 64, stages=4, nibble_dots=False), T(128, 128, 64, warps=8, nibble_dots=False),
            T(128, 128, 128, warps=8), T(64, 256, 64, warps=8, stages=3, nibble_dots=False),
            T(128, 256, 64, warps=8, stages=3, nibble_dots=False), T(256, 64, 64, warps=8, nibble_dots=False),
            T(256, 64, 128, warps=8), T(256, 128, 64, warps=8, stages=2, nibble_dots=False)]


def _splits(tiles: int, k: int, block_k: int, sms: int) -> list[int]:
    """Split-K candidates: up to three around 1, 2 and 4 programs per SM, each slice >= 2 K steps."""
    out = []
    for want in (sms, 2 * sms, 4 * sms):
        s = 1
        while tiles * s < want and k // (2 * s * block_k) >= 2:
            s *= 2
        if s not in out:
            out.append(s)
    return out


def _compile_calls(device: str, smoke: bool):
    """One small call per compiled variant (specializations as in the sweep: sizes multiples of 16)."""
    from tokenmill.layers.quantization import fp8_ops
    from tokenmill.layers.quantization import int4_packing as packing
    from tokenmill.layers.quantization.triton_fp8_gemm import fp8_gemm
    from tokenmill.layers.quantization.triton_fp8_stream import fp8_stream_gemm
    from tokenmill.layers.quantization.triton_int4_gemv import int4_gemv
    from tokenmill.layers.quantization.triton_int4_stream import int4_stream_gemm

    n, k = 1024, 2048
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    w = torch.randn(n, k, device=device) * 0.02
    wt = packing.from_codes(packing.quantize_int4(w, 128, sym=True), dt, act_order=False)
    wq, ws = fp8_ops.quantize_rows(w)
    counters = torch.zeros(4096, dtype=torch.int32, device=device)
    x1 = torch.randn(1, k, device=device, dtype=dt)
    calls = []
    for panel, mode, bk, warps, stages in gemv_variants(smoke):
        qp = packing.to_panels(wt.qweight, panel)
        for split in (1, 2):
            calls.append((f"gemv p{panel} m{mode} k{bk} w{warps} st{stages} s{split}", lambda qp=qp, a=(
                mode, bk, warps, stages, split): int4_gemv(x1, qp, wt.scales, wt.zeros, 128, block_k=a[1], split=a[4],
                                                          warps=a[2], stages=a[3], mode=a[0], counters=counters)))
    for t in fp8_gemv_variants(smoke):
        from dataclasses import replace
        for split in (1, 2):
            tt = replace(t, split=split)
            calls.append((f"fp8 {tt.label()}", lambda tt=tt: fp8_stream_gemm(x1, wq, ws, None, counters, tiles=tt)))
    x300 = torch.randn(300, k, device=device, dtype=dt)
    for t in int4_tc_variants(smoke):
        calls.append((f"int4 tiles {t.label()}", lambda t=t: int4_stream_gemm(
            x300, wt.qweight, wt.scales, wt.zeros, 128, counters, tiles=t)))
    if device == "cuda":
        xq, xs = fp8_ops.quantize_rows(torch.randn(300, k, device=device))
        for v in fp8_gemm_variants(smoke):
            calls.append((f"fp8 gemm {v}", lambda v=v: fp8_gemm(xq, xs, wq, ws, dt, *v)))
    return calls


def precompile_shard(shard: str) -> None:
    triton_precompile.compile_shard(_compile_calls("cuda", False), shard)


def _precompile(shards: int, timeout: float) -> None:
    triton_precompile.compile_in_processes(__file__, "--precompile", shards, timeout, "sweep")


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def sweep(results: dict, device: str, time_ms, cycled, check) -> None:
    """time_ms(fn, device), cycled(tensors) and check(ok, what) come from gpu_quant.py."""
    from dataclasses import replace

    from tokenmill.layers.quantization import fp8_ops, stream_tiles
    from tokenmill.layers.quantization import int4_packing as packing
    from tokenmill.layers.quantization import triton_int4
    from tokenmill.layers.quantization.int4 import for_device
    from tokenmill.layers.quantization.triton_fp8 import quantize_row_groups
    from tokenmill.layers.quantization.triton_fp8_gemm import fp8_gemm
    from tokenmill.layers.quantization.triton_fp8_stream import fp8_stream_gemm
    from tokenmill.layers.quantization.triton_int4_gemv import int4_gemv
    from tokenmill.layers.quantization.triton_int4_stream import int4_stream_gemm

    cuda = device == "cuda"
    smoke = not cuda
    shapes = SMOKE_SHAPES if smoke else LLAMA_SHAPES
    dt = torch.bfloat16 if cuda else torch.float32
    sms = stream_tiles.sm_count(torch.device(device))
    deadline = time.perf_counter() + float(os.environ.get("SWEEP_BUDGET_S", "120"))
    if cuda:
        _precompile(16, timeout=45.0)
    rec = results.setdefault("sweep", {})
    totals: dict = {}  # (section, variant) -> [us per linear]

    def note(section: str, name: str, variant: str, ms: float) -> None:
        """Every record kept; the layer totals take each variant at its best split (label sans s<N>)."""
        rec.setdefault(f"{section}/{name}", {})[variant] = ms
        group = re.sub(r"(^|[ a-z0-9])s\d+(?=w| |$)", r"\1", variant).strip()
        per = totals.setdefault(section, {}).setdefault(group, {})
        per[name] = min(ms, per.get(name, ms))

    for name, (n, k) in shapes.items():
        if time.perf_counter() > deadline:
            print(f"  sweep: budget spent, {name} skipped", flush=True)
            break
        g = torch.Generator(device=device).manual_seed(0)
        w = torch.randn(n, k, device=device, generator=g).to(dt) * 0.02
        codes = packing.quantize_int4(w, 128, sym=True)
        wt = packing.from_codes(codes, dt, act_order=False)
        ref_w = packing.dequantize(wt, 128, torch.float32)  # [K, N]
        counters = stream_tiles.SplitCounters(n, torch.device(device)).tensor
        bf16_w = cycled([w])
        int4_w = cycled([wt.qweight, wt.scales, wt.zeros])
        x1 = torch.randn(1, k, device=device, dtype=dt)
        ref1 = x1.float() @ ref_w
        note("int4_m1", name, "bf16", time_ms(lambda: x1 @ bf16_w()[0].t(), device))
        wd = for_device(wt, 128)  # the engine's layout: panels on CUDA
        engine_w = cycled([wd.qweight, wd.scales, wd.zeros])
        err = _rel(triton_int4.int4_matmul(x1, wd.qweight, wd.scales, wd.zeros, None, 128, counters), ref1)
        check(err < 1e-2 and not counters.any(), f"int4 engine path {name} m=1: rel err {err:.1e}")
        note("int4_m1", name, "old stream (words, MEASURED tiles)", time_ms(
            lambda: int4_stream_gemm(x1, *int4_w(), 128, counters), device))
        note("int4_m1", name, "engine", time_ms(lambda: triton_int4.int4_matmul(x1, *engine_w(), None, 128, counters),
                                                device))
        panels = {}
        for panel, mode, bk, warps, stages in gemv_variants(smoke):
            if n % panel or time.perf_counter() > deadline:
                continue
            if panel not in panels:
                qp = packing.to_panels(wt.qweight, panel)
                panels[panel] = (qp, cycled([qp, wt.scales, wt.zeros]))
            qp, cyc = panels[panel]
            for split in _splits(n // panel, k, bk, sms):
                label = f"p{panel} m{mode} k{bk} w{warps} st{stages} s{split}"
                try:
                    out = int4_gemv(x1, qp, wt.scales, wt.zeros, 128, bk, split, warps, stages, mode, counters)
                    err = _rel(out, ref1)
                    if err > 1e-2 or counters.any():
                        check(False, f"int4 GEMV {name} {label}: rel err {err:.1e}, counters zeroed "
                                     f"{not counters.any()}")
                        continue
                    note("int4_m1", name, label, time_ms(lambda: int4_gemv(
                        x1, *cyc(), 128, bk, split, warps, stages, mode, counters), device))
                except Exception as e:  # noqa: BLE001 - a variant that does not compile is reported, not fatal
                    check(False, f"int4 GEMV {name} {label}: {type(e).__name__}: {str(e)[:200]}")
        del panels
        # fp8, one row
        wq, ws = fp8_ops.quantize_rows(w)
        if not cuda:
            wq = wq.float()
        fp8_w = cycled([wq, ws, ws.reshape(1, -1).contiguous()])
        ref8 = (x1.double() @ (wq.double() * ws.double()).t()).float()
        note("fp8_m1", name, "bf16", rec[f"int4_m1/{name}"]["bf16"])
        note("fp8_m1", name, "engine", time_ms(lambda: fp8_stream_gemm(x1, *fp8_w()[:2], None, counters), device))
        for t in fp8_gemv_variants(smoke):
            for split in sorted({1, 2, 4, 8} if not smoke else {1, 2}):
                tt = replace(t, split=split)
                try:
                    err = _rel(fp8_stream_gemm(x1, wq, ws, None, counters, tiles=tt), ref8)
                    if err > 1e-2:
                        check(False, f"fp8 stream {name} {tt.label()}: rel err {err:.1e}")
                        continue
                    note("fp8_m1", name, tt.label(), time_ms(
                        lambda: fp8_stream_gemm(x1, *fp8_w()[:2], None, counters, tiles=tt), device))
                except Exception as e:  # noqa: BLE001
                    check(False, f"fp8 stream {name} {tt.label()}: {type(e).__name__}: {str(e)[:200]}")
        # many rows: fp8 W8A8 and int4
        for m in ((256, 1024) if cuda else (64,)):
            if time.perf_counter() > deadline:
                break
            x = torch.randn(m, k, device=device, dtype=dt)
            sec = f"m{m}"
            note(f"fp8_{sec}", name, "bf16", time_ms(lambda: x @ bf16_w()[0].t(), device))
            note(f"int4_{sec}", name, "bf16", rec[f"fp8_{sec}/{name}"]["bf16"])
            if cuda:
                xq, xs = quantize_row_groups(x, k)
                ones = torch.ones((), device=device)
                note(f"fp8_{sec}", name, "quant only", time_ms(lambda: quantize_row_groups(x, k), device))
                note(f"fp8_{sec}", name, "rowwise scaled_mm only", time_ms(lambda: (lambda q, s, srow: torch._scaled_mm(
                    xq, q.t(), scale_a=xs, scale_b=srow, out_dtype=dt))(*fp8_w()), device))

                def rowwise():
                    q, s, srow = fp8_w()
                    a, sa = quantize_row_groups(x, k)
                    return torch._scaled_mm(a, q.t(), scale_a=sa, scale_b=srow, out_dtype=dt)

                def tensorwise():
                    q, s, srow = fp8_w()
                    a, sa = quantize_row_groups(x, k)
                    out = torch._scaled_mm(a, q.t(), scale_a=ones, scale_b=ones, out_dtype=dt)
                    return out.mul_(sa * srow)
                ref = fp8_ops.scaled_mm_reference(xq, xs, wq, ws, torch.float32)
                check(_rel(tensorwise(), ref) < 1e-2, f"fp8 tensor-wise scaled_mm + scaling {name} m={m}")
                note(f"fp8_{sec}", name, "quant + rowwise scaled_mm (engine)", time_ms(rowwise, device))
                note(f"fp8_{sec}", name, "quant + tensorwise scaled_mm + scale", time_ms(tensorwise, device))
                for v in fp8_gemm_variants(smoke):
                    label = "quant + triton " + "x".join(map(str, v))
                    try:
                        err = _rel(fp8_gemm(xq, xs, wq, ws, dt, *v), ref)
                        if err > 1e-2:
                            check(False, f"fp8 GEMM {name} m={m} {v}: rel err {err:.1e}")
                            continue
                        note(f"fp8_{sec}", name, label, time_ms(lambda: (lambda q, s, _: fp8_gemm(
                            *quantize_row_groups(x, k), q, s, dt, *v))(*fp8_w()), device))
                        note(f"fp8_{sec}", name, "triton only " + "x".join(map(str, v)), time_ms(
                            lambda: (lambda q, s, _: fp8_gemm(xq, xs, q, s, dt, *v))(*fp8_w()), device))
                    except Exception as e:  # noqa: BLE001
                        check(False, f"fp8 GEMM {name} m={m} {v}: {type(e).__name__}: {str(e)[:200]}")
            note(f"int4_{sec}", name, "dequant + mm", time_ms(
                lambda: x @ triton_int4.dequantize_int4(*int4_w(), None, 128, dt), device))
            ref4 = x.float() @ ref_w
            err = _rel(triton_int4.int4_matmul(x, wd.qweight, wd.scales, wd.zeros, None, 128, counters), ref4)
            check(err < 1e-2, f"int4 engine path {name} m={m}: rel err {err:.1e}")
            note(f"int4_{sec}", name, "engine", time_ms(
                lambda: triton_int4.int4_matmul(x, *engine_w(), None, 128, counters), device))
            for t in int4_tc_variants(smoke):
                try:
                    err = _rel(int4_stream_gemm(x, wt.qweight, wt.scales, wt.zeros, 128, counters, tiles=t), ref4)
                    if err > 1e-2:
                        check(False, f"int4 tiles {name} m={m} {t.label()}: rel err {err:.1e}")
                        continue
                    note(f"int4_{sec}", name, t.label(), time_ms(
                        lambda: int4_stream_gemm(x, *int4_w(), 128, counters, tiles=t), device))
                except Exception as e:  # noqa: BLE001
                    check(False, f"int4 tiles {name} m={m} {t.label()}: {type(e).__name__}: {str(e)[:200]}")
        for section in sorted({key.split("/")[0] for key in rec}):
            r = rec.get(f"{section}/{name}")
            if r:
                best = sorted(r.items(), key=lambda kv: kv[1])[:4]
                print(f"  {section} {name} {n}x{k}: bf16 {r.get('bf16', 0) * 1000:.1f} us, engine "
                      f"{r.get('engine', r.get('quant + rowwise scaled_mm (engine)', 0)) * 1000:.1f}; best: " +
                      "; ".join(f"{lab} {v * 1000:.1f}" for lab, v in best), flush=True)
        del w, wt, wd, codes, ref_w, bf16_w, int4_w, engine_w, fp8_w
        if cuda:
            torch.cuda.empty_cache()
    # per section: the layer's four linears, each at its best variant, and each variant over the layer
    summary = {}
    for section, per in totals.items():
        names = set().union(*(v.keys() for v in per.values()))
        full = {var: sum(t.values()) for var, t in per.items() if set(t) == names}
        best_each = sum(min(per[var][nm] for var in per if nm in per[var]) for nm in names)
        summary[section] = {"best_each_us": best_each * 1000, **{v: t * 1000 for v, t in full.items()}}
        ranked = sorted(full.items(), key=lambda kv: kv[1])
        print(f"  SWEEP {section}: layer ({'+'.join(sorted(names))}) bf16 {full.get('bf16', 0) * 1000:.0f} us, "
              f"engine {full.get('engine', full.get('quant + rowwise scaled_mm (engine)', 0)) * 1000:.0f}, "
              f"best per linear {best_each * 1000:.0f}; top: " +
              "; ".join(f"{v} {t * 1000:.0f}" for v, t in ranked[:6]), flush=True)
        for nm in sorted(names):
            cands = sorted(((per[var][nm], var) for var in per if nm in per[var]))
            print(f"  SWEEP {section} {nm}: " + "; ".join(f"{var} {t * 1000:.1f}" for t, var in cands[:5]), flush=True)
    results["sweep_summary_us"] = summary


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--precompile":
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        os.environ["TRITON_INTERPRET"] = "0"
        precompile_shard(sys.argv[2])
