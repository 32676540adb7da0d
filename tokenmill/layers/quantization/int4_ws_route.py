"""The warp-specialized INT4 GEMM's launches and its route (no Gluon import: tables name launches here).

`WsTiles` describes one launch of `gluon_int4_ws_gemm`. `TABLE` maps (rows bucket, N, K) to the launch
that measured faster than the other INT4 paths on a GPU (scripts/gpu_int4_ws.py); it starts empty and
TOKENMILL_INT4_WS_TABLE ("256,28672,4096=ws m256 n128 st4 w8 d4;...") fills it for A/B runs
without a commit. `triton_int4_mma.mma_matmul` asks `ws_tiles` first above the GEMV's rows, and
`int4_kperm.swap_route` says no for a product routed here (this GEMM reads x in its natural order).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

from tokenmill.layers.quantization.int4_mma_launch import GEMM_ROW_BUCKETS as BUCKETS
from tokenmill.layers.quantization.int4_mma_launch import (
    gemm_row_bucket,
    parse_gemm_table,
)


@dataclass(frozen=True)
class WsTiles:
    """A launch: BM rows by BN channels a CTA, STAGES ring slots (x, word and B tiles), the consumer's
    warps (4: one warpgroup, 8: two), the dequantizers' warps, split-K slices, the dequantizers'
    register budget; sk > 0: the stream-K schedule on sk CTAs (`gluon_int4_ws_streamk`; no split);
    deq_parts 2: two dequantizer partitions of deq_warps each, even and odd steps; 0: one partition
    making the steps two at a time, one fence a pair (plain kernel only); kmajor 1: the B ring K-major
    (the dequantizers' 16-byte stores without bank conflicts; plain kernel only); 2: besides, one word a
    lane dequantized into pairs of consecutive inputs (no repacking before the stores)."""

    bm: int = 128
    bn: int = 128
    stages: int = 4
    warps: int = 4
    deq_warps: int = 4
    split: int = 1
    deq_regs: int = 168
    sk: int = 0
    deq_parts: int = 1
    kmajor: int = 0

    def label(self) -> str:
        return (f"ws m{self.bm} n{self.bn} st{self.stages} w{self.warps} d{self.deq_warps}"
                f"{f' s{self.split}' if self.split > 1 else ''}{f' r{self.deq_regs}' if self.deq_regs != 168 else ''}"
                f"{f' sk{self.sk}' if self.sk else ''}{f' p{self.deq_parts}' if self.deq_parts != 1 else ''}"
                f"{' km' if self.kmajor else ''}{self.kmajor if self.kmajor > 1 else ''}")

    @classmethod
    def parse(cls, label: str) -> WsTiles:
        """The inverse of `label` ("ws m256 n128 st4 w8 d4 s2"; "_" for the spaces too, so that a table fits
        where values split at white space, e.g. scripts/gpu_quant.py's GPU_QUANT_ENV_int4x1)."""
        m = re.fullmatch(r"ws m(\d+) n(\d+) st(\d+) w(\d+) d(\d+)(?: s(\d+))?(?: r(\d+))?(?: sk(\d+))?(?: p(\d+))?(?: km(\d?))?", label.strip().replace("_", " "))
        if m is None:
            raise ValueError(f"not a warp-specialized GEMM launch label: {label!r}")
        bm, bn, st, w, d, split, regs, sk, parts, km = m.groups()
        return cls(int(bm), int(bn), int(st), int(w), int(d), int(split or 1), int(regs or 168), int(sk or 0),
                   int(parts or 1), 0 if km is None else int(km or 1))


def table_from(text: str) -> dict[tuple[int, int, int], WsTiles]:
    """"256,28672,4096=ws m256 n128 st4 w8 d4;256,4096,14336=ws m256 n128 st4 w8 d4 s4" -> TABLE."""
    out = parse_gemm_table(text, WsTiles.parse)
    for bucket, _, _ in out:
        if bucket not in BUCKETS:
            raise ValueError(f"TOKENMILL_INT4_WS_TABLE: rows bucket {bucket} is not one of {BUCKETS}")
    return out


TABLE: dict[tuple[int, int, int], WsTiles] = table_from(os.environ.get("TOKENMILL_INT4_WS_TABLE", ""))
# False after a failed start-up self-test (`int4.gemm_selftest` runs TABLE's launches): no product routed here.
ENABLED = True


def ws_tiles(m: int, n: int, k: int, group: int, dtype: torch.dtype) -> WsTiles | None:
    """The launch for an [m, k] x [k, n] product on the mma layout (bf16; N of whole channel tiles,
    the group and K of 64-input steps), or None: another path."""
    bucket = gemm_row_bucket(m)
    t = TABLE.get((bucket, n, k)) if bucket is not None and ENABLED else None
    if t is None or dtype != torch.bfloat16 or n % t.bn or group % 64 or k % group:
        return None
    return t


def run(x: torch.Tensor, qm: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
        tiles: WsTiles, counters: torch.Tensor | None = None) -> torch.Tensor:
    """The launch: stream-K where tiles.sk and enough counters (one per output tile), else the plain kernel."""
    from tokenmill.layers.quantization.gluon_int4_ws_gemm import ws_gemm

    n_tiles = -(-x.shape[0] // tiles.bm) * (qm.shape[0] * 16 // tiles.bn)
    if tiles.sk and counters is not None and counters.numel() >= n_tiles:
        from tokenmill.layers.quantization.gluon_int4_ws_streamk import ws_streamk_gemm

        return ws_streamk_gemm(x, qm, scales, zeros, group_size, tiles, counters)

    return ws_gemm(x, qm, scales, zeros, group_size, tiles, counters=counters)
