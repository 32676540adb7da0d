"""INT4 dequantize-ahead (`quantization.int4_ahead`) on a GPU: bit-for-bit checks and a timing of
Llama-8B-shaped layers' linears (qkv, o, gate_up, down; GPTQ group 128, random weights) in a row.

Checks (exit 1 if one fails): `dequantize_into` (the plain launch and persistent programs) equals
`mma_dequantize`; a plan's outputs equal `mma_matmul`'s at 8,192 rows (eager) and at 256 rows
captured in a CUDA graph and replayed (o_proj alone a unit; and every linear a unit, the 256-row
swapped GEMMs' table entries removed for the run).

Timings, ms per layer of the four linears alone (no attention or norms between them: the ring can
hide its dequantization only behind the GEMMs here), bf16 cuBLAS on the dequantized weights beside:
- 8,192 rows (a prefill chunk), eager: the plain path (dequantize + cuBLAS on one stream) and the
  ring with each variant (units ahead, persistent programs, side stream priority);
- 256 rows (a decode step), CUDA graph: the plain routes (swapped GEMMs; o dequantize + cuBLAS),
  the ring for o, and the ring with down + qkv, then all four routed to dequantize + cuBLAS.
Writes $OUT/int4_ahead_check.json and $OUT/ahead_env (the fastest 8,192-row variant's
TOKENMILL_INT4_AHEAD* settings, for an engine started next).

    python scripts/gpu_int4_ahead_check.py [layers]        # default 8 layers, ~30 s with compiles
    AHEAD_CHECK_SMOKE=1 python scripts/gpu_int4_ahead_check.py 2   # CPU, small shapes: the script runs
"""

from __future__ import annotations

import json
import os
import sys
import time

SMOKE = os.environ.get("AHEAD_CHECK_SMOKE") == "1"  # CPU (Triton's interpreter), small shapes, no streams
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tokenmill.layers.quantization import (
    int4_ahead,
    stream_tiles,
)
from tokenmill.layers.quantization import int4_packing as packing
from tokenmill.layers.quantization import triton_int4_dot_gemm as dot
from tokenmill.layers.quantization import triton_int4_mma as mma

H, I, KV, GROUP = (128, 512, 32, 64) if SMOKE else (4096, 14336, 1024, 128)
SHAPES = {"qkv": (H + 2 * KV, H), "o": (H, H), "gate_up": (2 * I, H), "down": (H, I)}
DT = torch.float16 if SMOKE else torch.bfloat16
DEV = "cpu" if SMOKE else "cuda"
ROWS_BIG, ROWS_DECODE = (64, 48) if SMOKE else (8192, 256)
FAILS: list[str] = []


def check(ok: bool, what: str) -> None:
    print(f"  {'ok  ' if ok else 'FAIL'} {what}", flush=True)
    if not ok:
        FAILS.append(what)


def make_units(layers: int) -> list[nn.Module]:
    g = torch.Generator(device=DEV).manual_seed(0)
    units = []
    for _ in range(layers):
        for name, (n, k) in SHAPES.items():
            wt = packing.from_codes(packing.quantize_int4(torch.randn(n, k, device=DEV, generator=g) * 0.02, GROUP,
                                                          sym=False), DT, act_order=False)
            u = nn.Module()
            u.qweight, u.scales, u.zeros = packing.to_mma(wt.qweight), wt.scales, wt.zeros
            u.label, u.counters = name, stream_tiles.SplitCounters(n, torch.device(DEV)).tensor
            dot.keep_scale_offset(u.scales, u.zeros)  # (as `Int4LinearMethod` at load)
            units.append(u)
    return units


def plan_for(units, ahead=1, ctas=0, priority=0, lead=1) -> int4_ahead.AheadPlan:
    numel = max(u.qweight.shape[0] * 16 * u.qweight.shape[1] * 64 for u in units)
    ring = [torch.empty(numel, dtype=DT, device=DEV) for _ in range(ahead + 1)]
    sync = _OneStream() if SMOKE else int4_ahead.CudaSync(torch.device(DEV), ahead + 1, priority)
    return int4_ahead.AheadPlan(units, GROUP, DT, sync, ahead, ring, ctas=ctas, lead=lead)


class _OneStream:  # the smoke run's `int4_ahead.Sync`: everything in order
    def fork(self): pass
    def on_side(self, fn): fn()
    def side_waits_freed(self, slot): pass
    def side_records_ready(self, slot): pass
    def main_waits_ready(self, slot): pass
    def main_records_freed(self, slot): pass
    def join(self): pass


class _Replay:  # the smoke run's CUDA graph: replay runs fn again into the captured outputs
    def __init__(self, fn, outs) -> None:
        self.fn, self.outs = fn, outs

    def replay(self) -> None:
        for o, n in zip(self.outs, self.fn()):
            o.copy_(n)


def plain(u, x):
    return mma.mma_matmul(x, u.qweight, u.scales, u.zeros, GROUP, u.counters)


def run_step(units, xs, plan=None) -> list[torch.Tensor]:
    outs = []
    for u, x in zip(units, xs):
        own = lambda x, u=u: plain(u, x)
        outs.append(plan.run(u, x, own) if plan is not None else own(x))
    return outs


def overlap(fn) -> dict:
    """One call of fn under torch.profiler: the dequantization kernels' device time, and how much of
    it ran while another kernel ran (us)."""
    if SMOKE:
        return {}
    try:
        from torch.profiler import ProfilerActivity, profile

        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        kernels = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA]
        deq = [(a, b) for name, a, b in kernels if "dequant" in name]
        other = sorted((a, b) for name, a, b in kernels if "dequant" not in name)
        merged: list[list[float]] = []
        for a, b in other:
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        beside = sum(max(0.0, min(b, mb) - max(a, ma)) for a, b in deq for ma, mb in merged)
        span = max(b for _, _, b in kernels) - min(a for _, a, _ in kernels)
        return {"dequant_us": sum(b - a for a, b in deq), "beside_us": beside, "kernels": len(kernels),
                "span_us": span}
    except Exception as e:  # noqa: BLE001 - a profiler problem must not stop the checks
        return {"error": f"{type(e).__name__}: {e}"}


def inputs(units, m: int) -> list[torch.Tensor]:
    g = torch.Generator(device=DEV).manual_seed(m)
    return [torch.randn(m, u.qweight.shape[1] * 64, device=DEV, generator=g).to(DT) for u in units]


def time_eager(fn, reps: int = 3) -> float:
    if SMOKE:
        start = time.perf_counter()
        fn()
        return 1000 * (time.perf_counter() - start)
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def captured(fn):
    if SMOKE:
        return _Replay(fn, fn()), fn()
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = fn()
    return graph, outs


def time_graph(graph, reps: int = 10) -> float:
    if SMOKE:
        return time_eager(graph.replay)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def sync() -> None:
    if not SMOKE:
        torch.cuda.synchronize()


def main() -> int:
    layers = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    out_dir = os.environ.get("OUT", ".")
    t0 = time.perf_counter()
    dev_name = "CPU (smoke)" if SMOKE else torch.cuda.get_device_name()
    print(f"int4 dequantize-ahead check on {dev_name}, {layers} layers", flush=True)
    units = make_units(layers)
    rec: dict = {"device": dev_name, "layers": layers}

    u = units[2]  # gate_up
    ref = mma.mma_dequantize(u.qweight, u.scales, u.zeros, GROUP, DT).t()
    for ctas in (0, 16):
        out = torch.empty_like(ref)
        int4_ahead.dequantize_into(out, u.qweight, u.scales, u.zeros, GROUP, ctas)
        check(torch.equal(out, ref), f"dequantize_into (ctas {ctas}) == mma_dequantize, gate_up")
    bf16_w = [mma.mma_dequantize(v.qweight, v.scales, v.zeros, GROUP, DT) for v in units]  # [K, N] views

    # 8,192 rows, eager
    m = ROWS_BIG
    xs = inputs(units, m)
    want = run_step(units, xs)
    for ctas in (0, 16):
        got = run_step(units, xs, plan_for(units, 1, ctas))
        check(all(torch.equal(a, b) for a, b in zip(got, want)), f"ring (ctas {ctas}) == mma_matmul at {m} rows")
    del want, got
    variants = {"plain": None, "ahead1": {"ahead": 1}, "ahead2_lead2": {"ahead": 2, "lead": 2},
                "ahead1_ctas16": {"ctas": 16}, "ahead1_ctas66": {"ctas": 66}, "ahead1_high": {"priority": -1}}
    t8 = {"bf16_cublas": time_eager(lambda: [x @ w for x, w in zip(xs, bf16_w)]) / layers}
    for name, kw in variants.items():
        plan = plan_for(units, **kw) if kw is not None else None
        t8[name] = time_eager(lambda plan=plan: run_step(units, xs, plan)) / layers
        del plan
    rec["ms_per_layer_8192"] = t8
    best8 = min((k for k in t8 if k.startswith("ahead")), key=t8.get)
    for name in ("plain", "ahead1", best8):
        plan = plan_for(units, **variants[name]) if variants[name] is not None else None
        rec.setdefault("overlap_8192", {})[name] = overlap(lambda plan=plan: run_step(units, xs, plan))
        del plan
    print(f"  8192 rows, dequantization beside other kernels: {rec['overlap_8192']}", flush=True)
    print("  8192 rows, ms a layer (4 linears): " + ", ".join(f"{k} {v:.3f}" for k, v in t8.items()), flush=True)
    del xs
    if not SMOKE:
        torch.cuda.empty_cache()

    # 256 rows, CUDA graphs
    m = ROWS_DECODE
    xs = inputs(units, m)
    t2 = {}
    g, _ = captured(lambda: [x @ w for x, w in zip(xs, bf16_w)])
    t2["bf16_cublas"] = time_graph(g) / layers
    g, want = captured(lambda: run_step(units, xs))
    g.replay()
    sync()
    want = [w.clone() for w in want]
    t2["plain"] = time_graph(g) / layers
    qkv_key, down_key, gate_up_key = (256, 6144, 4096), (256, 4096, 14336), (256, 28672, 4096)
    saved = {key: dot.TABLE.get(key) for key in (qkv_key, down_key, gate_up_key)}
    gate_ups = frozenset(i for i, v in enumerate(units) if v.label == "gate_up")
    # (name, swapped-GEMM entries removed, lead, anchored at gate_up, units ahead)
    cases = [("ahead_o", (), 1, False, 1), ("ahead_o_lead2", (), 2, False, 1), ("ahead_o_lead3", (), 3, False, 1),
             ("ahead_o_at", (), 1, True, 1), ("ahead_o_qkv", (qkv_key,), 1, False, 1),
             ("ahead_o_qkv_at", (qkv_key,), 1, True, 1), ("ahead_o_qkv_down_at", (qkv_key, down_key), 1, True, 1),
             ("ahead2_o_qkv_down_at", (qkv_key, down_key), 1, True, 2),
             ("ahead_all", (qkv_key, down_key, gate_up_key), 1, False, 1)]
    routes = {name: (keys, lead, at, ahead) for name, keys, lead, at, ahead in cases}
    for name, keys, lead, at, ahead in cases:
        for key, t in saved.items():
            if key in keys:
                dot.TABLE.pop(key, None)
            elif t is not None:
                dot.TABLE[key] = t
        plan = plan_for(units, ahead=ahead, lead=lead)
        plan.anchors = gate_ups if at else frozenset()
        rows_units = [v.label for v in plan._step(m).seq[:4]]
        g, got = captured(lambda plan=plan: run_step(units, xs, plan))
        g.replay()
        sync()
        if not keys:
            check(all(torch.equal(a, b) for a, b in zip(got, want)), f"ring in a CUDA graph == mma_matmul at {m} rows, "
                  f"{name} (units of layer 0: {rows_units})")
        else:  # the reference: the plain path with the same routes
            g2, ref = captured(lambda: run_step(units, xs))
            g2.replay()
            sync()
            check(all(torch.equal(a, b) for a, b in zip(got, ref)), f"ring in a CUDA graph == mma_matmul at {m} rows, "
                  f"{name} (units of layer 0: {rows_units})")
            t2["plain_" + "_".join(str(k[1]) for k in keys)] = time_graph(g2) / layers  # (same routes, no ring)
            del g2, ref
        t2[name] = time_graph(g) / layers
        if name in ("ahead_o", "ahead_o_at", "ahead_o_qkv_at"):
            rec.setdefault("overlap_256", {})[name] = overlap(g.replay)
        del g, got, plan
    for key, t in saved.items():
        if t is not None:
            dot.TABLE[key] = t
    rec["ms_per_layer_256"] = t2
    print("  256 rows, ms a layer (4 linears, graph): " + ", ".join(f"{k} {v:.3f}" for k, v in t2.items()), flush=True)

    kw = variants[best8]
    best2 = min(("ahead_o", "ahead_o_lead2", "ahead_o_lead3", "ahead_o_at"), key=t2.get)
    env = {"TOKENMILL_INT4_AHEAD": str(kw.get("ahead", 1)), "TOKENMILL_INT4_AHEAD_CTAS": str(kw.get("ctas", 0)),
           "TOKENMILL_INT4_AHEAD_PRIORITY": str(kw.get("priority", 0)),
           "TOKENMILL_INT4_AHEAD_LEAD": str(kw.get("lead", int(best2[-1]) if "lead" in best2 else 1)),
           "TOKENMILL_INT4_AHEAD_AT": "gate_up_proj" if best2 == "ahead_o_at" else ""}
    rec["best_8192"], rec["best_256"], rec["best_env"], rec["fails"] = best8, best2, env, FAILS
    rec["wall_s"] = time.perf_counter() - t0
    with open(os.path.join(out_dir, "int4_ahead_check.json"), "w") as f:
        json.dump(rec, f, indent=1)
    with open(os.path.join(out_dir, "ahead_env"), "w") as f:
        f.write("".join(f"export {k}={v}\n" for k, v in env.items()))
    # the fastest variant that routes more linears to dequantize + cuBLAS at 256 rows: an engine's settings
    routed = min((k for k in routes if routes[k][0] and k != "ahead_all"), key=t2.get)
    keys, lead, at, ahead = routes[routed]
    x1 = {"TOKENMILL_INT4_GEMM_TABLE": ";".join(f"{b},{n},{k}=none" for b, n, k in keys),
          "TOKENMILL_INT4_AHEAD": str(ahead), "TOKENMILL_INT4_AHEAD_LEAD": str(lead),
          "TOKENMILL_INT4_AHEAD_AT": "gate_up_proj" if at else "", "TOKENMILL_INT4_AHEAD_CTAS": env["TOKENMILL_INT4_AHEAD_CTAS"]}
    rec["best_routed_256"], rec["routed_env"] = routed, x1
    with open(os.path.join(out_dir, "routed_env"), "w") as f:
        f.write(" ".join(f"{k}={v}" for k, v in x1.items()))
    print(f"  fastest routed variant at 256 rows: {routed} -> {x1}", flush=True)
    print(f"  256 rows, dequantization beside other kernels: {rec.get('overlap_256')}", flush=True)
    print(f"  fastest: {best8} (8192 rows), {best2} (256 rows) -> {env}; {len(FAILS)} failures; {rec['wall_s']:.0f} s",
          flush=True)
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
