"""The warp-specialized INT4 GEMM (`gluon_int4_ws_gemm`) on a GPU: self-test, then timings against bf16
cuBLAS and the engine's routed INT4 path (`triton_int4_mma.mma_matmul`) for one Llama-8B layer's four
linears, in one process, on the same card.

    python scripts/gpu_int4_ws.py --selftest 0/4 OUT     # shard 0 of 4 of the launches: compile + check
    python scripts/gpu_int4_ws.py --bench OUT [ROWS]     # ROWS e.g. 256,128,512 (default)
    python scripts/gpu_int4_ws.py --diag-prep 0/4 OUT    # compile + run once each DIAG / PROBE variant
    python scripts/gpu_int4_ws.py --diag OUT             # gate_up at 256 rows: DIAG variants, cycle probes
    python scripts/gpu_int4_ws.py --one LABEL DIAG       # one launch, 4 calls (for ncu)

--selftest: every launch of `LAUNCHES` on small shapes (N 512, K 1024 and 1536, groups 128 / 64) at
full and ragged row counts (256, 200, 77, 16) against a float32 reference of the dequantized weight
(rel err < 1e-2; split-K counters back to zero), one split-K launch replayed in a CUDA graph; also
fills the compile cache for --bench (shards run in parallel processes). --bench: per row count and
linear, bf16 cuBLAS, the routed INT4 path and each launch of `variants` (checked on the real shape
first), us per call from CUDA-graph replays of 20 calls with the weights cycled past L2. JSON after
every linear: OUT/int4ws-selftest-SHARD.json, OUT/int4ws-bench.json. Budget: INT4_WS_BUDGET_S (90).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

LLAMA = {"gate_up": (28672, 4096), "down": (4096, 14336), "qkv": (6144, 4096), "o": (4096, 4096)}
GROUP = 128
DEVICE = os.environ.get("INT4_WS_DEVICE", "cuda")  # "cpu": a dry run of the script's logic (tests only)


def _w(bm, bn, stages, warps, deq=4, split=1, regs=168, sk=0, parts=1, km=1):
    from tokenmill.layers.quantization.int4_ws_route import WsTiles
    return WsTiles(bm, bn, stages, warps, deq, split, regs, sk, parts, km)


def _run(t, x, qm, scales, zeros, group, sz, counters):
    """One launch: the stream-K kernel for t.sk, else the plain one."""
    if t.sk:
        from tokenmill.layers.quantization.gluon_int4_ws_streamk import ws_streamk_gemm
        return ws_streamk_gemm(x, qm, scales, zeros, group, t, counters, sz=sz)
    from tokenmill.layers.quantization.gluon_int4_ws_gemm import ws_gemm
    return ws_gemm(x, qm, scales, zeros, group, t, sz=sz, counters=counters)


def variants(m: int, name: str) -> list:
    """The launches timed per row count and linear (CTAs at 256 rows in the comments; 132 SMs, one CTA an
    SM). Session 11 round 4: kmajor 2 (its pair map mended) beside each linear's best kmajor 1 launch
    (rounds 2-3; ncu, round 1: the N-major ring's stores were 4-way bank-conflicted)."""
    if name == "gate_up":  # 224 tiles of 256 x 128 (1.7 waves)
        return [_w(256, 128, 4, 8), _w(256, 128, 4, 8, km=2)]
    if name == "down":  # K 14336: 224 steps
        return [_w(256, 128, 4, 8, split=4)]
    if name == "qkv":  # 48 / 96 tiles
        return [_w(256, 64, 4, 8)]
    return [_w(128, 64, 6, 4, regs=136, parts=0), _w(128, 64, 6, 4, regs=136, parts=0, km=2),
            _w(128, 64, 6, 4, split=2, regs=136, parts=0, km=2)]


# timing only (no correct output): DIAG 1, the dequantizers make no tile (the consumer and loader
# alone), at 256 rows on gate_up: whether the dequantizers set the step time
DIAG_LAUNCHES = ((256, 128, 4, 8, 4, 1, 168, 0, 1, 2),)


def launches() -> list:
    """Every distinct launch of `variants` (one compile each)."""
    seen = []
    for m in (256,):
        for name in LLAMA:
            for t in variants(m, name):
                if t not in seen:
                    seen.append(t)
    return seen


def _weights(n, k, group, seed=0):
    from tokenmill.layers.quantization import int4_packing as packing
    from tokenmill.layers.quantization.triton_int4_dot_gemm import packed_scale_offset
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    w = (torch.randn(n, k, device=DEVICE, generator=g) * 0.02).to(torch.bfloat16)
    wt = packing.from_codes(packing.quantize_int4(w, group, sym=False), torch.bfloat16, act_order=False)
    qm = packing.to_mma(wt.qweight)
    sz = packed_scale_offset(wt.scales, wt.zeros)
    wt.scales._int4_dot_sz = sz  # as the engine keeps them from load
    return w, wt, qm, sz, packing.dequantize(wt, group, torch.float32)


def _rel(out, ref):
    return ((out.float() - ref).norm() / ref.norm()).item()


def _dump(obj, path):
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(path + ".tmp", path)


def selftest(shard: str, out_dir: str) -> int:
    i, n_shards = (int(v) for v in shard.split("/"))
    mine = launches()[i::n_shards]
    rec = {"device": torch.cuda.get_device_name(), "checks": []}
    path = os.path.join(out_dir, f"int4ws-selftest-{i}.json")
    fails = 0
    cases = [(512, 1024, 128), (512, 1536, 64)]
    data = {c: _weights(*c) for c in cases}
    counters = torch.zeros(4096, dtype=torch.int32, device=DEVICE)
    for t in mine:
        for (n, k, group), (_, wt, qm, sz, ref_w) in data.items():
            for m in (256, 200, 77, 16):
                x = torch.randn(m, k, device=DEVICE).to(torch.bfloat16)
                t0 = time.perf_counter()
                try:
                    out = _run(t, x, qm, wt.scales, wt.zeros, group, sz, counters)
                    torch.cuda.synchronize()
                    err = _rel(out, x.float() @ ref_w)
                    ok = err < 1e-2 and not counters.any().item()
                    what = f"rel err {err:.1e}, counters zero {not counters.any().item()}"
                except Exception as e:  # noqa: BLE001 - reported, not fatal
                    ok, what = False, f"{type(e).__name__}: {str(e)[:300]}"
                fails += not ok
                rec["checks"].append({"launch": t.label(), "n": n, "k": k, "group": group, "m": m, "ok": ok,
                                      "what": what, "s": round(time.perf_counter() - t0, 2)})
                print(f"  [{'ok' if ok else 'FAIL'}] {t.label()} n{n} k{k} g{group} m{m}: {what}", flush=True)
                _dump(rec, path)
    if DEVICE == "cuda" and i < len(DIAG_LAUNCHES):  # compile the timing-only variants for --bench
        from tokenmill.layers.quantization.gluon_int4_ws_gemm import ws_gemm
        from tokenmill.layers.quantization.int4_ws_route import WsTiles
        (n, k, group), (_, wt, qm, sz, _) = next(iter(data.items()))
        for d in (1,):
            try:
                ws_gemm(torch.randn(256, k, device=DEVICE).to(torch.bfloat16), qm, wt.scales, wt.zeros, group,
                        WsTiles(*DIAG_LAUNCHES[i]), sz=sz, diag=d)
                torch.cuda.synchronize()
                print(f"  diag{d} {WsTiles(*DIAG_LAUNCHES[i]).label()} compiled and ran", flush=True)
            except Exception as e:  # noqa: BLE001 - reported, not fatal
                print(f"  diag{d}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    split_t = next((t for t in mine if t.split > 1 or t.sk), None)
    if split_t is not None:  # a split-K launch replayed in a CUDA graph (the counters reset themselves)
        (n, k, group), (_, wt, qm, sz, ref_w) = next(iter(data.items()))
        xs = [torch.randn(200, k, device=DEVICE).to(torch.bfloat16) for _ in range(3)]
        _run(split_t, xs[0], qm, wt.scales, wt.zeros, group, sz, counters)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = [_run(split_t, x, qm, wt.scales, wt.zeros, group, sz, counters) for x in xs]
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        err = max(_rel(o, x.float() @ ref_w) for o, x in zip(outs, xs))
        ok = err < 1e-2 and not counters.any().item()
        fails += not ok
        rec["checks"].append({"launch": split_t.label(), "graph": True, "ok": ok, "what": f"rel err {err:.1e}"})
        print(f"  [{'ok' if ok else 'FAIL'}] {split_t.label()} in a CUDA graph, replayed: rel err {err:.1e}", flush=True)
    rec["failures"] = fails
    _dump(rec, path)
    return fails


def _graph_us(fn, copies: int, reps: int = 20) -> float:
    """us per call: a CUDA graph of `reps` calls fn(i) (i: the weight copy), replayed, median of 5."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(2):
            fn(i % copies)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for r in range(reps):
            fn(r % copies)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / reps)
    del graph
    return sorted(times)[2]


def _prepare(n, k):
    """The linear's weights: (wt, words, packed scales, float32 reference, bf16 copies, INT4 copies) with
    enough copies of each to cycle ~150 MB (past the 50 MB L2)."""
    w, wt, qm, sz, ref_w = _weights(n, k, GROUP)
    n_bf = max(2, math.ceil(150e6 / (w.numel() * 2)))
    n_q = max(2, math.ceil(150e6 / (qm.numel() * 4 + sz.numel() * 4)))
    bf = [w] + [w.clone() for _ in range(n_bf - 1)]
    q = [(qm, wt.scales, wt.zeros, sz)]
    for _ in range(n_q - 1):
        s = wt.scales.clone()
        s._int4_dot_sz = sz.clone()
        q.append((qm.clone(), s, wt.zeros.clone(), s._int4_dot_sz))
    return wt, qm, sz, ref_w, bf, q


def passed_launches(out_dir: str) -> set | None:
    """INT4_WS_PASSED_ONLY=1: the labels of the launches whose self-test checks in out_dir passed at 256
    rows and in the graph (a launch that failed there, hung or never ran is not timed; a failure at 200,
    77 or 16 rows only is reported by the self-test, not filtered); None: no filter."""
    if os.environ.get("INT4_WS_PASSED_ONLY") != "1":
        return None
    ok, bad, any_bad = set(), set(), set()
    for f in os.listdir(out_dir):
        if f.startswith("int4ws-selftest-") and f.endswith(".json"):
            with open(os.path.join(out_dir, f)) as fh:
                for c in json.load(fh)["checks"]:
                    if c["ok"]:
                        ok.add(c["launch"])
                    else:
                        any_bad.add(c["launch"])
                        if c.get("m", 256) >= 256:
                            bad.add(c["launch"])
    global CLEAN
    CLEAN = ok - any_bad
    return ok - bad


CLEAN: set | None = None  # the launches without any self-test failure (the only ones the table may list)


def _bench_linear(rec, path, name, n, k, m, data, counters, deadline) -> None:
    from tokenmill.layers.quantization import triton_int4_mma as mma
    wt, qm, sz, ref_w, bf, q = data
    n_bf, n_q = len(bf), len(q)
    x = torch.randn(m, k, device=DEVICE).to(torch.bfloat16)
    ref = x.float() @ ref_w
    r = rec["us"].setdefault(f"m{m}/{name}", {})
    r["bf16"] = _graph_us(lambda i, x=x: x @ bf[i].t(), n_bf)
    err = _rel(mma.mma_matmul(x, qm, wt.scales, wt.zeros, GROUP, counters), ref)
    rec["errors"][f"m{m}/{name}/routed"] = err
    r["routed"] = _graph_us(lambda i, x=x: mma.mma_matmul(x, *q[i][:3], GROUP, counters), n_q)
    try:  # the engine's form where the swapped GEMM takes it: x written in its K order by the norm / SiLU
        from tokenmill.layers.quantization import int4_kperm
        if DEVICE == "cuda" and int4_kperm.swap_route(m, qm.shape[0] * 16, qm.shape[1] * 64, GROUP, x.dtype):
            from tokenmill.layers.quantization.gluon_int4_swap_gemm import permute_x
            xp = permute_x(x)
            err = _rel(mma.mma_matmul(xp, qm, wt.scales, wt.zeros, GROUP, counters, x_kperm=True), ref)
            rec["errors"][f"m{m}/{name}/routed kperm"] = err
            r["routed kperm"] = _graph_us(lambda i, xp=xp: mma.mma_matmul(xp, *q[i][:3], GROUP, counters,
                                                                          x_kperm=True), n_q)
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        rec["errors"][f"m{m}/{name}/routed kperm"] = f"{type(e).__name__}: {str(e)[:300]}"
    for t in variants(m, name):
        if time.perf_counter() > deadline:
            break
        if rec["passed"] is not None and t.label() not in rec["passed"]:
            continue
        try:
            err = _rel(_run(t, x, qm, wt.scales, wt.zeros, GROUP, sz, counters), ref)
            rec["errors"][f"m{m}/{name}/{t.label()}"] = err
            if err > 1e-2 or counters.any().item():
                print(f"  [FAIL] m{m} {name} {t.label()}: rel err {err:.1e}", flush=True)
                continue
            r[t.label()] = _graph_us(lambda i, t=t, x=x: _run(t, x, q[i][0], q[i][1], q[i][2], GROUP, q[i][3],
                                                              counters), n_q)
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            rec["errors"][f"m{m}/{name}/{t.label()}"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"  [FAIL] m{m} {name} {t.label()}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    if name == "gate_up" and m == 256 and DEVICE == "cuda":
        from tokenmill.layers.quantization.gluon_int4_ws_gemm import ws_gemm
        from tokenmill.layers.quantization.int4_ws_route import WsTiles
        for args in DIAG_LAUNCHES:
            t = WsTiles(*args)
            for d in (1,):
                try:
                    r[f"diag{d} {t.label()}"] = _graph_us(lambda i, t=t, d=d, x=x: ws_gemm(
                        x, q[i][0], q[i][1], q[i][2], GROUP, t, sz=q[i][3], counters=counters, diag=d), n_q)
                except Exception as e:  # noqa: BLE001 - reported, not fatal
                    rec["errors"][f"m{m}/{name}/diag{d} {t.label()}"] = f"{type(e).__name__}: {str(e)[:300]}"
    ranked = sorted((v, lab) for lab, v in r.items())
    print(f"m{m} {name} {n}x{k}: " + "; ".join(f"{lab} {v:.1f}" for v, lab in ranked), flush=True)
    _dump(rec, path)


def bench(out_dir: str, rows: list[int]) -> None:
    budget = float(os.environ.get("INT4_WS_BUDGET_S", "90"))
    deadline = time.perf_counter() + budget
    rec = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "us": {}, "errors": {}}
    path = os.path.join(out_dir, "int4ws-bench.json")
    passed = passed_launches(out_dir)
    rec["passed"] = None if passed is None else sorted(passed)
    print(f"launches timed: {'all' if passed is None else sorted(passed)}", flush=True)
    counters = torch.zeros(8192, dtype=torch.int32, device=DEVICE)
    data = {name: _prepare(n, k) for name, (n, k) in LLAMA.items()}
    print(f"weights ready ({time.perf_counter() - deadline + budget:.0f} s)", flush=True)
    for m in rows:  # the first row count for all four linears first (the budget's cut)
        for name, (n, k) in LLAMA.items():
            if time.perf_counter() > deadline:
                break
            _bench_linear(rec, path, name, n, k, m, data[name], counters, deadline)
    for m in rows:  # the layer: each linear at its best ws launch, against bf16 and the routed path
        lay = {key: 0.0 for key in ("bf16", "routed", "ws best", "best of routed / ws")}
        full = True
        for name in LLAMA:
            r = rec["us"].get(f"m{m}/{name}")
            if not r:
                full = False
                continue
            ws = min((v for lab, v in r.items() if lab.startswith("ws ")), default=float("inf"))
            lay["bf16"] += r["bf16"]
            routed = min(r["routed"], r.get("routed kperm", float("inf")))
            lay["routed"] += routed
            lay["ws best"] += ws
            lay["best of routed / ws"] += min(ws, routed)
        if full:
            rec.setdefault("layer", {})[f"m{m}"] = lay
            print(f"layer m{m}: " + ", ".join(f"{key} {v:.1f}" for key, v in lay.items()), flush=True)
    entries = []  # TOKENMILL_INT4_WS_TABLE: each (rows, linear) where a ws launch beat the routed path by 3%+
    for key, r in rec["us"].items():
        m, name = key[1:].split("/")
        ws = min(((v, lab) for lab, v in r.items() if lab.startswith("ws ")), default=None)
        routed = min(r["routed"], r.get("routed kperm", float("inf")))
        if ws is not None and ws[0] < 0.97 * routed and (CLEAN is None or ws[1] in CLEAN):
            n, k = LLAMA[name]
            entries.append(f"{m},{n},{k}={ws[1]}")
    rec["table"] = ";".join(entries)
    print(f"TOKENMILL_INT4_WS_TABLE=\"{rec['table']}\"", flush=True)
    _dump(rec, path)


# --diag: the launches whose dequantizers are taken apart (gate_up, 256 rows), the timing-only DIAG
# variants of `_deq_step` / `_consumer` (0: the real kernel) and those run with the cycle probe
DIAG_TILES = ((256, 128, 4, 8, 4, 1, 168, 0, 1, 1), (256, 128, 4, 8, 4, 1, 168, 0, 1, 2))
DIAG_CODES = (0, 1, 2)
PROBED = (0,)
# the steps two at a time (deq_parts 0, `_deq_pair`): the real kernel only (DIAG 0), probed too
PAIR_TILES = ((128, 64, 6, 4, 4, 1, 136, 0, 0, 2),)
DEQ_PHASES = ("wait words", "load + compute", "wait B slot", "store issue", "fence + barrier + arrives")
CONS_PHASES = ("wait x", "wait B", "wgmma issue + retire", "release")


def _diag_jobs() -> list:
    return ([(t, d, False) for t in DIAG_TILES for d in DIAG_CODES] + [(t, d, True) for t in DIAG_TILES for d in PROBED]
            + [(t, 0, p) for t in PAIR_TILES for p in (False, True)])


def diag_prep(shard: str, out_dir: str) -> int:
    """Compile and run once each (launch, DIAG, PROBE) of this shard on a small shape; DIAG 0 (with and
    without the probe) checked against the float32 reference."""
    from tokenmill.layers.quantization.gluon_int4_ws_gemm import ws_gemm
    from tokenmill.layers.quantization.int4_ws_route import WsTiles
    i, n_shards = (int(v) for v in shard.split("/"))
    cases = {c: _weights(*c) for c in ((512, 1024, 128), (512, 1088, 64))}  # 16 and 17 steps
    fails, rec = 0, []
    for args, d, probed in _diag_jobs()[i::n_shards]:
        t = WsTiles(*args)
        for (n, k, group), (_, wt, qm, sz, ref_w) in cases.items():
            for m in ((256, 77) if d == 0 else (256,)):
                x = torch.randn(m, k, device=DEVICE).to(torch.bfloat16)
                probe = torch.zeros(16 * 2 * 4, dtype=torch.int64, device=DEVICE) if probed else None
                try:
                    out = ws_gemm(x, qm, wt.scales, wt.zeros, group, t, sz=sz, diag=d, probe=probe)
                    torch.cuda.synchronize()
                    err = _rel(out, x.float() @ ref_w)
                    ok = err < 1e-2 if d == 0 else True
                    what = f"rel err {err:.1e}" + (f", probe {probe[:16].tolist()}" if probed else "")
                except Exception as e:  # noqa: BLE001 - reported, not fatal
                    ok, what = False, f"{type(e).__name__}: {str(e)[:300]}"
                fails += not ok
                rec.append({"launch": t.label(), "diag": d, "probe": probed, "k": k, "m": m, "ok": ok, "what": what})
                print(f"  [{'ok' if ok else 'FAIL'}] {t.label()} diag{d}{' probe' if probed else ''} k{k} m{m}: {what}",
                      flush=True)
                _dump(rec, os.path.join(out_dir, f"int4ws-diagprep-{i}.json"))
    return fails


def diag(out_dir: str) -> None:
    """gate_up (28672 x 4096) at 256 rows: us a call of each DIAG variant (CUDA graphs, weights cycled
    past L2) beside bf16 cuBLAS, then per probed variant the mean cycles a step of each phase of the
    dequantizers and of the consumer (summed over the CTAs' steps; clock64 of each CTA's SM)."""
    from tokenmill.layers.quantization.gluon_int4_ws_gemm import ws_gemm
    from tokenmill.layers.quantization.int4_ws_route import WsTiles
    n, k = LLAMA["gate_up"]
    m = 256
    wt, qm, sz, ref_w, bf, q = _prepare(n, k)
    x = torch.randn(m, k, device=DEVICE).to(torch.bfloat16)
    rec = {"device": torch.cuda.get_device_name(), "us": {}, "cycles": {}}
    path = os.path.join(out_dir, "int4ws-diag.json")
    ref = x.float() @ ref_w
    rec["us"]["bf16"] = _graph_us(lambda i: x @ bf[i % len(bf)].t(), len(bf))
    print(f"bf16 {rec['us']['bf16']:.1f} us", flush=True)
    for args in DIAG_TILES + PAIR_TILES:
        t = WsTiles(*args)
        rec.setdefault("rel err diag0", {})[t.label()] = _rel(ws_gemm(x, qm, wt.scales, wt.zeros, GROUP, t, sz=sz), ref)
        for d in (DIAG_CODES if args in DIAG_TILES else (0,)):
            try:
                us = _graph_us(lambda i, t=t, d=d: ws_gemm(x, q[i][0], q[i][1], q[i][2], GROUP, t, sz=q[i][3], diag=d),
                               len(q))
                rec["us"][f"{t.label()} diag{d}"] = us
                print(f"{t.label()} diag{d}: {us:.1f} us", flush=True)
            except Exception as e:  # noqa: BLE001 - reported, not fatal
                print(f"{t.label()} diag{d}: {type(e).__name__}: {str(e)[:300]}", flush=True)
        tiles = -(-m // t.bm) * (n // t.bn)
        for d in (PROBED if args in DIAG_TILES else (0,)):
            probe = torch.zeros(16 * tiles, dtype=torch.int64, device=DEVICE)
            try:
                for _ in range(3):  # the last call's sums (each call overwrites them)
                    out = ws_gemm(x, qm, wt.scales, wt.zeros, GROUP, t, sz=sz, diag=d, probe=probe)
                torch.cuda.synchronize()
                if d == 0:  # the probe must not change the product
                    rec["rel err diag0"][t.label() + " probed"] = _rel(out, ref)
            except Exception as e:  # noqa: BLE001 - reported, not fatal
                print(f"{t.label()} diag{d} probe: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            p = probe.view(tiles, 16).double().cpu()
            steps = k // 64
            deq = {name: round(p[:, j].mean().item() / steps, 1) for j, name in enumerate(DEQ_PHASES)}
            deq["loop total / step"] = round(p[:, 7].mean().item() / steps, 1)
            cons = {name: round(p[:, 8 + j].mean().item() / (steps - 1), 1) for j, name in enumerate(CONS_PHASES)}
            cons["loop total / step"] = round(p[:, 15].mean().item() / steps, 1)
            rec["cycles"][f"{t.label()} diag{d}"] = {"dequantizers": deq, "consumer": cons}
            print(f"{t.label()} diag{d} cycles a step: dequantizers {deq}; consumer {cons}", flush=True)
        _dump(rec, path)
    _dump(rec, path)


def one(label: str, d: int) -> None:
    """Four calls of one launch on gate_up at 256 rows (the profiler's target: the last ones)."""
    from tokenmill.layers.quantization.gluon_int4_ws_gemm import ws_gemm
    from tokenmill.layers.quantization.int4_ws_route import WsTiles
    n, k = LLAMA["gate_up"]
    _, wt, qm, sz, _ = _weights(n, k, GROUP)
    x = torch.randn(256, k, device=DEVICE).to(torch.bfloat16)
    for _ in range(4):
        ws_gemm(x, qm, wt.scales, wt.zeros, GROUP, WsTiles.parse(label), sz=sz, diag=d)
    torch.cuda.synchronize()
    print(f"{label} diag{d}: 4 calls", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "--diag-prep":
        sys.exit(1 if diag_prep(sys.argv[2], sys.argv[3]) else 0)
    if sys.argv[1] == "--diag":
        sys.exit(diag(sys.argv[2]))
    if sys.argv[1] == "--one":
        sys.exit(one(sys.argv[2], int(sys.argv[3])))
    if sys.argv[1] == "--selftest":
        sys.exit(1 if selftest(sys.argv[2], sys.argv[3]) else 0)
    bench(sys.argv[2], [int(v) for v in (sys.argv[3] if len(sys.argv) > 3 else "256,128,512").split(",")])
