"""Tile configurations of the quantized GEMM kernels (`triton_fp8_stream`, `triton_int4_stream`),
chosen per (kind, rows bucket, N, K) from a fixed table: no autotuning, so a CUDA-graph capture
never compiles or times anything it has not seen in the warm-up (which runs every captured batch
size first). The table's figures come from `scripts/gpu_quant.py --parts tune` on an H100.

Split-K: small batches cannot fill 132 SMs with N tiles alone, so K is cut into `split`
slices; each program writes its float32 partial tile, and the last program of a tile (an
atomic counter per tile says which) sums the slices in a fixed order, writes the output and
resets its counter to zero (so graph replays find the counters zeroed). One launch, no memset,
deterministic sums. The counters belong to one layer (`SplitCounters`), so two layers running
on two streams at once never share one.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class Tiles:
    """One launch configuration. `block_m == 1`: the GEMV path (one row per program, CUDA-core
    FMAs); otherwise tensor-core `tl.dot` tiles. `split`: programs along K per output tile."""

    block_m: int
    block_n: int
    block_k: int
    split: int = 1
    warps: int = 4
    stages: int = 3
    nibble_dots: bool = True  # int4 tensor-core tiles: 8 dots over strided x (else one, after a reshape)
    flat: bool = True  # fp8 one-row tiles (channel scales): sum over K once at the end (else each step)
    pipe: bool = False  # fp8 streaming: software-pipeline the K loop's loads (num_stages on the loop)
    pre: int = 1  # fp8 one-row tiles: weight tiles loaded before the PDL wait (1-4)

    @classmethod
    def parse(cls, label: str) -> Tiles:
        """The inverse of `label` (a tune record's key)."""
        import re

        m = re.fullmatch(r"m(\d+)n(\d+)k(\d+)s(\d+)w(\d+)st(\d+)(r?)(f?)(p?)(?:e(\d))?", label)
        if m is None:
            raise ValueError(f"not a tiles label: {label!r}")
        bm, bn, bk, split, warps, stages = map(int, m.groups()[:6])
        return cls(bm, bn, bk, split, warps, stages, nibble_dots=not m.group(7), flat=not m.group(8),
                   pipe=bool(m.group(9)), pre=int(m.group(10) or 1))

    def code(self) -> str:
        """The constructor call (for the tables below)."""
        extra = ("" if self.nibble_dots else ", nibble_dots=False") + ("" if self.flat else ", flat=False") + \
            (", pipe=True" if self.pipe else "") + (f", pre={self.pre}" if self.pre != 1 else "")
        return (f"Tiles({self.block_m}, {self.block_n}, {self.block_k}, {self.split}, {self.warps}, "
                f"{self.stages}{extra})")

    def label(self) -> str:
        return (f"m{self.block_m}n{self.block_n}k{self.block_k}s{self.split}w{self.warps}st{self.stages}"
                f"{'' if self.nibble_dots else 'r'}{'' if self.flat else 'f'}{'p' if self.pipe else ''}"
                f"{f'e{self.pre}' if self.pre != 1 else ''}")


# Rows up to which the fp8 weight-streaming kernel runs (bf16 activations, no activation
# quantization); above it torch._scaled_mm (W8A8) is faster (H200 sweep: a layer's four linears
# 94 vs 134 us at 16 rows, 159 vs 134 at 32).
FP8_STREAM_MAX_ROWS = 16
# INT4 (no act-order): rows up to which the GEMV / small-tile kernel runs; above it the
# tensor-core tiles, up to INT4_DEQUANT_MIN_ROWS, from where dequantize + cuBLAS runs.
INT4_STREAM_MAX_ROWS = 16
# The H200 sweep (docs/results/gpu-quant-kernels.md): dequantize + cuBLAS beat the tensor-core
# tiles at every row count from 256 (369 vs 566 us a layer at 256) and the dequantization's ~190 us
# are a fixed cost, so from 128 rows (448 us for the tiles; dequantize + mm ~ 190 + 136) it wins.
INT4_DEQUANT_MIN_ROWS = 128

# The SMs to fill (an H100 SXM has 132); read from the device where there is one.
_DEFAULT_SMS = 132


def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return _DEFAULT_SMS
    return torch.cuda.get_device_properties(device.index or 0).multi_processor_count


def _split_for(tiles_mn: int, k: int, block_k: int, sms: int, max_split: int = 8) -> int:
    """Enough K slices that the grid has about 2 programs per SM, each slice >= 4 K tiles."""
    if tiles_mn >= 2 * sms:
        return 1
    want = -(-2 * sms // tiles_mn)
    return max(1, min(want, k // (4 * block_k), max_split))


# Rows bucket (the largest row count it serves) -> tiles; split-K from `_split_for` unless a
# measured entry for the exact (N, K) in MEASURED gives one.
FP8_TABLE: dict[int, Tiles] = {1: Tiles(1, 16, 256, warps=2, stages=4, pipe=True),
                             FP8_STREAM_MAX_ROWS: Tiles(16, 32, 256)}
INT4_TABLE: dict[int, Tiles] = {
    1: Tiles(1, 64, 128),
    INT4_STREAM_MAX_ROWS: Tiles(16, 64, 128),
    64: Tiles(64, 128, 64, stages=4, nibble_dots=False),
    256: Tiles(64, 128, 64, stages=4, nibble_dots=False),
    1 << 30: Tiles(128, 128, 64, warps=8, nibble_dots=False),
}
# (kind, rows bucket, N, K) -> tiles with their split, the best of the sweep (Llama-8B's linears,
# an H200, 2026-11-25; the times: summed over the bucket's rows); `scripts/gpu_quant.py --parts
# tune` prints these lines. INT4 buckets from 128 rows take dequantize + cuBLAS (not listed).
MEASURED: dict[tuple[str, int, int, int], Tiles] = {
    # one row: `gpu_quant.py --parts b1` on an H100 (2026-11-26, fifth session; the H200 sweep's
    # tiles before: 41.6 / 23.8 / 9.0 / 11.3 us in the same run); qkv and o load 2 weight tiles
    # before the PDL wait (`Tiles.pre`). The 8-bit LM head (128256 x 4096) keeps FP8_TABLE's tile:
    # 172.0 us for fp8 (102% of copy), pre=4 171.5 but it spills with int8 weights (offline sm_90 SASS)
    ('fp8', 1, 28672, 4096): Tiles(1, 16, 256, 1, 2, 4, pipe=True),  # 41.6 us (94% of copy bandwidth)
    ('fp8', 1, 4096, 14336): Tiles(1, 16, 512, 2, 4, 3, pipe=True),  # 22.9 us (85%)
    # o_proj: 4 tiles before the wait (8.4 us with 2 on its own): with PDL on the attention path its
    # programs start during the split reduce, and half its weight is in flight when the wait ends
    ('fp8', 1, 4096, 4096): Tiles(1, 16, 512, 1, 4, 3, pipe=True, pre=4),
    ('fp8', 1, 6144, 4096): Tiles(1, 16, 512, 1, 4, 3, pipe=True, pre=2),  # 10.5 us (80%)
    ('fp8', 16, 28672, 4096): Tiles(16, 32, 256, 1, 4, 3),  # 173.2 us over rows [2, 4, 8, 16]
    ('fp8', 16, 4096, 14336): Tiles(16, 32, 256, 8, 4, 3),  # 101.6 us over rows [2, 4, 8, 16]
    ('fp8', 16, 4096, 4096): Tiles(16, 64, 128, 4, 4, 3),  # 44.8 us over rows [2, 4, 8, 16]
    ('fp8', 16, 6144, 4096): Tiles(16, 32, 256, 4, 4, 3),  # 55.5 us over rows [2, 4, 8, 16]
    ('int4', 1, 28672, 4096): Tiles(1, 128, 128, 4, 8, 3),  # 47.4 us over rows [1]
    ('int4', 1, 4096, 14336): Tiles(1, 128, 128, 8, 8, 3),  # 27.9 us over rows [1]
    ('int4', 1, 4096, 4096): Tiles(1, 64, 128, 8, 4, 3),  # 11.7 us over rows [1]
    ('int4', 1, 6144, 4096): Tiles(1, 64, 128, 8, 4, 3),  # 15.1 us over rows [1]
    ('int4', 16, 28672, 4096): Tiles(16, 64, 128, 4, 4, 3),  # 218.4 us over rows [4, 16]
    ('int4', 16, 4096, 14336): Tiles(16, 128, 128, 8, 8, 3),  # 106.7 us over rows [4, 16]
    ('int4', 16, 4096, 4096): Tiles(16, 128, 128, 8, 8, 3),  # 39.5 us over rows [4, 16]
    ('int4', 16, 6144, 4096): Tiles(16, 64, 128, 4, 4, 3),  # 57.9 us over rows [4, 16]
    ('int4', 64, 28672, 4096): Tiles(64, 128, 64, 1, 4, 4, nibble_dots=False),  # 83.0 us over rows [64]
    ('int4', 64, 4096, 14336): Tiles(64, 128, 64, 8, 4, 4, nibble_dots=False),  # 54.8 us over rows [64]
    ('int4', 64, 4096, 4096): Tiles(128, 128, 64, 4, 8, 3, nibble_dots=False),  # 25.6 us over rows [64]
    ('int4', 64, 6144, 4096): Tiles(64, 128, 64, 4, 4, 4, nibble_dots=False),  # 32.6 us over rows [64]
}


STREAM = -1  # GemvConfig.mode: one row takes `triton_int4_stream` (its MEASURED tiles) on the panels


@dataclass(frozen=True)
class GemvConfig:
    """The INT4 one-row GEMV (`triton_int4_gemv`): the panel width the weight is repacked to at
    load, the arithmetic (`triton_int4_gemv.MODES`, or STREAM), BLOCK_K, split-K, warps and
    pipeline stages."""

    panel: int
    mode: int = 2
    block_k: int = 64
    split: int = 1
    warps: int = 4
    stages: int = 3


# (N, K) -> the GEMV's configuration, from `scripts/gpu_quant.py --parts sweep` (Llama-8B's linears,
# an H200, 2026-11-26: the layer's four 78 us, bf16 cuBLAS 123, the old one-row stream kernel 84).
GEMV_TABLE: dict[tuple[int, int], GemvConfig] = {
    (28672, 4096): GemvConfig(512, mode=2, block_k=32, split=16, warps=4, stages=2),  # 33.7 us
    (4096, 14336): GemvConfig(512, mode=0, block_k=64, split=32, warps=4, stages=3),  # 22.1 us
    # qkv and o: the streaming kernel's one-row tiles (MEASURED) on the panels edge out every GEMV
    # variant (12.6 vs 12.7 us, 9.6 vs 10.6 on words)
    (6144, 4096): GemvConfig(128, mode=STREAM),
    (4096, 4096): GemvConfig(128, mode=STREAM),
}
_GEMV_PANELS = (128, 64, 32)


def gemv_config(n: int, k: int, group: int, sms: int) -> GemvConfig:
    """The measured configuration for this shape, else the widest panel dividing N, BLOCK_K 64
    (or the largest power of two dividing the group) and enough K slices to fill the SMs.
    panel 0: the shape does not fit the GEMV (the weight stays in the [K/8, N] layout)."""
    c = GEMV_TABLE.get((n, k))
    if c is not None and group % c.block_k == 0 and n % c.panel == 0:
        return c
    panel = next((p for p in _GEMV_PANELS if n % p == 0), 0)
    bk = _fit_k(64, group)
    if not panel or group % bk or bk % 8 or k % group:
        return GemvConfig(0)
    return GemvConfig(panel, block_k=bk, split=_split_for(n // panel, k, bk, sms, max_split=16))


# FP8 W8A8 above FP8_STREAM_MAX_ROWS: (rows from which it applies, GEMM) in increasing rows; the
# GEMMs: "scaled_mm" (row-wise torch._scaled_mm), "tensorwise" (_scaled_mm with unit scales, then
# one scaling pass), or the Triton fp8 GEMM's (block_m, block_n, block_k, group_m, warps, stages).
# From `scripts/gpu_quant.py --parts sweep`.
W8A8_PATHS: tuple[tuple[int, str | tuple[int, ...]], ...] = ((0, "scaled_mm"),)


# Per Llama-8B linear: (rows bucket: the most rows it serves, N, K) -> the GEMM, as in
# W8A8_PATHS, the Triton tiles with a 7th entry, split-K (`scripts/gpu_quant.py --parts w8a8`), or
# the label of the TMA-fed GEMM's tiles ("tma-...": `triton_fp8_tma.TmaTiles`).
# A shape or row count not listed takes W8A8_PATHS.
# 16-64 rows: H200, `W8A8_BUDGET_S=28 gpu_quant.py --parts profile,w8a8`
# (2026-11-26, third session): the fastest of row-wise / tensor-wise _scaled_mm and the Triton tiles.
# o / down at 256 rows and the 8192-row TMA stores: H100, session 12 (`scripts/gpu_fp8_w8a8_rows.py`,
# docs/results/gpu-fp8kv-s12.md).
# 128 rows (but gate_up), gate_up at 256, 512 rows and up: H100, `gpu_quant.py --parts w8a8tma`
# (sixth session, docs/results/h100-quant-w8a8tma-s6-mid.json): the TMA tiles where they beat
# row-wise _scaled_mm and the earlier entry; a layer's four GEMMs at 8192 rows 2,690 us against
# 2,962 (row-wise), at 1024 321.5 against 342.6 (the earlier table), at 256 in the decode-layer
# chain (norms, quantization, linears) 161.1 us a layer against 168.0 (all row-wise).
W8A8_MEASURED: dict[tuple[int, int, int], str | tuple[int, ...]] = {
    (32, 4096, 4096): (64, 64, 256, 1, 4, 3, 2),  # 10.2 us
    (32, 4096, 14336): (64, 64, 256, 1, 4, 3, 4),  # 20.9 us
    (32, 6144, 4096): (64, 64, 256, 1, 4, 3, 1),  # 11.9 us
    (32, 28672, 4096): (64, 128, 128, 1, 4, 4, 1),  # 32.8 us
    (64, 4096, 4096): (64, 64, 256, 1, 4, 3, 2),  # 11.0 us
    (64, 4096, 14336): (64, 64, 256, 1, 4, 3, 4),  # 23.2 us
    (64, 6144, 4096): (64, 64, 256, 1, 4, 3, 1),  # 12.4 us
    (64, 28672, 4096): (64, 128, 128, 1, 4, 4, 1),  # 33.6 us
    (128, 4096, 4096): 'tma-m128n64k128g8w4st5s1-swap',  # H100 12.3 us (earlier entry 13.6, row-wise 14.4)
    (128, 4096, 14336): 'tma-m128n64k128g8w4st5s2-swap',  # H100 31.9 us (34.6, 37.2)
    (128, 6144, 4096): 'tma-m128n64k128g8w4st5s1-swap',  # H100 14.6 us (15.5, 15.0)
    (128, 28672, 4096): 'scaled_mm',  # 37.6 us (H100: 50.6, the TMA tiles' best 51.7)
    # o / down at 256 rows: H100 (session 12, rounds 2 and 3: scripts/gpu_fp8_w8a8_rows.py, 8 layers' weights in
    # graphs): o 12.2 us on these swapped TMA tiles against 13.4 on the H200's pointer tiles of before
    # ((128, 64, 128, 8, 4, 4, 1): 13.3 us on an H200), down 37.1-37.7 on row-wise _scaled_mm against 39.4
    # ((128, 64, 128, 8, 4, 4, 2): 35.2 on an H200); in the fp8kv engine a 256-row decode step 8.379 ms
    # against 8.495, 256x256x128 +0.7% (medians of 3, one process)
    (256, 4096, 4096): 'tma-m128n64k128g8w4st5s1-swap',
    (256, 4096, 14336): 'scaled_mm',
    (256, 6144, 4096): 'scaled_mm',  # 14.6 us (H100: 16.5, the TMA tiles' best 16.9)
    (256, 28672, 4096): 'tma-m128n256k128g8w8st4s1-pers',  # H100 59.0 us (row-wise 63.9)
    (512, 4096, 4096): 'tma-m64n256k128g8w4st4s1',  # H100 16.2 us (row-wise 16.8)
    (512, 4096, 14336): 'scaled_mm',  # H100 45.8 us (the TMA tiles' best 48.0)
    (512, 6144, 4096): 'tma-m128n256k128g8w8st4s1-pers',  # H100 25.7 us (earlier entry 26.1, row-wise 28.8)
    (512, 28672, 4096): 'tma-m128n256k128g8w8st4s1-pers',  # H100 98.7 us (row-wise 102.6)
    (1024, 4096, 4096): 'tma-m128n256k128g8w8st4s1-pers',  # H100 26.5 us (27.0, 27.8)
    (1024, 4096, 14336): 'tma-m128n256k128g8w8st4s1',  # H100 79.8 us (80.9, 88.7)
    (1024, 6144, 4096): 'tma-m128n128k128g8w8st4s1-pers',  # H100 43.5 us (52.3, 52.5)
    (1024, 28672, 4096): 'tma-m128n256k128g8w8st4s1-pers',  # H100 171.7 us (182.5, 199.1)
    # 8192 rows (prefill chunks): the output tiles leave by TMA store in two halves (-t2; session 12, round 3,
    # H100, the same tiles with plain stores in brackets): a layer's four 2,481.8 us against 2,518.4
    (8192, 4096, 4096): 'tma-m128n256k128g8w8st4s1-pers-t2',  # H100 187.0 us (191.1; row-wise 211.1)
    (8192, 4096, 14336): 'tma-m128n256k128g8w8st4s1-pers-t2',  # H100 625.2 us (636.9; row-wise 847.7)
    (8192, 6144, 4096): 'tma-m128n256k128g8w8st4s1-pers-t2',  # H100 282.3 us (288.9; row-wise 312.0)
    (8192, 28672, 4096): 'tma-m128n256k128g8w8st4s1-pers-t2',  # H100 1387.3 us (1401.5; row-wise 1591.0)
}
W8A8_BUCKETS = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# A/B timing only: JSON {"ROWS,N,K": GEMM, ...} replacing W8A8_MEASURED entries (GEMM as in the table; a
# list for Triton tiles), read where a path is chosen (set it before an engine's graphs capture).
W8A8_TABLE_ENV = "TOKENMILL_W8A8_TABLE"


@functools.lru_cache(maxsize=4)
def w8a8_override(raw: str) -> dict[tuple[int, int, int], str | tuple[int, ...]]:
    import json

    out: dict[tuple[int, int, int], str | tuple[int, ...]] = {}
    for key, value in json.loads(raw).items():
        rows, n, k = (int(v) for v in key.split(","))
        out[(rows, n, k)] = tuple(value) if isinstance(value, list) else value
    return out


def w8a8_bucket(m: int) -> int:
    return min((b for b in W8A8_BUCKETS if b >= m), default=W8A8_BUCKETS[-1])


def w8a8_path(m: int, n: int, k: int) -> tuple[str, tuple[int, ...] | str | None]:
    """("scaled_mm" | "tensorwise" | "triton" | "tma", the Triton tiles, the TMA tiles' label, or
    None) for an [m, k] x [n, k]^T. A W8A8_MEASURED entry "tma-..." names a
    `triton_fp8_tma.TmaTiles` label (the TMA-fed GEMM)."""
    choice: str | tuple[int, ...] = "scaled_mm"
    for rows, c in W8A8_PATHS:
        if m >= rows:
            choice = c
    key = (w8a8_bucket(m), n, k)
    choice = W8A8_MEASURED.get(key, choice)
    if raw := os.environ.get(W8A8_TABLE_ENV):
        choice = w8a8_override(raw).get(key, choice)
    if isinstance(choice, str) and choice.startswith("tma-"):
        return "tma", choice
    if isinstance(choice, tuple):
        return ("triton", choice) if k % choice[2] == 0 else ("scaled_mm", None)
    return choice, None


def _bucket(table: dict[int, Tiles], m: int) -> int:
    return min((b for b in table if b >= m), default=max(table))


def fp8_tiles(m: int, n: int, k: int, block_scales: tuple[int, int] | None, sms: int) -> Tiles:
    """The fp8 weight-streaming kernel's configuration for an [m, k] x [n, k]^T product."""
    bucket = _bucket(FP8_TABLE, m)
    t = MEASURED.get(("fp8", bucket, n, k)) if block_scales is None else None
    if t is not None:
        return t
    t = FP8_TABLE[bucket]
    bn, bk = t.block_n, t.block_k
    if block_scales is not None:  # a K tile inside one K block, an N tile inside one N block
        bn, bk = min(bn, block_scales[0]), min(bk, block_scales[1])
    tiles_mn = -(-m // t.block_m) * -(-n // bn)
    return replace(t, block_n=bn, block_k=bk, split=_split_for(tiles_mn, k, bk, sms))


def streams_blocks(block: tuple[int, int]) -> bool:
    """Whether fp8 scale blocks of this shape fit the streaming kernel's power-of-two tiles."""
    return all(b >= 16 and b & (b - 1) == 0 for b in block)


def int4_tiles(m: int, n: int, k: int, group: int, sms: int) -> Tiles:
    """The INT4 kernel's configuration; `group` is the group size (k for one group)."""
    bucket = _bucket(INT4_TABLE, m)
    t = MEASURED.get(("int4", bucket, n, k))
    if t is not None and group % t.block_k == 0:
        return t
    t = INT4_TABLE[bucket]
    bk = _fit_k(t.block_k, group)
    tiles_mn = -(-m // t.block_m) * -(-n // t.block_n)
    split = _split_for(tiles_mn, k, bk, sms) if t.block_m < 64 else 1
    return replace(t, block_k=bk, split=split)


def _fit_k(block_k: int, group: int) -> int:
    """The largest power of two <= block_k dividing the group (a K tile never straddles two)."""
    while block_k > 16 and group % block_k:
        block_k //= 2
    return block_k


class SplitCounters:
    """A layer's zeroed int32 counters for split-K (one per output tile); allocated at load,
    outside any graph capture. Tiles beyond its size run without split."""

    def __init__(self, n: int, device: torch.device, rows_tiles: int = 4, min_block_n: int = 16) -> None:
        self.tensor = torch.zeros(rows_tiles * -(-n // min_block_n), dtype=torch.int32, device=device)

    def fits(self, tiles: int) -> bool:
        return tiles <= self.tensor.numel()
