"""Bit for bit on a GPU: the INT4 Gluon GEMMs (swapped, wsa, stream-K, plain) of this tree against another tree's copies of their
modules, in one process (a clean-up that must not change a bit: session 12's ws retirement and shared
epilogue). The other tree's modules sit in a package OLD (default `int4old`, on PYTHONPATH; their imports of
each other rewritten to it, e.g. extra/int4old/ of a request). Per case: the same weights, x and launch
through both (this tree's through `triton_int4_mma.mma_matmul`'s route where the case says so: the route
must pick the same launch), `torch.equal` of the outputs, their error against a float32 reference, the
split-K / stream-K counters back to zero. A control case runs the two trees on different launches
(expected to differ: the comparison can tell). Shards run in parallel processes (the compiles).

    PYTHONPATH=extra:$PYTHONPATH python scripts/gpu_int4_bitab.py OUT [SHARD/SHARDS] [OLD]

Writes OUT/int4-bitab-SHARD.json; exit status 1 on any difference or failure (the control aside).
"""

from __future__ import annotations

import importlib
import os
import re
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_int4_bench import LLAMA, dump, rel, weights  # scripts/

GROUP = 128
NATURAL = ("swap", "gluon")  # the wrappers that take x in its natural order (the others: permuted)


def _cases():
    """(label, linear, rows, how: "route" / "route kperm" (this tree through mma_matmul, x natural or
    permuted) / "direct" (both wrappers called), kind: "wsa" / "sk" / "swap" / "gluon", launch label,
    control)."""
    from tokenmill.layers.quantization import int4_wsa_route as wsa
    from tokenmill.layers.quantization import triton_int4_dot_gemm as dot

    out = []
    for name, (n, k) in LLAMA.items():  # the routed 256-row launches, x natural and as the producers write it
        t = wsa.TABLE[(256, n, k)]
        out.append((f"{name} m256 route", name, 256, "route", "wsa", t.label(), False))
        out.append((f"{name} m200 route kperm", name, 200, "route kperm", "wsa", t.label(), False))
    for name in ("gate_up", "down"):  # prefill chunks (the raster launches)
        n, k = LLAMA[name]
        out.append((f"{name} m1100 route kperm", name, 1100, "route kperm", "wsa", wsa.PREFILL[(n, k)].label(), False))
    out.append(("qkv m256 stream-K", "qkv", 256, "direct", "sk", "wsa t128 g2 c1 st6 sk132", False))
    out.append(("down m256 depth 2", "down", 256, "direct", "wsa", "wsa t256 g2 c1 st4 s2 d2", False))
    for bucket, name in ((64, "down"), (128, "down"), (128, "qkv"), (64, "o")):  # the swapped GEMM's routes
        n, k = LLAMA[name]
        out.append((f"{name} m{bucket} swap route", name, bucket - 3, "route", "swap",
                    dot.TABLE[(bucket, n, k)].label(), False))
    out.append(("gate_up m256 swap t256", "gate_up", 256, "direct", "swap", dot.TABLE[(256, 28672, 4096)].label(), False))
    out.append(("o m64 gluon split-K", "o", 64, "direct", "gluon", "gluon m64 n128 st4 w4 s2", False))  # not routed
    out.append(("qkv m128 gluon", "qkv", 125, "direct", "gluon", "gluon m128 n128 st3 w4", False))
    out.append(("o m256 control: this tree t64 g2 st6, the other t256 g1 st4 s2", "o", 256, "direct", "wsa",
                "wsa t64 g2 c1 st6|wsa t256 g1 c1 st4 s2", True))
    return out


def _launch(mod_name: str, kind: str, label: str, x, qm, wt, sz, counters):
    from tokenmill.layers.quantization import triton_int4_dot_gemm as dot
    from tokenmill.layers.quantization.int4_wsa_route import WsaTiles

    if kind == "gluon":  # "gluon m64 n128 st4 w4 s2" (GluonTiles.label)
        mod = importlib.import_module(f"{mod_name}.gluon_int4_gemm")
        v = dict(re.findall(r"([a-z]+)(\d+)", label.removeprefix("gluon ")))
        t = dot.GluonTiles(int(v["m"]), int(v["n"]), int(v["st"]), int(v["w"]), int(v.get("s", 1)), int(v.get("k", 64)))
        assert t.label() == label, (t.label(), label)
        return mod.gluon_gemm(x, qm, wt.scales, wt.zeros, GROUP, t, sz=sz, counters=counters)
    if kind == "swap":
        mod = importlib.import_module(f"{mod_name}.gluon_int4_swap_gemm")
        return mod.swap_gemm(x, qm, wt.scales, wt.zeros, GROUP, dot.SwapTiles.parse(label), sz=sz, counters=counters)
    if kind == "sk":
        mod = importlib.import_module(f"{mod_name}.gluon_int4_wsa_streamk")
        return mod.wsa_streamk_gemm(x, qm, wt.scales, wt.zeros, GROUP, WsaTiles.parse(label), counters, sz=sz)
    mod = importlib.import_module(f"{mod_name}.gluon_int4_wsa_gemm")
    return mod.wsa_gemm(x, qm, wt.scales, wt.zeros, GROUP, WsaTiles.parse(label), sz=sz, counters=counters)


def run(out_dir: str, shard: str, old: str) -> int:
    from tokenmill.layers.quantization import triton_int4_mma as mma
    from tokenmill.layers.quantization.gluon_int4_swap_gemm import permute_x

    i, n_shards = (int(v) for v in shard.split("/"))
    cases = _cases()
    keys = list(dict.fromkeys(c[5] for c in cases))  # a launch's cases in one shard: one compile of each
    mine = [c for c in cases if keys.index(c[5]) % n_shards == i]
    rec = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "old": old, "cases": []}
    import triton
    rec["triton"] = triton.__version__
    path = os.path.join(out_dir, f"int4-bitab-{i}.json")
    data: dict = {}
    counters = {side: torch.zeros(8192, dtype=torch.int32, device="cuda") for side in ("new", "old")}
    fails = 0
    for label, name, m, how, kind, launch, control in mine:
        t0 = time.perf_counter()
        if name not in data:
            data[name] = weights(*LLAMA[name], GROUP)
        _, wt, qm, sz, ref_w = data[name]
        g = torch.Generator(device="cuda").manual_seed(m)
        x = torch.randn(m, qm.shape[1] * 64, device="cuda", generator=g).to(torch.bfloat16)
        ref = x.float() @ ref_w
        new_launch, _, old_launch = launch.partition("|")
        old_launch = old_launch or new_launch
        xp = permute_x(x)
        try:
            if how == "route":  # this tree's route on x natural; the other tree's kernel on what it reads
                new = mma.mma_matmul(x, qm, wt.scales, wt.zeros, GROUP, counters["new"])
            elif how == "route kperm":
                new = mma.mma_matmul(xp, qm, wt.scales, wt.zeros, GROUP, counters["new"], x_kperm=True)
            else:
                new = _launch("tokenmill.layers.quantization", kind, new_launch, x if kind in NATURAL else xp, qm, wt,
                              sz, counters["new"])
            got = _launch(old, kind, old_launch, x if kind in NATURAL else xp, qm, wt, sz, counters["old"])
            torch.cuda.synchronize()
            same = torch.equal(new, got)
            zeroed = not counters["new"].any().item() and not counters["old"].any().item()
            e_new, e_old = rel(new, ref), rel(got, ref)
            ok = (same != control) and zeroed and e_new < 1e-2 and e_old < 1e-2
            what = (f"{'bit-identical' if same else 'DIFFERENT (' + str((new != got).sum().item()) + ' elements)'}, "
                    f"rel err {e_new:.2e} / {e_old:.2e}, counters zero {zeroed}")
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            ok, same, what = False, False, f"{type(e).__name__}: {str(e)[:300]}"
        fails += not ok
        rec["cases"].append({"case": label, "launch": launch, "rows": m, "how": how, "control": control,
                             "identical": same, "ok": ok, "what": what, "s": round(time.perf_counter() - t0, 1)})
        print(f"  [{'ok' if ok else 'FAIL'}] {label} ({launch}): {what}", flush=True)
        dump(rec, path)
    rec["failures"] = fails
    dump(rec, path)
    return fails


if __name__ == "__main__":
    sys.exit(1 if run(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "0/1",
                      sys.argv[3] if len(sys.argv) > 3 else "int4old") else 0)
