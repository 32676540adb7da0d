"""Triton attention backend on a CUDA GPU: correctness, timings, CUDA-graph replay.

    python scripts/triton_attention_check.py [--quick]

(a) Correctness against the torch reference backend, in bf16 and fp16, at three real model
    shapes, for mixed batches, decode batches and multi-token (speculative) decodes. Both
    backends are scored against the torch reference run in float32 on the same inputs; the
    Triton error must stay within max(2 x the torch backend's error, a small floor), padding
    rows must be zeros and the KV cache must match the torch backend's bit for bit.
(b) Timings (CUDA events around CUDA-graph replays; one layer's KV cache per captured call,
    enough "layers" that the KV read does not fit in L2): decode batches, a mixed batch and
    a prefill batch, with the torch backend (eager) beside them; then, unless --quick,
    small sweeps of the split count and tile sizes.
(c) The decode path captured once in a CUDA graph (max_query_len=1, max_seq_len=max_model_len)
    and replayed with new seq_lens, block tables, slots and a padded tail, against the torch
    backend each time.

Prints a table and one JSON line; writes $OUT/triton_attention_check.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tokenmill.benchmarks.graph_timing import graph_us  # noqa: E402
from tokenmill.layers.attention.backend import kv_cache_shape  # noqa: E402
from tokenmill.layers.attention.metadata import AttentionMetadata  # noqa: E402
from tokenmill.layers.attention.torch_ref import TorchRefAttentionBackend  # noqa: E402
from tokenmill.layers.attention.triton_backend import (  # noqa: E402
    DecodeTiles, TritonAttentionBackend, TritonAttentionConfig, plan_launch)

MODELS = {  # num_heads, num_kv_heads, head_dim
    "llama3.1-8b": (32, 8, 128),
    "smollm2-135m": (9, 3, 64),
    "llama3.2-1b": (32, 8, 64),
}
BLOCK_SIZE = 16
ERR_FLOOR = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3}
L2_DEFEAT_BYTES = 256 << 20  # KV read per timed replay, summed over "layers"
DEV = torch.device("cuda")


@dataclasses.dataclass
class Batch:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    kv_caches: list[torch.Tensor]  # one per "layer", same block layout
    meta: AttentionMetadata
    kv_bytes: int  # K+V bytes one layer's attention reads
    flops: float  # attention matmul flops of one layer


def make_batch(contexts: list[int], q_lens: list[int], heads: tuple[int, int, int], dtype: torch.dtype,
               pad_rows: int = 0, seed: int = 0, num_layers: int = 1) -> Batch:
    """Sequence i: `contexts[i]` cached tokens, then `q_lens[i]` new ones; fragmented block tables."""
    num_heads, num_kv_heads, head_dim = heads
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in zip(contexts, q_lens)]
    blocks = [-(-s // BLOCK_SIZE) for s in seq_lens]
    num_blocks = sum(blocks) + 4
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(seq_lens), max(blocks) + 1, dtype=torch.int32)
    slots, used = [], 0
    for i, (ctx, n) in enumerate(zip(contexts, q_lens)):
        table[i, :blocks[i]] = perm[used:used + blocks[i]]
        used += blocks[i]
        pos = torch.arange(ctx, ctx + n)
        slots.append(table[i, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE)
    slots.append(torch.full((pad_rows,), -1, dtype=torch.long))
    rows = sum(q_lens) + pad_rows
    torch.manual_seed(seed)
    q = torch.randn(rows, num_heads, head_dim, device=DEV).to(dtype)
    k = torch.randn(rows, num_kv_heads, head_dim, device=DEV).to(dtype)
    v = torch.randn(rows, num_kv_heads, head_dim, device=DEV).to(dtype)
    shape = kv_cache_shape(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    caches = [torch.randn(shape, device=DEV).to(dtype) for _ in range(num_layers)]
    qsl = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    meta = AttentionMetadata(
        num_tokens=sum(q_lens), max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        query_start_loc=qsl.to(DEV), seq_lens=lens.to(DEV), block_table=table.to(DEV),
        slot_mapping=torch.cat(slots).to(DEV), query_start_loc_cpu=qsl, seq_lens_cpu=lens)
    kv_bytes = sum(seq_lens) * num_kv_heads * head_dim * 2 * caches[0].element_size()
    flops = sum(4 * num_heads * head_dim * (n * c + n * (n + 1) / 2) for c, n in zip(contexts, q_lens))
    return Batch(q, k, v, caches, meta, kv_bytes, flops)


def layers_for(kv_bytes: int) -> int:
    return max(1, min(32, -(-L2_DEFEAT_BYTES // max(kv_bytes, 1))))


# ---------------------------------------------------------------- (a) correctness

def check(name: str, model: str, dtype: torch.dtype, contexts, q_lens, pad_rows: int = 3) -> dict:
    heads = MODELS[model]
    b = make_batch(contexts, q_lens, heads, dtype, pad_rows=pad_rows, seed=len(contexts))
    scale = heads[2] ** -0.5
    tri = TritonAttentionBackend(*heads, scale)
    ref = TorchRefAttentionBackend(*heads, scale)
    cache_t, cache_r, cache_f = b.kv_caches[0].clone(), b.kv_caches[0].clone(), b.kv_caches[0].float()
    out_t = tri.forward(b.q, b.k, b.v, cache_t, b.meta)
    out_r = ref.forward(b.q, b.k, b.v, cache_r, b.meta)
    out_f = ref.forward(b.q.float(), b.k.float(), b.v.float(), cache_f, b.meta)
    n = b.meta.num_tokens
    err_t = (out_t[:n].float() - out_f[:n]).abs().max().item()
    err_r = (out_r[:n].float() - out_f[:n]).abs().max().item()
    ok_err = err_t <= max(2 * err_r, ERR_FLOOR[dtype])
    ok_pad = not out_t[n:].any().item() and not out_t.isnan().any().item()
    ok_cache = torch.equal(cache_t, cache_r)
    return dict(case=name, model=model, dtype=str(dtype).split(".")[-1], err_triton=err_t, err_torch=err_r,
                ok=bool(ok_err and ok_pad and ok_cache), ok_err=ok_err, ok_pad=ok_pad, ok_cache=ok_cache)


def correctness() -> list[dict]:
    g = torch.Generator().manual_seed(1)
    rnd = lambda lo, hi, n: torch.randint(lo, hi, (n,), generator=g).tolist()  # noqa: E731
    mixed_ctx = [0, 1024, 0, 3000] + rnd(1, 4000, 24) + rnd(1, 3000, 8) + [200]
    mixed_q = [512, 256, 37, 100] + [1] * 24 + rnd(2, 9, 8) + [0]
    cases = {
        "mixed": (mixed_ctx, mixed_q),
        "decode": (rnd(1, 4096, 64), [1] * 64),
        "decode_b2_long": ([7000, 3100], [1, 1]),  # split-KV
        "spec_decode": (rnd(1, 4096, 16), rnd(2, 9, 16)),
    }
    results = []
    for model in MODELS:
        for dtype in (torch.bfloat16, torch.float16):
            for name, (ctx, ql) in cases.items():
                results.append(check(name, model, dtype, ctx, ql))
    return results


# ---------------------------------------------------------------- (b) timings

def time_graph(fn, iters: int = 20) -> float:
    """Microseconds per call of `fn`, captured once in a CUDA graph and replayed `iters` times."""
    return graph_us(fn, calls=1, replays=iters, warmup=3)


def time_eager(fn, iters: int = 5) -> float:
    for _ in range(2):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / iters


def all_layers(backend, b: Batch):
    def run():
        for cache in b.kv_caches:
            backend.forward(b.q, b.k, b.v, cache, b.meta)
    return run


def timed(name: str, contexts, q_lens, heads, dtype, config=None, with_torch: bool = True) -> dict:
    b0 = make_batch(contexts, q_lens, heads, dtype, num_layers=1)
    layers = layers_for(b0.kv_bytes)
    b = make_batch(contexts, q_lens, heads, dtype, num_layers=layers) if layers > 1 else b0
    scale = heads[2] ** -0.5
    tri = TritonAttentionBackend(*heads, scale, config=config)
    us = time_graph(all_layers(tri, b)) / layers
    sm_count = torch.cuda.get_device_properties(DEV).multi_processor_count
    plan = plan_launch(tri.config, heads[0], heads[1], b.q.shape[0], b.meta.seq_lens.shape[0],
                       b.meta.max_query_len, b.meta.max_seq_len, sm_count)
    row = dict(case=name, us=us, kv_gbps=b.kv_bytes / us / 1e3, tflops=b.flops / us / 1e6,
               splits=plan.num_splits, block_q=plan.block_q, layers=layers)
    if with_torch:
        ref = TorchRefAttentionBackend(*heads, scale)
        row["torch_us"] = time_eager(all_layers(ref, b)) / layers
    del b, b0
    torch.cuda.empty_cache()
    return row


def timings(quick: bool) -> list[dict]:
    heads, dtype = MODELS["llama3.1-8b"], torch.bfloat16
    rows = []
    for ctx in (512, 2048):
        for bs in (1, 8, 64, 256):
            rows.append(timed(f"decode b={bs} ctx={ctx}", [ctx - 1] * bs, [1] * bs, heads, dtype))
    rows.append(timed("decode b=1 ctx=8192", [8191], [1], heads, dtype))
    rows.append(timed("spec q=4 b=32 ctx=2048", [2044] * 32, [4] * 32, heads, dtype))
    rows.append(timed("mixed 2x1024@3072 + 64 dec@2048", [3072] * 2 + [2047] * 64, [1024] * 2 + [1] * 64,
                      heads, dtype))
    rows.append(timed("prefill 4x2048 fresh", [0] * 4, [2048] * 4, heads, dtype))
    if quick:
        return rows
    sweeps = []
    for bs, ctx in ((1, 8192), (1, 2048), (8, 2048)):
        for splits in (1, 2, 4, 8, 16, 32):
            sweeps.append((f"  sweep dec b={bs} ctx={ctx} splits={splits}", [ctx - 1] * bs, [1] * bs,
                           TritonAttentionConfig(kv_splits=splits)))
    for block_n in (32, 128):
        sweeps.append((f"  sweep dec b=64 ctx=2048 block_n={block_n}", [2047] * 64, [1] * 64,
                       TritonAttentionConfig(decode_tiles=DecodeTiles(block_n=block_n))))
    for wide_rows, warps, block_n, stages in ((64, 4, 64, 2), (64, 4, 128, 2), (128, 8, 128, 2), (128, 8, 64, 3)):
        sweeps.append((f"  sweep prefill rows={wide_rows} warps={warps} block_n={block_n} stages={stages}",
                       [0] * 4, [2048] * 4, TritonAttentionConfig(wide_rows=wide_rows, wide_warps=warps,
                                                                  block_n=block_n, num_stages=stages)))
    for name, contexts, q_lens, config in sweeps:
        try:
            rows.append(timed(name, contexts, q_lens, heads, dtype, config, with_torch=False))
        except Exception as e:  # a tile config the GPU cannot run (e.g. out of shared memory): report, go on
            rows.append(dict(case=name, error=repr(e)[:200]))
    return rows


# ---------------------------------------------------------------- (c) CUDA graph replay

def capture(fn):
    """`fn` captured in a CUDA graph: (replay, the captured call's output)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph.replay, out


def graph_replay(batch: int = 8, max_model_len: int = 4096, dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    heads = MODELS["llama3.1-8b"]
    num_heads, num_kv_heads, head_dim = heads
    width = max_model_len // BLOCK_SIZE
    num_blocks = batch * width + 4
    cache = torch.randn(kv_cache_shape(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim), device=DEV).to(dtype)
    q = torch.zeros(batch, num_heads, head_dim, device=DEV, dtype=dtype)
    k = torch.zeros(batch, num_kv_heads, head_dim, device=DEV, dtype=dtype)
    v = torch.zeros_like(k)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=DEV)
    seq_lens = torch.ones(batch, dtype=torch.int32, device=DEV)
    table = torch.zeros(batch, width, dtype=torch.int32, device=DEV)
    slots = torch.full((batch,), -1, dtype=torch.long, device=DEV)
    meta = AttentionMetadata(num_tokens=batch, max_query_len=1, max_seq_len=max_model_len,
                             query_start_loc=qsl, seq_lens=seq_lens, block_table=table, slot_mapping=slots,
                             query_start_loc_cpu=qsl.cpu(), seq_lens_cpu=seq_lens.cpu())
    scale = head_dim ** -0.5
    tri = TritonAttentionBackend(*heads, scale)
    gen = torch.Generator().manual_seed(7)

    def fill(real: int):
        """A new decode step of `real` sequences in the static buffers; returns its torch-backend inputs."""
        lens = torch.randint(1, max_model_len + 1, (real,), generator=gen)
        lens[0] = max_model_len
        perm = torch.randperm(num_blocks, generator=gen)[: real * width].view(real, width).int()
        pos = lens.long() - 1
        slot = perm[torch.arange(real), pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE
        q.copy_(torch.randn(q.shape).to(dtype))
        k.copy_(torch.randn(k.shape).to(dtype))
        v.copy_(torch.randn(v.shape).to(dtype))
        qsl.copy_(torch.tensor(list(range(real + 1)) + [real] * (batch - real), dtype=torch.int32))
        seq_lens.copy_(torch.cat([lens, torch.zeros(batch - real, dtype=torch.long)]).int())
        table.zero_()
        table[:real] = perm.to(DEV)
        slots.copy_(torch.cat([slot, torch.full((batch - real,), -1, dtype=torch.long)]))
        qsl_r = torch.arange(real + 1, dtype=torch.int32)
        return AttentionMetadata(num_tokens=real, max_query_len=1, max_seq_len=int(lens.max()),
                                 query_start_loc=qsl_r.to(DEV), seq_lens=lens.int().to(DEV),
                                 block_table=perm.to(DEV), slot_mapping=slot.to(DEV),
                                 query_start_loc_cpu=qsl_r, seq_lens_cpu=lens.int())

    fill(batch)
    tri.forward(q, k, v, cache, meta)  # compiles outside the capture
    torch.cuda.synchronize()
    replay, out = capture(lambda: tri.forward(q, k, v, cache, meta))
    results = []
    for step, real in enumerate((batch, batch, batch - 3, 1)):
        ref_meta = fill(real)
        ref_cache = cache.clone()
        replay()
        ref = TorchRefAttentionBackend(*heads, scale)
        expected = ref.forward(q[:real].clone(), k[:real].clone(), v[:real].clone(), ref_cache, ref_meta)
        torch.cuda.synchronize()
        err = (out[:real].float() - expected.float()).abs().max().item()
        ok = err <= ERR_FLOOR[dtype] and not out[real:].any().item() and torch.equal(cache, ref_cache)
        results.append(dict(case=f"graph replay {step} real={real}/{batch}", err=err, ok=bool(ok)))
    return results


# ---------------------------------------------------------------- main

def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="skip the tuning sweeps")
    args = parser.parse_args()
    import triton
    start = time.perf_counter()
    props = torch.cuda.get_device_properties(DEV)
    print(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, triton {triton.__version__}")
    report = {"device": props.name, "torch": torch.__version__, "triton": triton.__version__}

    report["correctness"] = correctness()  # the first run compiles most kernel variants here
    print(f"(correctness: {time.perf_counter() - start:.0f} s so far)")
    print(f"\n{'correctness':<16}{'model':<14}{'dtype':<10}{'err triton':>12}{'err torch':>12}  ok")
    for r in report["correctness"]:
        print(f"{r['case']:<16}{r['model']:<14}{r['dtype']:<10}{r['err_triton']:>12.2e}{r['err_torch']:>12.2e}  "
              f"{'ok' if r['ok'] else 'FAIL ' + str({k: r[k] for k in ('ok_err', 'ok_pad', 'ok_cache')})}")

    report["graph_replay"] = graph_replay()
    print()
    for r in report["graph_replay"]:
        print(f"{r['case']:<40} err {r['err']:.2e}  {'ok' if r['ok'] else 'FAIL'}")

    report["timings"] = timings(args.quick)
    print(f"(timings: {time.perf_counter() - start:.0f} s so far)")
    print("\nllama3.1-8b shape, bf16, block 16 (graph replay per layer; torch backend eager)")
    print(f"{'case':<58}{'us':>9}{'KV GB/s':>9}{'TFLOP/s':>9}{'splits':>7}{'torch us':>10}")
    for r in report["timings"]:
        if "error" in r:
            print(f"{r['case']:<58}  {r['error']}")
            continue
        torch_us = f"{r['torch_us']:>10.1f}" if "torch_us" in r else ""
        print(f"{r['case']:<58}{r['us']:>9.1f}{r['kv_gbps']:>9.0f}{r['tflops']:>9.1f}{r['splits']:>7}{torch_us}")

    report["all_ok"] = all(r["ok"] for r in report["correctness"] + report["graph_replay"])
    report["seconds"] = time.perf_counter() - start
    line = json.dumps(report)
    print("\n" + line)
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, "triton_attention_check.json"), "w") as f:
            f.write(line + "\n")
    print(f"\n{'ALL OK' if report['all_ok'] else 'FAILURES'} in {report['seconds']:.0f} s")
    return 0 if report["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
