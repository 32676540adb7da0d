"""Decode attention alone on a GPU: bf16 vs fp8 (e4m3) KV cache, against copy bandwidth, with a launch sweep.

    python scripts/gpu_attention.py [--budget S] [--shapes 256x640,1x16384] [--variants | --io-variants |
        --vt-variants] [--no-sweep] [--no-before] [--kv bf16,fp8] [--smoke]

Llama-3.1-8B's attention (32 query heads, 8 KV heads, head_dim 128, block size 16), at the decode
shapes that matter: 256 rows x context 128 / 640 / 2048, and 1 row x 16k. Each case goes through the
engine's own call path (`TritonAttentionBackend.forward`: the KV write, the attention launch, the
split reduce) with the metadata a decode CUDA graph is captured with (max_query_len=1,
max_seq_len=max_model_len), captured once in a CUDA graph and replayed, over fragmented block
tables. Enough "layers" (separate caches) are replayed per timing that the KV read exceeds L2.

Per case: microseconds per layer, KV bytes read / time, and that as a fraction of the copy
bandwidth measured here (a large device-to-device copy: read + write bytes / time). Every launch,
the default and each swept one, is checked against the torch reference backend run in float32
over what the cache holds (fp8 values times the scales): error within max(2 x the bf16 torch
backend's error, a floor). Then a sweep of the launch parameters (BLOCK_N, split count, warps,
stages), coordinate-wise from the backend's own choice, within a time budget, and the best per case.

--variants: first the named launches of VARIANTS per case (opt-in options and their combinations);
one that fails its check is listed (`variant_failures`) and printed, without failing the run.
--io-variants / --vt-variants: the same with VARIANTS_IO (load order) / VARIANTS_VT (fp8 values
transposed per block, 8 warps, fp8 wgmma). Each case also prints its byte bound (KV bytes at the
faster of the read roof, the copy rate and 3.0 TB/s) and the fraction of it reached.

Prints a table and writes $OUT/gpu_attention.json (default ./gpu-out). Exits 1 on a failed check
of the default launch, the earlier defaults or a swept launch.
--smoke: tiny shapes on the CPU under TRITON_INTERPRET=1 (fp32 and fp16 queries, fp16 and fp8 caches).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tokenmill.layers.attention.backend import kv_cache_shape, quantize_kv, transpose_v_blocks  # noqa: E402
from tokenmill.layers.attention.metadata import AttentionMetadata  # noqa: E402
from tokenmill.layers.attention.torch_ref import TorchRefAttentionBackend  # noqa: E402
from tokenmill.layers.attention.triton_backend import (  # noqa: E402
    DecodeTiles, TritonAttentionBackend, TritonAttentionConfig, decode_tiles_for, plan_launch)

LLAMA8B = (32, 8, 128)  # num_heads, num_kv_heads, head_dim
SMOKE_HEADS = (8, 2, 32)
BLOCK_SIZE = 16
MAX_MODEL_LEN = 16384 + 256 + 16  # what scripts/gpu_quant.py's engines use: decode graphs capture with it
# rows x context (keys each row sees); +N: and one fresh N-token prompt in the same step (not swept)
SHAPES = ["256x128", "256x2048", "255x640+512", "256x640", "1x16384"]
SMOKE_SHAPES = ["3x40", "1x150", "2x40+20"]
L2_DEFEAT_BYTES = 256 << 20
NOMINAL_BPS = 3.0e12  # H100 SXM HBM3, about what a large copy measures on an idle card (3.01 TB/s)
ERR_FLOOR = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3, torch.float32: 1e-4}
K_SCALE, V_SCALE = 0.5, 2.0  # fp8 cache scales (not 1.0, so a scale left out shows)
SWEEP = {  # coordinate-wise sweep axes, in this order (then the stages and split count once more)
    "interior": [False, True],  # False: every KV tile masked (the kernel before the unmasked walk)
    "fp8_qk_dot": [True, False],  # fp8 caches only: q . k as two fp8 dots, keys unconverted
    "num_stages": [1, 2, 3, 4],
    "block_n": [32, 64, 128, 16],
    "kv_splits": [1, 2, 4, 8, 16, 32, 64, 128],
    "decode_warps": [2, 4, 8],
    "lookup_blocks": [True, False],  # one block-table read per cache block in unmasked tiles
    "fp8_pv_dot": [True, False],  # fp8 caches only: p @ v as two fp8 dots, values unconverted
    "decode_min_rows": [64, 16],  # query rows of a decode tile (16: mma.sync; 64: Hopper's wgmma)
    "early_v_load": [True, False],  # each tile's V rows loaded with its K rows (twice the bytes in flight)
    "fp8_convert_on_load": [True, False],  # fp8 caches only: K/V to float16 where they load
    "table_prefetch": [True, False],  # block-table lookups one tile ahead in the unmasked walk
    "fp8_v_transposed": [True, False],  # fp8 caches only: value blocks stored [head, dim, slot]
}
FP8_ONLY = ("fp8_qk_dot", "fp8_pv_dot", "fp8_convert_on_load", "fp8_v_transposed")
# --variants: named launches tried per case (on top of the default plan), in order of interest,
# ahead of the coordinate-wise sweep. Keys: (case, "fp8" | "bf16").
_QKPV = {"fp8_qk_dot": True, "fp8_pv_dot": True}
# After the mid-session run of 2026-11-26 (docs/results/h200-attention-variants-mid.json): the fp8 dots
# pipelined through shared memory (stages >= 2) tied the default at 256 x 640; these follow that up.
# (Not here: register prefetch and CUDA-core products, 5-60x slower there and removed; fp8 dots with
# 64-row tiles and 2 stages, which gave NaN.)
_F8 = [{**_QKPV, "num_stages": 3, "decode_warps": 4}, {**_QKPV, "num_stages": 2, "decode_warps": 8},
       {**_QKPV, "num_stages": 3, "decode_warps": 4, "block_n": 64}, {"fp8_pv_dot": True, "num_stages": 2, "decode_warps": 4},
       {**_QKPV, "num_stages": 4, "decode_warps": 4}]
_F8_SPLIT = [{**_QKPV, "num_stages": 3}, {**_QKPV, "num_stages": 2}, {"num_stages": 3}, {"num_stages": 4, "block_n": 64}]
# Session of 2026-11-26 (fourth). Compiled offline for sm_90 (triton 3.9), every fp8 launch reads its V
# tile back from shared memory ONE BYTE PER LOAD (256 LDS.U8 per thread per 128-key tile): the compiler
# moves the fp8 -> float16 conversion after the layout change the p @ v dot needs, and an 8-bit tile
# cannot be transposed by ldmatrix. fp8_convert_on_load pins the conversion where the tile loads (no
# LDS.U8, ldmatrix.trans on float16, 222 registers and no spill at 2 warps against 255 + 272 bytes of
# stack). The sweeps before also say a decode program is bound by round trips at batch 1 (1 to 16
# shares: 375 -> 33 us; stages 1-4: 25.9-23.9 us): V loaded with K (early_v_load), the table looked
# up one tile ahead (table_prefetch), one stage (little shared memory) with more shares.
# The fp8 defaults now convert on load; "previous defaults" is the launch before (timed beside it).
_NOCVT, _EARLY, _PRE = {"fp8_convert_on_load": False}, {"early_v_load": True}, {"table_prefetch": True}
_EP = {**_EARLY, **_PRE}
_F8_IO = [{"decode_warps": 4}, _EP, {**_EP, "decode_warps": 4}, {"num_stages": 2, "decode_warps": 4},
          {"block_n": 64, "decode_warps": 4}, {**_NOCVT, **_EP}]
_F8_SPLIT_IO = [_EP, {"num_stages": 2}, {**_EP, "num_stages": 1}, {"kv_splits": 64},
                {**_EP, "num_stages": 1, "kv_splits": 64}, {**_NOCVT, **_EP}, {"num_stages": 3}]
VARIANTS_IO = {("1x16384", "fp8"): _F8_SPLIT_IO, ("256x640", "fp8"): _F8_IO, ("256x128", "fp8"): _F8_IO[:4],
               ("256x2048", "fp8"): _F8_IO[:4],
               ("1x16384", "bf16"): [_EP, {**_EP, "num_stages": 1, "kv_splits": 64}],
               ("256x640", "bf16"): [_EP],
               ("1x150", "bf16"): [_EP], ("1x150", "fp8"): [_EP, {**_NOCVT, **_EP}]}
# Session of 2026-11-26 (fifth). Offline sm_90 SASS of one 128-key fp8 tile (the loop body, per thread):
# converting on load moved BOTH tiles through shared memory twice; the keys need none of it (q . k takes
# K keys-major as it lies): CVT_VALUES (2) converts only the values on load, now the default (H100
# mid-session: 143.0 against 168.9 us at 256 x 640). With the values stored transposed per block
# (fp8_v_transposed) neither tile makes a float16 round trip; the mid-session launches of it spilled in
# triton 3.6 (170-779 us): its V tile is now loaded [keys, dim] keys-contiguous, no tl.trans (3.6: 206
# registers, no stack). These time it beside the defaults (docs/results/gpu-kvfp8.md has the mid run's).
_VT = {"fp8_v_transposed": True}
# No conversion at all: with values transposed both dots take their fp8 operand K-major, as Hopper's fp8
# wgmma wants (64-row tiles: 16x the rows a decode needs; q and p as two e4m3 terms each). 8 warps and
# 64-key tiles (triton 3.6: 222 registers, no spill).
_WG = {**_VT, **_QKPV, "decode_min_rows": 64, "decode_warps": 8, "block_n": 64}
_F8_VT = [_VT, {"decode_warps": 8}, _WG]  # (8 warps with the values-only conversion: 114 registers)
# (Few: gpu_kvfp8's final run times these beside the defaults within its budget; the wgmma one last.)
VARIANTS_VT = {("1x16384", "fp8"): [_VT], ("256x640", "fp8"): _F8_VT,
               ("256x2048", "fp8"): [_VT], ("256x128", "fp8"): [_VT],
               ("255x640+512", "fp8"): [_VT],  # the prefill tiles over transposed values (a mixed step)
               ("3x40", "fp8"): [_VT, {"fp8_convert_on_load": True}, _WG], ("1x150", "fp8"): [_VT],
               ("2x40+20", "fp8"): [_VT]}  # (smoke: the code paths; the interpreter mis-rounds fp8 dots)
# Session of 2026-11-27 (issue 22, fp8kv 256x256x128): the engine's 256-row decode steps see 256-384 keys, where
# the fp8 tiles read at ~1.8 TB/s (bf16's 2.5); a decode graph cannot tell 320 keys from 640 (1000x512x256's), so
# a launch must win at 256x320 without losing at 256x640 (--short-variants; both shapes).
_SHORT = [{"num_stages": 3}, {"num_stages": 1}, {"block_n": 64}, {"block_n": 64, "num_stages": 3},
          {"block_n": 64, "num_stages": 4}, {"decode_warps": 8}, {"early_v_load": True, "table_prefetch": True},
          {"block_n": 256, "num_stages": 1}]
VARIANTS_SHORT = {("256x320", "fp8"): _SHORT, ("256x640", "fp8"): _SHORT}
VARIANTS = {("1x16384", "fp8"): _F8_SPLIT, ("256x640", "fp8"): _F8, ("256x128", "fp8"): _F8[:2],
            ("256x128", "bf16"): [{"block_n": 64}, {"num_stages": 1}],
            # --smoke: the code paths (fp8 rounding is off under the interpreter: the fp8 dots are not checked)
            ("1x150", "bf16"): [{"decode_min_rows": 64, "block_n": 16}],
            ("1x150", "fp8"): [{"decode_min_rows": 64, "num_stages": 2}]}
# The decode defaults before this session's work (2026-11-26, fifth): fp8 unsplit converting K and V on
# load (4 warps, 2 stages), split 4 warps / 4 stages; values stored as keys are (not transposed).
PREVIOUS_DEFAULTS = TritonAttentionConfig(
    decode_tiles=DecodeTiles(128, 4, 2), split_decode_tiles=None,
    fp8_decode_tiles=DecodeTiles(128, 4, 2, fp8_convert_on_load=True), fp8_split_decode_tiles=DecodeTiles(128, 4, 4),
    lookup_blocks=False, fp8_qk_dot=False, fp8_pv_dot=False, fp8_v_transposed=False)
MANY_ROWS_SPLITS = [1, 2, 4]  # split counts tried where rows x KV heads already fill the SMs
# Shares of the sweep budget: the engine's figures' shapes (others are timed, not swept, unless --sweep-all).
WEIGHT = {"256x640": 1, "1x16384": 1}


@dataclasses.dataclass
class Case:
    name: str
    kv_dtype: torch.dtype
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    caches: list[torch.Tensor]  # one per "layer", same block tables
    meta: AttentionMetadata  # as a decode graph captures it
    kv_bytes: int  # K+V bytes one layer's attention reads
    caches_vt: list[torch.Tensor] | None = None  # the same caches with value blocks transposed (made once)


def caches_for(backend, case: Case) -> list[torch.Tensor]:
    """The case's caches in the layout `backend` reads and writes (fp8_v_transposed: values transposed)."""
    if not backend.v_transposed(case.caches[0]):
        return case.caches
    if case.caches_vt is None:
        case.caches_vt = [transpose_v_blocks(c) for c in case.caches]
    return case.caches_vt


def make_case(rows: int, context: int, heads, q_dtype, kv_dtype, dev, max_model_len: int, seed: int = 0,
              prefill: int = 0, q_len: int = 1) -> Case:
    """`rows` decodes, each seeing `context` keys (context - 1 cached, then the new one); shuffled blocks.
    `prefill` > 0: one more sequence, a fresh prompt of that many tokens (a mixed step, as when the
    scheduler admits a request among running decodes: not graph-captured, actual bounds).
    `q_len` > 1: each decode row is that many tokens over `context` cached keys (speculative
    verification: multi-token decode tiles)."""
    num_heads, num_kv_heads, head_dim = heads
    gen = torch.Generator().manual_seed(seed)
    contexts = [context] * rows + ([0] * (prefill > 0))
    q_lens = [q_len] * rows + ([prefill] * (prefill > 0))
    seq_lens = [c + n - 1 if n == 1 else c + n for c, n in zip(contexts, q_lens)]  # decodes: context keys
    blocks = [-(-n // BLOCK_SIZE) for n in seq_lens]
    num_blocks = sum(blocks) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(seq_lens), max(blocks) + 1, dtype=torch.int32)  # a spare column, as the engine's
    slots, used = [], 0
    for i, (n_keys, n_q) in enumerate(zip(seq_lens, q_lens)):
        table[i, :blocks[i]] = perm[used:used + blocks[i]]
        used += blocks[i]
        pos = torch.arange(n_keys - n_q, n_keys)
        slots.append(table[i, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE)
    num_q = sum(q_lens)
    torch.manual_seed(seed)
    q = torch.randn(num_q, num_heads, head_dim, device=dev).to(q_dtype)
    k = torch.randn(num_q, num_kv_heads, head_dim, device=dev).to(q_dtype)
    v = torch.randn(num_q, num_kv_heads, head_dim, device=dev).to(q_dtype)
    fp8 = kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    if fp8:  # the step's K/V already fp8 values times the scales (the interpreter's fp8 rounding is off)
        k = (quantize_kv(k, K_SCALE, kv_dtype).float() * K_SCALE).to(q_dtype)
        v = (quantize_kv(v, V_SCALE, kv_dtype).float() * V_SCALE).to(q_dtype)
    shape = kv_cache_shape(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    elt = torch.empty((), dtype=kv_dtype).element_size()
    layer_bytes = sum(seq_lens) * num_kv_heads * head_dim * 2 * elt  # each key once
    layers = 1 if dev.type != "cuda" else max(1, min(16, -(-L2_DEFEAT_BYTES // layer_bytes)))
    caches = []
    for _ in range(layers):
        c = torch.randn(shape, device=dev)
        if fp8:
            c = torch.stack([quantize_kv(c[0], K_SCALE, kv_dtype), quantize_kv(c[1], V_SCALE, kv_dtype)])
        caches.append(c.to(kv_dtype))
    qsl = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    meta = AttentionMetadata(
        num_tokens=num_q, max_query_len=max(q_lens), max_seq_len=max_model_len if not prefill else max(seq_lens),
        query_start_loc=qsl.to(dev), seq_lens=lens.to(dev), block_table=table.to(dev),
        slot_mapping=torch.cat(slots).to(dev), query_start_loc_cpu=qsl, seq_lens_cpu=lens)
    name = f"{rows}x{context}" + (f"q{q_len}" if q_len > 1 else "") + (f"+{prefill}" if prefill else "")
    return Case(name, kv_dtype, q, k, v, caches, meta, layer_bytes)


def make_backend(heads, kv_dtype, config: TritonAttentionConfig | None = None) -> TritonAttentionBackend:
    backend = TritonAttentionBackend(*heads, heads[2] ** -0.5, config=config)
    if kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        backend.k_scale, backend.v_scale = K_SCALE, V_SCALE
    return backend


# ---------------------------------------------------------------- checks

def reference(case: Case, heads) -> tuple[torch.Tensor, float]:
    """float32 attention over what layer 0's cache holds, and the bf16/fp16 torch backend's error."""
    cache = case.caches[0]
    fp8 = cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    ks, vs = (K_SCALE, V_SCALE) if fp8 else (1.0, 1.0)
    k, v = case.k, case.v
    if fp8:  # the step's K/V as the cache will hold them
        k = quantize_kv(k, ks, cache.dtype).to(k.dtype) * ks
        v = quantize_kv(v, vs, cache.dtype).to(v.dtype) * vs
    f32 = torch.stack([cache[0].float() * ks, cache[1].float() * vs])
    ref = TorchRefAttentionBackend(*heads, heads[2] ** -0.5)
    expected = ref.forward(case.q.float(), k.float(), v.float(), f32, case.meta)
    del f32
    low = TorchRefAttentionBackend(*heads, heads[2] ** -0.5)
    low_cache = torch.stack([cache[0].to(case.q.dtype) * ks, cache[1].to(case.q.dtype) * vs])
    err_low = (low.forward(case.q, k, v, low_cache, case.meta).float() - expected).abs().max().item()
    return expected, err_low


def check(backend, case: Case, expected: torch.Tensor, err_low: float) -> tuple[bool, float]:
    out = backend.forward(case.q, case.k, case.v, caches_for(backend, case)[0], case.meta)
    err = (out.float() - expected).abs().max().item()
    ok = bool(err <= max(2 * err_low, ERR_FLOOR[case.q.dtype])) and not out.isnan().any().item()
    return ok, err


# ---------------------------------------------------------------- timings

def time_us(fn, dev, iters: int = 10) -> float:
    """Microseconds per call: CUDA graph replays on a GPU, wall clock (one call) on the CPU."""
    if dev.type != "cuda":
        fn()
        start = time.perf_counter()
        fn()
        return 1e6 * (time.perf_counter() - start)
    from triton_attention_check import time_graph  # the graph capture and replay timing, shared

    return time_graph(fn, iters)


def copy_bandwidth(dev) -> float:
    """Bytes per second of a large device copy (read + write)."""
    n = (2 << 30) if dev.type == "cuda" else (16 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    us = time_us(lambda: dst.copy_(src), dev, iters=10)
    del src, dst
    return 2 * n / (us * 1e-6)


def time_parts(backend, case: Case, dev, plan: dict) -> dict:
    """Microseconds per layer of the K/V write alone and of the attention (+ split reduce) alone."""
    from tokenmill.layers.attention import triton_kv_write, triton_paged_attention

    m = case.meta

    def write():
        for cache in case.caches:
            triton_kv_write.write_kv(case.k, case.v, cache, m.slot_mapping, backend.k_scale, backend.v_scale)

    def attend():
        for cache in case.caches:
            triton_paged_attention.paged_attention(
                case.q, cache, m.query_start_loc, m.seq_lens, m.block_table, backend.scale, backend.num_kv_heads,
                block_q=plan["block_q"], block_n=plan["block_n"], num_splits=plan["kv_splits"],
                max_splits=1 << max(plan["kv_splits"] - 1, 0).bit_length(), num_warps=plan["decode_warps"],
                num_stages=plan["num_stages"], interior=plan["interior"], lookup_blocks=plan["lookup_blocks"],
                fp8_qk_dot=plan["fp8_qk_dot"], fp8_pv_dot=plan["fp8_pv_dot"], early_v_load=plan["early_v_load"],
                fp8_convert_on_load=plan["fp8_convert_on_load"], table_prefetch=plan["table_prefetch"],
                k_scale=backend.k_scale, v_scale=backend.v_scale)
    n = len(case.caches)
    return {"write_us": time_us(write, dev) / n, "attend_us": time_us(attend, dev) / n}


def read_bandwidth(dev) -> float:
    """Bytes per second of a large read-only pass (a max over 2 GiB of bf16; attention reads and
    barely writes, so this is its roof; a copy also writes)."""
    n = (1 << 30) if dev.type == "cuda" else (8 << 20)
    src = torch.ones(n, dtype=torch.bfloat16, device=dev)
    us = time_us(lambda: src.amax(), dev, iters=10)
    del src
    return 2 * n / (us * 1e-6)


def time_layers(backend, case: Case, dev) -> float:
    caches = caches_for(backend, case)

    def run():
        for cache in caches:
            backend.forward(case.q, case.k, case.v, cache, case.meta)
    return time_us(run, dev) / len(case.caches)


# ---------------------------------------------------------------- one case: default launch + sweep

def launch_config(cand: dict) -> TritonAttentionConfig:
    """The backend's config that makes a decode launch `cand`, over either cache dtype."""
    tiles = DecodeTiles(block_n=cand["block_n"], warps=cand["decode_warps"], stages=cand["num_stages"],
                        min_rows=cand.get("decode_min_rows", 16), early_v_load=cand.get("early_v_load", False),
                        table_prefetch=cand.get("table_prefetch", False),
                        fp8_convert_on_load=cand.get("fp8_convert_on_load", False))
    return TritonAttentionConfig(
        interior=cand["interior"], lookup_blocks=cand["lookup_blocks"], fp8_qk_dot=cand["fp8_qk_dot"],
        fp8_pv_dot=cand.get("fp8_pv_dot", False), kv_splits=cand["kv_splits"],
        early_v_load=cand.get("early_v_load", False), fp8_convert_on_load=cand.get("fp8_convert_on_load", False),
        table_prefetch=cand.get("table_prefetch", False), fp8_v_transposed=cand.get("fp8_v_transposed", False),
        decode_tiles=tiles,
        split_decode_tiles=tiles, fp8_decode_tiles=tiles, fp8_split_decode_tiles=tiles)


def before_launch(case: Case, heads, sm_count: int) -> dict:
    """The launch the backend made before this work: every tile masked, BLOCK_N 64, 4 warps, 2 stages,
    and its split rule (two waves of SMs, shares of at least 256 keys, at most 32)."""
    programs = case.meta.seq_lens.shape[0] * heads[1]
    splits = 1 if programs >= 2 * sm_count else max(1, min(-(-2 * sm_count // programs),
                                                             max(case.meta.max_seq_len // 256, 1), 32))
    return {"interior": False, "num_stages": 2, "block_n": 64, "kv_splits": splits, "decode_warps": 4,
            "lookup_blocks": False, "fp8_qk_dot": False, "fp8_pv_dot": False, "decode_min_rows": 16,
            "early_v_load": False, "fp8_convert_on_load": False, "table_prefetch": False, "fp8_v_transposed": False}


def plan_of(backend, case: Case, sm_count: int) -> dict:
    heads = (backend.num_heads, backend.num_kv_heads)
    fp8 = case.kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    p = plan_launch(backend.config, *heads, case.q.shape[0], case.meta.seq_lens.shape[0], case.meta.max_query_len,
                    case.meta.max_seq_len, sm_count, fp8)
    return {"interior": backend.config.interior, "lookup_blocks": backend.config.lookup_blocks,
            "fp8_qk_dot": backend.config.fp8_qk_dot, "fp8_pv_dot": backend.config.fp8_pv_dot,
            "early_v_load": p.early_v_load, "fp8_convert_on_load": p.fp8_convert_on_load, "table_prefetch": p.table_prefetch,
            "decode_min_rows": decode_tiles_for(backend.config, fp8, p.num_splits > 1).min_rows,
            "fp8_v_transposed": backend.config.fp8_v_transposed,
            "kv_splits": p.num_splits, "block_n": p.block_n, "decode_warps": p.num_warps,
            "num_stages": p.num_stages, "block_q": p.block_q}


def check_fused_fp8_write(dev) -> dict:
    """The fused rotary + KV write into an fp8 cache against `rotate_` then `write_kv` (on the device: its
    own fp8 rounding and saturation), bit for bit, Llama-8B heads, 64 tokens at scattered slots."""
    from tokenmill.config import RopeConfig
    from tokenmill.layers.attention.triton_kv_write import write_kv
    from tokenmill.layers.attention.triton_rope_kv_write import rotate_and_write_kv
    from tokenmill.layers.rotary import RotaryEmbedding
    from tokenmill.layers.triton_ops.rotary import rotate_

    hq, hkv, d = LLAMA8B if dev.type == "cuda" else SMOKE_HEADS
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float16
    t = 64
    rope = RotaryEmbedding(d, 4096, RopeConfig(theta=500000.0)).to(dev)
    gen = torch.Generator().manual_seed(5)
    qkv = (torch.randn(t, (hq + 2 * hkv) * d, generator=gen) * 200).to(dtype).to(dev)
    positions = torch.randint(0, 4096, (t,), generator=gen).to(dev)
    slots = torch.randperm(8 * BLOCK_SIZE * 16, generator=gen)[:t].to(dev)
    slots[3] = -1
    rec = {"check": "fused rotary + fp8 KV write", "ok": True}
    for kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        cache = torch.zeros(kv_cache_shape(8 * 16, BLOCK_SIZE, hkv, d), device=dev).to(kv_dtype)
        ks, vs = 448.0 / torch.finfo(kv_dtype).max, 600.0 / torch.finfo(kv_dtype).max  # some values saturate
        ref_qkv, ref_cache = qkv.clone(), cache.clone()
        qk = ref_qkv[:, :(hq + hkv) * d].view(t, hq + hkv, d)
        rotate_(qk, None, positions, rope.cos_cache, rope.sin_cache, d)
        write_kv(qk[:, hq:], ref_qkv[:, (hq + hkv) * d:].view(t, hkv, d), ref_cache, slots, ks, vs)
        f_qkv = qkv.clone()
        qk = f_qkv[:, :(hq + hkv) * d].view(t, hq + hkv, d)
        rotate_and_write_kv(qk[:, :hq], qk[:, hq:], f_qkv[:, (hq + hkv) * d:].view(t, hkv, d), positions,
                            rope.cos_cache, rope.sin_cache, d, cache, slots, ks, vs)
        same = bool(torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8)))
        same_q = bool(torch.equal(f_qkv[:, :hq * d], ref_qkv[:, :hq * d]))
        rec[str(kv_dtype).split(".")[-1]] = {"cache_equal": same, "q_equal": same_q}
        rec["ok"] = rec["ok"] and same and same_q
    print(f"  {rec}", flush=True)
    return rec


def run_case(case: Case, heads, dev, copy_bps: float, deadline: float, sweep: dict, sm_count: int,
             read_bps: float, variants: dict | None = None, with_before: bool = True) -> dict:
    expected, err_low = reference(case, heads)
    base = make_backend(heads, case.kv_dtype)
    ok, err = check(base, case, expected, err_low)
    us = time_layers(base, case, dev)
    plan = plan_of(base, case, sm_count)
    parts = time_parts(base, case, dev, plan)
    rec = {**parts, "case": case.name, "kv": str(case.kv_dtype).split(".")[-1], "us": us, "ok": ok, "err": err,
           "err_torch_low": err_low, "kv_bytes": case.kv_bytes, "gbps": case.kv_bytes / us / 1e3,
           "of_copy": case.kv_bytes / (us * 1e-6) / copy_bps, "of_read": case.kv_bytes / (us * 1e-6) / read_bps,
           "plan": plan, "layers": len(case.caches),
           # The byte bound: the KV bytes at the faster of the two rates measured here (a read-only pass,
           # or a copy's read + write bytes), else the H100's nominal 3.0 TB/s if both measure below it.
           "bound_us": case.kv_bytes / max(read_bps, copy_bps, NOMINAL_BPS if dev.type == "cuda" else 0) * 1e6}
    print(f"  {case.name:>9} {rec['kv']:>13}: {us:8.1f} us/layer  {rec['gbps']:7.0f} GB/s "
          f"({100 * rec['of_copy']:5.1f}% of copy; write {parts['write_us']:.1f}, attention "
          f"{parts['attend_us']:.1f})  err {err:.2e} {'ok' if ok else 'FAILED'}  {plan}", flush=True)

    tried = {}  # (kv_splits, block_n, decode_warps, num_stages) -> us
    key_of = lambda p: tuple(p[k] for k in SWEEP)  # noqa: E731
    best = {k: plan[k] for k in SWEEP}
    tried[key_of(best)] = us
    failures = []
    if case.meta.max_query_len == 1 and with_before:  # the launch before this work, for the speed-up
        before = before_launch(case, heads, sm_count)
        if key_of(before) not in tried:
            b_ok, b_err = check(make_backend(heads, case.kv_dtype, launch_config(before)), case, expected, err_low)
            tried[key_of(before)] = time_layers(make_backend(heads, case.kv_dtype, launch_config(before)), case, dev)
            if not b_ok:
                failures.append({"launch": before, "err": b_err})
        rec.update(before=before, before_us=tried[key_of(before)], speedup_vs_before=tried[key_of(before)] / us)
        print(f"    before this work {before}: {tried[key_of(before)]:.1f} us (now {rec['speedup_vs_before']:.2f}x "
              f"faster)", flush=True)
    if case.meta.max_query_len <= 8:  # decode launches: the defaults before this session's work, same run
        prev = {k: v for k, v in plan_of(make_backend(heads, case.kv_dtype, PREVIOUS_DEFAULTS), case, sm_count).items()
                if k in SWEEP}
        if case.meta.max_query_len > 1:  # multi-token decode tiles took only the config-wide conversion (off)
            prev["fp8_convert_on_load"] = False
        if key_of(prev) not in tried:
            p_backend = make_backend(heads, case.kv_dtype, launch_config(prev))
            p_ok, p_err = check(p_backend, case, expected, err_low)
            tried[key_of(prev)] = time_layers(p_backend, case, dev)
            if not p_ok:
                failures.append({"launch": prev, "err": p_err})
        rec.update(previous=prev, previous_us=tried[key_of(prev)], speedup_vs_previous=tried[key_of(prev)] / us)
        print(f"    previous defaults {prev}: {tried[key_of(prev)]:.1f} us (now {rec['speedup_vs_previous']:.2f}x "
              f"faster)", flush=True)
    # The swept parameters are the decode launch's: a mixed step's (prefill tiles) is not swept.
    many_rows = case.q.shape[0] * heads[1] >= 2 * sm_count
    # Few rows: the split count first (a runtime argument: no recompiles).
    order = list(SWEEP) + ["num_stages", "kv_splits"] if many_rows else ["kv_splits"] + list(SWEEP)
    variant_failures = []  # opt-in launches (--variants) that fail the check: findings, not the defaults' failures

    def attempt(cand: dict, failed: list) -> None:
        nonlocal best
        if key_of(cand) in tried:
            return
        backend = make_backend(heads, case.kv_dtype, launch_config(cand))
        try:
            c_ok, c_err = check(backend, case, expected, err_low)
            c_us = time_layers(backend, case, dev)
        except Exception as e:  # noqa: BLE001 - out of resources etc.: note it and go on
            print(f"    {cand}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            tried[key_of(cand)] = float("inf")
            return
        tried[key_of(cand)] = c_us
        if not c_ok:
            failed.append({"launch": cand, "err": c_err})
            print(f"    {cand}: CHECK FAILED err {c_err:.2e}{' (an opt-in variant)' if failed is variant_failures else ''}",
                  flush=True)
            return
        changed = {k: v for k, v in cand.items() if plan.get(k) != v}
        print(f"    {changed}: {c_us:.1f} us ({us / c_us:.2f}x the default)  err {c_err:.2e}", flush=True)
        if c_us < tried[key_of(best)]:
            best = cand

    fp8_kind = "fp8" if case.kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else "bf16"
    # (A mixed step's launch takes prefill tiles: its entries change only the cache-wide options.)
    for override in (variants or {}).get((case.name, fp8_kind), []):
        if time.perf_counter() > deadline:
            rec["sweep_cut"] = True
            break
        attempt(dict({k: plan[k] for k in SWEEP}, **override), variant_failures)
    for axis in order if case.meta.max_query_len == 1 else []:
        values = sweep[axis]
        if axis in FP8_ONLY and case.kv_dtype != torch.float8_e4m3fn:
            continue
        if axis == "kv_splits" and many_rows:
            values = [v for v in values if v in MANY_ROWS_SPLITS]
        for value in values:
            if time.perf_counter() > deadline:
                rec["sweep_cut"] = True
                break
            attempt(dict(best, **{axis: value}), failures)
    best_us = tried[key_of(best)]
    rec.update(best=best, best_us=best_us, best_gbps=case.kv_bytes / best_us / 1e3,
               best_of_copy=case.kv_bytes / (best_us * 1e-6) / copy_bps,
               best_of_read=case.kv_bytes / (best_us * 1e-6) / read_bps, speedup=us / best_us,
               sweep=[{**dict(zip(SWEEP, k)), "us": v} for k, v in tried.items()], sweep_failures=failures,
               variant_failures=variant_failures)
    rec["ok"] = ok and not failures
    print(f"    best {best}: {best_us:.1f} us ({100 * rec['best_of_copy']:.1f}% of copy, "
          f"{rec['speedup']:.2f}x the default; {len(tried)} launches tried)", flush=True)
    return rec


def save(records: list[dict], device: str, sm_count: int, copy_bps: float, read_bps: float, start: float) -> bool:
    """Writes $OUT/gpu_attention.json; returns whether every check so far passed."""
    ok = all(r["ok"] for r in records)
    out_dir = os.environ.get("OUT", "./gpu-out")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "gpu_attention.json"), "w") as f:
        json.dump({"device": device, "sm_count": sm_count, "copy_gbps": copy_bps / 1e9, "read_gbps": read_bps / 1e9,
                   "ok": ok,
                   "elapsed_s": time.perf_counter() - start, "records": records}, f, indent=1)
    return ok


def _precompile_calls(shapes: list[str], kinds: list[str], table: dict | None, sm_count: int,
                      dev: torch.device = torch.device("cuda")) -> list:
    """One small call per launch a run will time (each case's default and its variants), with the
    constexprs of the real case (heads, block size, tiles, splits, options): the kernels compile in
    Triton's disk cache, which the timed run then reads."""
    calls = []
    for shape in shapes:
        rows = int(shape.split("x")[0])
        q_len = int(shape.partition("q")[2] or 1)
        if "+" in shape:
            continue
        for kind in kinds:
            kv_dtype = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[kind]

            def small(rows=rows, kv_dtype=kv_dtype, q_len=q_len):
                return make_case(rows, 64, LLAMA8B, torch.bfloat16 if dev.type == "cuda" else torch.float16, kv_dtype,
                                 dev, MAX_MODEL_LEN, q_len=q_len)
            base = make_backend(LLAMA8B, kv_dtype)
            calls.append((f"{shape} {kind} default", lambda small=small, base=base: _run_small(base, small())))
            prev = make_backend(LLAMA8B, kv_dtype, PREVIOUS_DEFAULTS)
            calls.append((f"{shape} {kind} previous", lambda small=small, prev=prev: _run_small(prev, small())))
            for override in (table or {}).get((shape, kind), []):
                def call(small=small, kv_dtype=kv_dtype, override=override):
                    case = small()
                    p = plan_of(make_backend(LLAMA8B, kv_dtype), case, sm_count)
                    cand = dict({k: v for k, v in p.items() if k in SWEEP}, **override)
                    _run_small(make_backend(LLAMA8B, kv_dtype, launch_config(cand)), case)
                calls.append((f"{shape} {kind} {override}", call))
    return calls


def _run_small(backend, case: Case) -> None:
    if case.q.is_cuda:
        backend._sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    backend.forward(case.q, case.k, case.v, caches_for(backend, case)[0], case.meta)


PRECOMPILE_ENV = "GPU_ATTENTION_PRECOMPILE"  # JSON: shapes, kinds, io (for the --precompile children)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--precompile":  # a child of the parallel compile
        import triton_precompile
        spec = json.loads(os.environ[PRECOMPILE_ENV])
        sm = torch.cuda.get_device_properties(0).multi_processor_count
        table = VARIANTS_SHORT if spec.get("short") else VARIANTS_VT if spec.get("vt") else VARIANTS_IO if spec["io"] else VARIANTS if spec["variants"] else None
        triton_precompile.compile_shard(_precompile_calls(spec["shapes"], spec["kinds"], table, sm), sys.argv[2])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    ap.add_argument("--shapes", default=None, help="comma-separated ROWSxCONTEXT (default: %s)" % ",".join(SHAPES))
    ap.add_argument("--budget", type=float, default=75.0, help="seconds for the whole run; sweeps stop at it")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--variants", action="store_true",
                    help="time the named launches of VARIANTS per case first (every shape gets a share)")
    ap.add_argument("--io-variants", action="store_true",
                    help="as --variants, with VARIANTS_IO (the fp8 conversion and load-order launches)")
    ap.add_argument("--vt-variants", action="store_true",
                    help="as --variants, with VARIANTS_VT (fp8 values transposed per block; values-only conversion)")
    ap.add_argument("--short-variants", action="store_true",
                    help="as --variants, with VARIANTS_SHORT (fp8 decode launches at 256 rows x 320 / 640 keys)")
    ap.add_argument("--no-before", action="store_true", help="skip the launches of before the tuning work")
    ap.add_argument("--precompile-shards", type=int, default=0,
                    help="compile the default and variant launches in this many processes first (0: off)")
    ap.add_argument("--kv", default="bf16,fp8", help="cache dtypes: bf16,fp8,fp8_e5m2")
    ap.add_argument("--sweep-all", action="store_true", help="sweep every shape, not only 256x640 and 1x16384")
    args = ap.parse_args()
    start = time.perf_counter()
    smoke = args.smoke
    dev = torch.device("cpu" if smoke else "cuda")
    heads = SMOKE_HEADS if smoke else LLAMA8B
    shapes = (args.shapes or ",".join(SMOKE_SHAPES if smoke else SHAPES)).split(",")
    # (query dtype, KV cache dtype)
    dtypes = ([(torch.float32, torch.float32), (torch.float16, torch.float8_e4m3fn)] if smoke else
              [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float8_e4m3fn)])
    dtypes = [d for d, kind in zip(dtypes, ("bf16", "fp8")) if kind in args.kv.split(",")]
    if "fp8_e5m2" in args.kv.split(","):  # the e5m2 conversion (timed and checked like e4m3's)
        dtypes.append((torch.float16 if smoke else torch.bfloat16, torch.float8_e5m2))
    # Smoke: the interpreter mis-rounds float -> fp8, so the fp8 query terms are not checked there.
    sweep = ({"interior": [False], "fp8_qk_dot": [], "lookup_blocks": [True], "kv_splits": [1, 3],
              "block_n": [16], "decode_warps": [4], "num_stages": [1], "fp8_pv_dot": [],
              "decode_min_rows": [64], "early_v_load": [True], "fp8_convert_on_load": [True],
              "table_prefetch": [True], "fp8_v_transposed": [True]}
             if smoke else SWEEP)
    if smoke:
        args.sweep_all = True
    if args.no_sweep:
        sweep = {k: [] for k in SWEEP}
    max_model_len = 256 if smoke else MAX_MODEL_LEN
    sm_count = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 1
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (TRITON_INTERPRET=1)"
    copy_bps = copy_bandwidth(dev)
    read_bps = read_bandwidth(dev)
    print(f"device {name}, {sm_count} SMs; copy bandwidth {copy_bps / 1e9:.0f} GB/s (read + write), "
          f"read bandwidth {read_bps / 1e9:.0f} GB/s", flush=True)

    if dev.type == "cuda" and args.precompile_shards > 0:  # the kernels compile in parallel processes
        import triton_precompile
        os.environ[PRECOMPILE_ENV] = json.dumps({"shapes": shapes, "kinds": args.kv.split(","), "io": args.io_variants,
                                                 "variants": args.variants, "vt": args.vt_variants,
                                                 "short": args.short_variants})
        triton_precompile.compile_in_processes(__file__, "--precompile", args.precompile_shards,
                                               min(40.0, args.budget / 2), "attention launches")
    records = [check_fused_fp8_write(dev)]
    # Each case gets an equal share of what is left of the budget for its sweep.
    cases = [(s, qd, kd) for s in shapes for qd, kd in dtypes]
    for i, (shape, q_dtype, kv_dtype) in enumerate(cases):
        rows, rest = shape.split("x")
        context, _, prefill = rest.partition("+")
        context, _, q_len = context.partition("q")  # RxCqN: N-token decode rows
        left = args.budget - (time.perf_counter() - start)
        table = (VARIANTS_SHORT if args.short_variants else VARIANTS_VT if args.vt_variants else VARIANTS_IO
                 if args.io_variants else VARIANTS)
        any_variants = args.variants or args.io_variants or args.vt_variants or args.short_variants
        if any_variants:  # a share per launch to try
            kinds = ["fp8" if c[2] != torch.bfloat16 and c[2] != torch.float32 else "bf16" for c in cases[i:]]
            weights = [1 + len(table.get((c[0], k), [])) for c, k in zip(cases[i:], kinds)]
        else:
            weights = [WEIGHT.get(c[0], int(args.sweep_all)) for c in cases[i:]]
        deadline = time.perf_counter() + max(left, 0) * weights[0] / max(sum(weights), 1)
        case = make_case(int(rows), int(context), heads, q_dtype, kv_dtype, dev, max_model_len, seed=i,
                         prefill=int(prefill or 0), q_len=int(q_len or 1))
        try:
            records.append(run_case(case, heads, dev, copy_bps, deadline, sweep, sm_count, read_bps,
                                    variants=table if any_variants else None,
                                    with_before=not args.no_before))
        except Exception as e:  # noqa: BLE001 - a launch that does not compile: recorded, the other cases go on
            print(f"  {case.name} {case.kv_dtype}: {type(e).__name__}: {str(e)[:400]}", flush=True)
            records.append({"case": case.name, "kv": str(case.kv_dtype).split(".")[-1], "ok": False,
                            "error": f"{type(e).__name__}: {str(e)[:400]}"})
        save(records, name, sm_count, copy_bps, read_bps, start)  # after every case: a run cut short keeps what it has
        del case
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    print("\n| case | KV | before us | previous us | default us | % copy / read | best us | % copy / read | best launch |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in records:
        if "case" not in r or "error" in r:
            continue
        before = f"{r['before_us']:.1f}" if "before_us" in r else "-"
        prev = f"{r['previous_us']:.1f}" if "previous_us" in r else "-"
        print(f"| {r['case']} | {r['kv']} | {before} | {prev} | {r['us']:.1f} | {100 * r['of_copy']:.0f} / "
              f"{100 * r['of_read']:.0f} | {r['best_us']:.1f} | {100 * r['best_of_copy']:.0f} / "
              f"{100 * r['best_of_read']:.0f} | {r['best']} |")
    by_case = {}
    for r in records:
        if "case" in r and "error" not in r:
            by_case.setdefault(r["case"], {})[r["kv"]] = r
    for c, rs in by_case.items():
        base_kind = "bfloat16" if "bfloat16" in rs else "float32"
        for b, rb in ((k, r) for k, r in rs.items() if k != base_kind and base_kind in rs):
            a, ra = base_kind, rs[base_kind]
            prev = (f"previous defaults {rb['previous_us'] / ra['previous_us']:.2f}, "
                    if "previous_us" in ra and "previous_us" in rb else "")
            print(f"  {c}: {b} / {a} time, {prev}default launch {rb['us'] / ra['us']:.2f}, "
                  f"best launches {rb['best_us'] / ra['best_us']:.2f}")
    print("\nByte bound (KV bytes at max(read roof, copy rate, 3.0 TB/s)) and the fraction of it reached:")
    for r in records:
        if "case" in r and "error" not in r:
            print(f"  {r['case']:>9} {r['kv']:>13}: bound {r['bound_us']:7.1f} us; default {r['us']:7.1f} us "
                  f"({100 * r['bound_us'] / r['us']:3.0f}%); best {r['best_us']:7.1f} us "
                  f"({100 * r['bound_us'] / r['best_us']:3.0f}%) {({k: v for k, v in r['best'].items() if r['plan'].get(k) != v})}")
    ok = save(records, name, sm_count, copy_bps, read_bps, start)
    print(f"{'all checks passed' if ok else 'CHECK FAILED'} in {time.perf_counter() - start:.0f} s", flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
