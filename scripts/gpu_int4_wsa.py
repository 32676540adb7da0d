"""The warp-specialized swapped INT4 GEMM (`gluon_int4_wsa_gemm`) on a GPU: self-test, then timings against
bf16 cuBLAS and the engine's routed INT4 path (`triton_int4_mma.mma_matmul`, on x natural and on x in the
swapped GEMM's K order as the engine gives it) for one Llama-8B layer's four linears, one process, one card.

    python scripts/gpu_int4_wsa.py --selftest 0/4 OUT     # shard 0 of 4 of the launches: compile + check
    python scripts/gpu_int4_wsa.py --bench OUT [ROWS]     # ROWS e.g. 256,8192 (default 256)
    python scripts/gpu_int4_wsa.py --pick OUT             # DEFAULT_TABLE with --bench's winners: OUT/table.txt

--selftest: every launch of `launches()` on small shapes (N 512, K 1024 group 128 and K 1536 group 64)
at 256, 200, 77 and 16 rows against a float32 reference of the dequantized weight times x (x given to
the kernel permuted, `permute_x`; rel err < 1e-2, split-K counters back to zero), one split-K launch
replayed in a CUDA graph; also fills the compile cache for --bench. --bench: per row count and linear,
bf16 cuBLAS, the routed INT4 path and each launch of `variants` (each checked on the real shape first:
rel err < 1e-2 or not timed), us per call from CUDA-graph replays of 20 calls with the weights cycled
past L2. JSON after every linear: OUT/int4wsa-selftest-SHARD.json, OUT/int4wsa-bench.json, and the
TOKENMILL_INT4_WSA_TABLE line of the launches 3% under the routed path. Budget: INT4_WSA_BUDGET_S (80).
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_int4_bench import LLAMA, dump, graph_us, prepare, rel, weights  # scripts/: the shared bench parts

GROUP = 128


def _t(bt, wgs, stages, split=1, sk=0, depth=1, raster=0):
    from tokenmill.layers.quantization.int4_wsa_route import WsaTiles
    return WsaTiles(bt, wgs, 1, stages, split, sk, depth, raster)


def variants(m: int, name: str) -> list:
    """The launches timed per row count and linear (CTAs at 256 rows in the comments; 132 SMs, one CTA an
    SM). Round 6 (session 11): the routed ones (`int4_wsa_route.DEFAULT_TABLE` / `DEFAULT_PREFILL`) first,
    then the skinny linears' x traffic cut by more channels per x tile: 64-token tiles of 256 channels
    (t64 g4: x read N / 256 times, the weight 4 times from L2; t32 g4: 8 times) or 128 (t64 g2), and
    128 x 128 tiles split. Rounds 1-4 also timed depth 2 (never better), stream-K (won only for qkv,
    before its plain 128 x 128 launch), split 4 (worse than 2); t128 g4 is not timed (ptxas serializes
    its wgmmas: 16 consumer warps have ~120 registers). INT4_WSA_ROUTED_ONLY=1: only the launch the route's
    tables list (`int4_wsa_route.TABLE` / `PREFILL`), none where they list none."""
    if os.environ.get("INT4_WSA_ROUTED_ONLY") == "1":
        from tokenmill.layers.quantization import int4_wsa_route as wsa
        from tokenmill.layers.quantization.int4_mma_launch import gemm_row_bucket
        n, k = LLAMA[name]
        bucket = gemm_row_bucket(m)
        t = wsa.TABLE.get((bucket, n, k)) if bucket is not None else wsa.PREFILL.get((n, k))
        return [t] if t is not None else []
    if m > 1024:  # a prefill chunk: whole tiles of 256 x 128 in groups of r token tiles (x stays in L2)
        return [_t(256, 2, 4, raster=8) if name == "gate_up" else _t(256, 2, 4, raster=2)]
    if name == "gate_up":  # 224 CTAs of 256 x 128
        return [_t(256, 2, 5)]
    if name == "down":  # K 14336: 224 steps; 128 CTAs each (t64 g2, t32 g4: no split) but t64 g4 (64)
        return [_t(256, 1, 6, 2), _t(64, 4, 6, 2), _t(64, 4, 8, 2), _t(128, 2, 6, 2), _t(64, 2, 6), _t(64, 4, 6),
                _t(32, 4, 8)]
    if name == "qkv":  # 96 CTAs each
        return [_t(128, 2, 6), _t(64, 4, 6), _t(64, 4, 8)]
    # o: 128 CTAs (t64 g2, t32 g4: no split) but t64 g4 without split (64)
    return [_t(256, 1, 4, 2), _t(64, 4, 6), _t(64, 4, 6, 2), _t(64, 4, 8, 2), _t(128, 2, 6, 2), _t(64, 2, 6),
            _t(32, 4, 8)]


def launches() -> list:
    """Every distinct launch of `variants` (one compile each; split-K shares the plain launch's compile
    only in part: SPLIT_K is a constexpr)."""
    seen = []
    for m in (256, 8192):
        for name in LLAMA:
            for t in variants(m, name):
                if t not in seen:
                    seen.append(t)
    return seen


def _run(t, xp, qm, scales, zeros, group, sz, counters):
    """One launch: the stream-K kernel for t.sk, else the plain one."""
    if t.sk:
        from tokenmill.layers.quantization.gluon_int4_wsa_streamk import (
            wsa_streamk_gemm,
        )
        return wsa_streamk_gemm(xp, qm, scales, zeros, group, t, counters, sz=sz)
    from tokenmill.layers.quantization.gluon_int4_wsa_gemm import wsa_gemm
    return wsa_gemm(xp, qm, scales, zeros, group, t, sz=sz, counters=counters)


def selftest(shard: str, out_dir: str) -> int:
    from tokenmill.layers.quantization.gluon_int4_swap_gemm import permute_x
    i, n_shards = (int(v) for v in shard.split("/"))
    mine = launches()[i::n_shards]
    rec = {"device": torch.cuda.get_device_name(), "checks": []}
    path = os.path.join(out_dir, f"int4wsa-selftest-{i}.json")
    fails = 0
    data = {c: weights(*c) for c in [(512, 1024, 128), (512, 1536, 64)]}
    counters = torch.zeros(4096, dtype=torch.int32, device="cuda")
    for t in mine:
        for (n, k, group), (_, wt, qm, sz, ref_w) in data.items():
            for m in (256, 200, 77, 16) + ((600,) if t.raster else ()):  # 600: a partial last group
                x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
                t0 = time.perf_counter()
                try:
                    out = _run(t, permute_x(x), qm, wt.scales, wt.zeros, group, sz, counters)
                    torch.cuda.synchronize()
                    err = rel(out, x.float() @ ref_w)
                    ok = err < 1e-2 and not counters.any().item()
                    what = f"rel err {err:.1e}, counters zero {not counters.any().item()}"
                except Exception as e:  # noqa: BLE001 - reported, not fatal
                    ok, what = False, f"{type(e).__name__}: {str(e)[:300]}"
                fails += not ok
                rec["checks"].append({"launch": t.label(), "n": n, "k": k, "group": group, "m": m, "ok": ok,
                                      "what": what, "s": round(time.perf_counter() - t0, 2)})
                print(f"  [{'ok' if ok else 'FAIL'}] {t.label()} n{n} k{k} g{group} m{m}: {what}", flush=True)
                dump(rec, path)
    split_t = next((t for t in mine if t.split > 1 or t.sk), None)
    if split_t is not None:  # a split-K launch replayed in a CUDA graph (the counters reset themselves)
        (n, k, group), (_, wt, qm, sz, ref_w) = next(iter(data.items()))
        xs = [torch.randn(200, k, device="cuda").to(torch.bfloat16) for _ in range(3)]
        xps = [permute_x(x) for x in xs]
        _run(split_t, xps[0], qm, wt.scales, wt.zeros, group, sz, counters)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = [_run(split_t, xp, qm, wt.scales, wt.zeros, group, sz, counters) for xp in xps]
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        err = max(rel(o, x.float() @ ref_w) for o, x in zip(outs, xs))
        ok = err < 1e-2 and not counters.any().item()
        fails += not ok
        rec["checks"].append({"launch": split_t.label(), "graph": True, "ok": ok, "what": f"rel err {err:.1e}"})
        print(f"  [{'ok' if ok else 'FAIL'}] {split_t.label()} in a CUDA graph, replayed: rel err {err:.1e}", flush=True)
    rec["failures"] = fails
    dump(rec, path)
    return fails


def passed_launches(out_dir: str) -> set | None:
    """INT4_WSA_PASSED_ONLY=1: the labels whose every self-test check in out_dir passed (a launch that
    failed anywhere, hung or never ran is not timed); None: no filter."""
    if os.environ.get("INT4_WSA_PASSED_ONLY") != "1":
        return None
    ok, bad = set(), set()
    for f in os.listdir(out_dir):
        if f.startswith("int4wsa-selftest-") and f.endswith(".json"):
            with open(os.path.join(out_dir, f)) as fh:
                for c in json.load(fh)["checks"]:
                    (ok if c["ok"] else bad).add(c["launch"])
    return ok - bad


def _bench_linear(rec, path, name, n, k, m, data, counters, deadline) -> None:
    from tokenmill.layers.quantization import triton_int4_mma as mma
    from tokenmill.layers.quantization.gluon_int4_swap_gemm import permute_x
    wt, qm, sz, ref_w, bf, q = data
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    xp = permute_x(x)
    ref = x.float() @ ref_w
    r = rec["us"].setdefault(f"m{m}/{name}", {})
    r["bf16"] = graph_us(lambda i: x @ bf[i].t(), len(bf))
    rec["errors"][f"m{m}/{name}/routed"] = rel(mma.mma_matmul(x, qm, wt.scales, wt.zeros, GROUP, counters), ref)
    r["routed"] = graph_us(lambda i: mma.mma_matmul(x, *q[i][:3], GROUP, counters), len(q))
    from tokenmill.layers.quantization import int4_kperm
    if int4_kperm.swap_route(m, n, k, GROUP, x.dtype):  # the engine's form: x written permuted by its producer
        rec["errors"][f"m{m}/{name}/routed kperm"] = rel(
            mma.mma_matmul(xp, qm, wt.scales, wt.zeros, GROUP, counters, x_kperm=True), ref)
        r["routed kperm"] = graph_us(lambda i: mma.mma_matmul(xp, *q[i][:3], GROUP, counters, x_kperm=True), len(q))
    for t in variants(m, name):
        if time.perf_counter() > deadline:
            break
        if rec["passed"] is not None and t.label() not in rec["passed"]:
            continue
        try:
            err = rel(_run(t, xp, qm, wt.scales, wt.zeros, GROUP, sz, counters), ref)
            rec["errors"][f"m{m}/{name}/{t.label()}"] = err
            if err > 1e-2 or counters.any().item():
                print(f"  [FAIL] m{m} {name} {t.label()}: rel err {err:.1e}", flush=True)
                continue
            r[t.label()] = graph_us(lambda i, t=t: _run(t, xp, q[i][0], q[i][1], q[i][2], GROUP, q[i][3], counters),
                                    len(q))
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            rec["errors"][f"m{m}/{name}/{t.label()}"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"  [FAIL] m{m} {name} {t.label()}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    ranked = sorted((v, lab) for lab, v in r.items())
    print(f"m{m} {name} {n}x{k}: " + "; ".join(f"{lab} {v:.1f}" for v, lab in ranked), flush=True)
    dump(rec, path)


def bench(out_dir: str, rows: list[int]) -> None:
    budget = float(os.environ.get("INT4_WSA_BUDGET_S", "80"))
    t_start = time.perf_counter()
    deadline = t_start + budget
    rec = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "us": {}, "errors": {}}
    path = os.path.join(out_dir, "int4wsa-bench.json")
    passed = passed_launches(out_dir)
    rec["passed"] = None if passed is None else sorted(passed)
    print(f"launches timed: {'all' if passed is None else sorted(passed)}", flush=True)
    counters = torch.zeros(8192, dtype=torch.int32, device="cuda")
    data = {name: prepare(n, k, GROUP) for name, (n, k) in LLAMA.items()}
    print(f"weights ready ({time.perf_counter() - t_start:.0f} s)", flush=True)
    for m in rows:
        for name, (n, k) in LLAMA.items():
            if time.perf_counter() > deadline:
                break
            _bench_linear(rec, path, name, n, k, m, data[name], counters, deadline)
    entries = []
    for m in rows:  # the layer: each linear's best wsa launch against bf16 and the routed path
        lay = {"bf16": 0.0, "routed": 0.0, "wsa best": 0.0, "best of routed / wsa": 0.0}
        for name, (n, k) in LLAMA.items():
            r = rec["us"].get(f"m{m}/{name}")
            if not r:
                lay = None
                break
            wsa = min(((v, lab) for lab, v in r.items() if lab.startswith("wsa ")), default=(float("inf"), ""))
            routed = min(r["routed"], r.get("routed kperm", float("inf")))
            lay["bf16"] += r["bf16"]
            lay["routed"] += routed
            lay["wsa best"] += wsa[0]
            lay["best of routed / wsa"] += min(wsa[0], routed)
            if wsa[0] < 0.97 * routed and m <= 1024:  # the table's row buckets stop at 1024
                entries.append(f"{m},{n},{k}={wsa[1]}")
        if lay:
            rec.setdefault("layer", {})[f"m{m}"] = lay
            print(f"layer m{m}: " + ", ".join(f"{key} {v:.1f}" for key, v in lay.items()), flush=True)
    rec["table"] = ";".join(entries)
    print(f"TOKENMILL_INT4_WSA_TABLE=\"{rec['table']}\"", flush=True)
    dump(rec, path)


def pick(out_dir: str, margin: float = 0.02) -> str:
    """The TOKENMILL_INT4_WSA_TABLE form of `int4_wsa_route.DEFAULT_TABLE` with each 256-row entry replaced
    by the fastest launch of OUT/int4wsa-bench.json where it beat the entry's own launch (timed in the same
    run) by `margin`; written to OUT/table.txt (an end to end run's table, before a commit)."""
    from tokenmill.layers.quantization.int4_wsa_route import DEFAULT_TABLE, table_from
    with open(os.path.join(out_dir, "int4wsa-bench.json")) as f:
        us = json.load(f)["us"]
    table = table_from(DEFAULT_TABLE)
    for (bucket, n, k), t in list(table.items()):
        r = next((v for key, v in us.items() for name, nk in LLAMA.items()
                  if key == f"m{bucket}/{name}" and nk == (n, k)), {})
        best = min(((v, lab) for lab, v in r.items() if lab.startswith("wsa ")), default=None)
        if best and t.label() in r and best[0] < (1 - margin) * r[t.label()]:
            table[(bucket, n, k)] = type(t).parse(best[1])
    text = ";".join(f"{b},{n},{k}={t.label()}" for (b, n, k), t in table.items())
    with open(os.path.join(out_dir, "table.txt"), "w") as f:
        f.write(text)
    return text


if __name__ == "__main__":
    if sys.argv[1] == "--pick":
        print(pick(sys.argv[2]))
        sys.exit(0)
    if sys.argv[1] == "--selftest":
        sys.exit(1 if selftest(sys.argv[2], sys.argv[3]) else 0)
    bench(sys.argv[2], [int(v) for v in (sys.argv[3] if len(sys.argv) > 3 else "256").split(",")])
