"""Decode attention's PREWAIT and ROPE on the device (issue 22, batch 1): checks, then us per layer.

1. checks (eager, Llama-3.1-8B heads 32 / 8 x 128, bf16, block size 16, batch-1 decodes over 768 and
   2000 keys and a padding row, the default config's launches, which must read before their wait):
   - the default (split launches read their first tile before the PDL wait; the attention kernel
     rotates q and this step's k and writes k, v into the cache: ROPE) against `without_prewait`
     (the rotary + KV write kernel, then attention as before): the caches bit for bit, the
     outputs within bf16 rounding (8 warps against 4: another summation order);
   - in a CUDA graph behind a slow PDL writer of q / k / v (it lets its dependents start at
     once, spins, then writes; q / k / v NaN before each replay), for the default and for
     PREWAIT without ROPE: the graph's outputs equal the eager ones (nothing read before the wait
     that the writer writes); planted: the same attention launched with PDL but compiled without
     its wait must read NaN (the check can fail).
2. timing: 32 distinct layers' caches (768 keys each: 96 MB, past L2), each layer an RMSNorm, the INT4
   qkv GEMV (8 distinct weights, the engine's TABLE launch) then the attention step, in one graph: us
   per layer for main's path, PREWAIT, PREWAIT + ROPE, and 4-warp tiles of 64 keys in 16 shares with
   PREWAIT + ROPE (fewer registers: resident beside the GEMV's tail sooner).

    python scripts/gpu_attn_prewait.py OUT_DIR [--checks | --timing]      # on the GPU (~30 s each)
    TRITON_INTERPRET=1 python scripts/gpu_attn_prewait.py --smoke OUT_DIR   # CPU: part 1's eager checks, small
Writes OUT_DIR/attn_prewait_{both,checks,timing}.json; exit status 1 if a check failed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _case(contexts, heads, head_dim, block_size, device, seed=0, pad=1):
    """A single-token decode batch: cache with the contexts written, unrotated q / k / v of this step
    in one qkv buffer (views, as the model passes them), metadata, rotary step."""
    from tokenmill.config import RopeConfig
    from tokenmill.layers.attention.metadata import AttentionMetadata
    from tokenmill.layers.rotary import RotaryEmbedding, RotaryStep
    hq, hkv = heads
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + 1 for c in contexts]
    blocks = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks) + 4
    perm = torch.randperm(num_blocks, generator=g).tolist()
    width = max(blocks) + 1
    table = torch.zeros(len(contexts), width, dtype=torch.int32)
    cache = (torch.randn(2, num_blocks, block_size, hkv, head_dim, generator=g) * 2).to(torch.bfloat16)
    slots = []
    for i, s in enumerate(seq_lens):
        ids = [perm.pop() for _ in range(blocks[i])]
        table[i, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
        p = s - 1
        slots.append(ids[p // block_size] * block_size + p % block_size)
    t = len(contexts) + pad
    qkv = (torch.randn(t, (hq + 2 * hkv) * head_dim, generator=g) * 2).to(torch.bfloat16)
    qsl = torch.arange(len(contexts) + 1, dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    meta = AttentionMetadata(num_tokens=len(contexts), max_query_len=1, max_seq_len=max(seq_lens) + 16,
                             query_start_loc=qsl.to(device), seq_lens=lens.to(device), block_table=table.to(device),
                             slot_mapping=torch.tensor(slots + [-1] * pad).to(device), query_start_loc_cpu=qsl,
                             seq_lens_cpu=lens)
    rope = RotaryEmbedding(head_dim, 4096, RopeConfig(theta=500000.0))
    positions = torch.tensor(contexts + [0] * pad).to(device)
    step = RotaryStep(positions, rope.cos_cache.to(device), rope.sin_cache.to(device), head_dim)
    return cache.to(device), qkv.to(device), meta, step


def _views(qkv, heads, head_dim):
    hq, hkv = heads
    t = qkv.shape[0]
    return (qkv[:, :hq * head_dim].view(t, hq, head_dim), qkv[:, hq * head_dim:(hq + hkv) * head_dim].view(t, hkv, head_dim),
            qkv[:, (hq + hkv) * head_dim:].view(t, hkv, head_dim))


def _backend(heads, head_dim, config=None):
    from tokenmill.layers.attention.triton_backend import TritonAttentionBackend
    backend = TritonAttentionBackend(heads[0], heads[1], head_dim, head_dim ** -0.5, config=config)
    if not torch.cuda.is_available():
        backend._sm_count = 1024  # (the CPU's 1 would take the launch without PREWAIT)
    return backend


def checks(results: dict, check, device: str, smoke: bool) -> None:
    """Part 1 for batch-1 decodes over 768 and 2000 keys (one KV tile a split program), and 64 (smoke)."""
    for contexts in ([47], [70]) if smoke else ([767], [1999]):
        check_case(results, check, device, smoke, contexts)


def check_case(results: dict, check, device: str, smoke: bool, contexts: list[int]) -> None:
    from tokenmill.layers.attention import triton_backend as tb
    heads, head_dim = ((4, 2), 32) if smoke else ((32, 8), 128)
    cache0, qkv0, meta, step = _case(contexts, heads, head_dim, 16, device)
    default = tb.TritonAttentionConfig()
    if smoke:  # tiles the interpreter handles quickly
        tiles = tb.DecodeTiles(block_n=32, warps=8, stages=2, prewait=True)
        default = dataclasses.replace(default, split_decode_tiles=tiles, kv_splits=4)
    sms = _backend(heads, head_dim, default)._sm_count_of(torch.device(device))
    plan = tb.plan_launch(default, heads[0], heads[1], qkv0.shape[0], len(contexts), 1, meta.max_seq_len, sms)
    tag = f"{len(contexts)}x{contexts[0] + 1}"
    check(plan.prewait, f"{tag}: the default's launch reads before its wait ({plan.num_splits} splits, "
                        f"{plan.num_warps} warps)")
    variants = {"default": default, "prewait": dataclasses.replace(default, rope_in_attention=False),
                "main": tb.without_prewait(default)}
    outs, caches = {}, {}
    for name, config in variants.items():
        cache, qkv = cache0.clone(), qkv0.clone()
        q, k, v = _views(qkv, heads, head_dim)
        outs[name] = _backend(heads, head_dim, config).forward(q, k, v, cache, meta, rope=step)
        caches[name] = cache
    res = results.setdefault("checks", {}).setdefault(tag, {})
    for name in ("default", "prewait"):
        same_cache = torch.equal(caches[name].view(torch.int16), caches["main"].view(torch.int16))
        cache_err = ((caches[name].float() - caches["main"].float()).norm() / caches["main"].float().norm()).item()
        a, b = outs[name][:len(contexts)].float(), outs["main"][:len(contexts)].float()
        err = ((a - b).norm() / b.norm()).item()
        res[f"{name}_vs_main"] = {"cache_equal": same_cache, "cache_rel_err": cache_err, "rel_err": err}
        check(cache_err < 1e-3 and err < 2e-2 and not outs[name][len(contexts):].any(),
              f"{tag} eager {name} against main's path: cache bit for bit {same_cache} (rel err {cache_err:.1e}), "
              f"output rel err {err:.1e}, padding rows 0")
    from tokenmill.layers.attention import rope_selftest
    ok = rope_selftest.passed(_backend(heads, head_dim, default), cache0, qkv0.dtype, step)
    res["rope_selftest"] = ok
    check(ok, f"{tag} the engine's self-test of the rotary + KV write inside attention passes")
    if smoke:
        return
    for name in ("default", "prewait"):
        err = graph_race(heads, head_dim, cache0, qkv0, meta, step, variants[name], outs["main"], planted=False)
        res[f"{name}_graph_race"] = err
        check(err < 2e-2, f"{tag} graph behind a slow PDL writer of q / k / v, {name}: rel err {err:.1e}")
    err = graph_race(heads, head_dim, cache0, qkv0, meta, step, variants["default"], outs["main"], planted=True)
    res["planted_graph_race"] = err
    check(not err < 2e-2, f"{tag} planted (attention launched with PDL, compiled without its wait): rel err "
                          f"{err:.1e} (must fail)")


def graph_race(heads, head_dim, cache0, qkv0, meta, step, config, ref, planted: bool) -> float:
    """qkv NaN before each replay; in the graph the slow writer fills it, then the attention step."""
    from pdl_slow_writer import slow_write as write  # scripts/

    from tokenmill.layers.triton_ops import pdl
    backend = _backend(heads, head_dim, config)
    qkv = torch.empty_like(qkv0)
    q, k, v = _views(qkv, heads, head_dim)
    real = pdl.launch_kwargs

    def body(cache):
        write(qkv0, qkv)
        if planted:  # the attention kernel compiled without its wait (USE_PDL off inside), launched with PDL
            pdl.launch_kwargs = lambda device: {"USE_PDL": False, "launch_pdl": True}
        try:
            return backend.forward(q, k, v, cache, meta, rope=step)
        finally:
            pdl.launch_kwargs = real
    cache = cache0.clone()
    body(cache)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = body(cache)
    errs = []
    n = meta.num_tokens
    for _ in range(3):
        qkv.fill_(float("nan"))
        cache.copy_(cache0)
        graph.replay()
        torch.cuda.synchronize()
        a, b = out[:n].float(), ref[:n].float()
        errs.append(((a - b).norm() / b.norm()).nan_to_num(9.0).item())
    del graph
    return max(errs)


def _qkv_weights(count: int, device: str) -> list:
    """`count` distinct INT4 qkv weights of Llama-3.1-8B (6144 x 4096, group 128) in the mma layout, with
    their split-K counters: the GEMV before attention in a layer."""
    from tokenmill.layers.quantization import int4_packing as packing
    out = []
    for i in range(count):
        g = torch.Generator(device=device).manual_seed(i)
        codes = packing.quantize_int4(torch.randn(6144, 4096, device=device, generator=g), 128, sym=False)
        wt = packing.from_codes(codes, torch.bfloat16, act_order=False)
        out.append((packing.to_mma(wt.qweight), wt.scales, wt.zeros, torch.zeros(1024, dtype=torch.int32, device=device)))
    return out


def timing(results: dict, device: str) -> None:
    """Part 2 (module docstring): us per layer, each variant its own graph of 32 layers: an RMSNorm, the
    INT4 qkv GEMV (8 distinct weights, the engine's launch), the attention step."""
    from tokenmill.layers.attention import triton_backend as tb
    from tokenmill.layers.quantization import triton_int4_mma as mma
    from tokenmill.layers.triton_ops.rms_norm import rms_norm
    heads, head_dim, layers = (32, 8), 128, 32
    cache0, _, meta, step = _case([767], heads, head_dim, 16, device, pad=0)
    caches = [cache0.clone() for _ in range(layers)]  # 32 x 3 MB of keys and values read a step: past L2
    weights = _qkv_weights(8, device)  # 8 x 13 MB: past L2
    stream = torch.randn(1, 4096, device=device)
    weight = torch.ones(4096, device=device, dtype=torch.bfloat16)
    default = tb.TritonAttentionConfig()
    narrow = dataclasses.replace(default, min_keys_per_split=32,  # 16 shares of one 64-key tile at 768 keys
                                 split_decode_tiles=tb.DecodeTiles(block_n=64, warps=4, stages=2, prewait=True))
    variants = {"main": tb.without_prewait(default), "prewait_rope": default,
                "prewait": dataclasses.replace(default, rope_in_attention=False), "prewait_rope_64x4": narrow}
    figures = results.setdefault("us_per_layer", {})
    for name, config in variants.items():
        backend = _backend(heads, head_dim, config)

        def body(backend=backend):
            for i, c in enumerate(caches):
                x = rms_norm(stream, weight, 1e-5, torch.bfloat16)  # a PDL kernel, as the norm before qkv
                qm, sc, zr, counters = weights[i % len(weights)]
                qkv = mma.mma_gemv(x, qm, sc, zr, 128, counters=counters)
                q, k, v = _views(qkv, heads, head_dim)
                backend.forward(q, k, v, c, meta, rope=step)
        body()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            body()
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        best = math.inf
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(20):
                graph.replay()
            torch.cuda.synchronize()
            best = min(best, (time.perf_counter() - t0) / 20 / layers * 1e6)
        figures[name] = best
        print(f"  {name}: {best:.2f} us a layer (norm + INT4 qkv GEMV + attention step, 768 keys)", flush=True)
        del graph


def main() -> None:
    smoke = "--smoke" in sys.argv
    out = next(a for a in sys.argv[1:] if not a.startswith("--"))
    os.makedirs(out, exist_ok=True)
    device = "cpu" if smoke else "cuda"
    results: dict = {"device": torch.cuda.get_device_name() if not smoke else "cpu"}
    failures = []

    def check(ok: bool, what: str) -> None:
        print(f"  {'ok  ' if ok else 'FAIL'} {what}", flush=True)
        results.setdefault("check_lines", []).append(("ok " if ok else "FAIL ") + what)
        if not ok:
            failures.append(what)
    t0 = time.perf_counter()
    part = "timing" if "--timing" in sys.argv else "checks" if "--checks" in sys.argv else "both"
    try:
        if part != "timing":
            checks(results, check, device, smoke)
            print(f"  checks done at {time.perf_counter() - t0:.0f} s", flush=True)
        if not smoke and part != "checks":
            timing(results, device)
    finally:
        results["failures"] = failures
        with open(os.path.join(out, f"attn_prewait_{part}.json"), "w") as f:
            json.dump(results, f, indent=1)
    print(f"  done at {time.perf_counter() - t0:.0f} s, {len(failures)} failed", flush=True)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
