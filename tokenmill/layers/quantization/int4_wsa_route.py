"""The warp-specialized swapped INT4 GEMM's launches and its route (no Gluon import: tables name launches here).

`WsaTiles` describes one launch of `gluon_int4_wsa_gemm`. `TABLE` maps (rows bucket, N, K) to the launch
that measured faster than the other INT4 paths on a GPU (scripts/gpu_int4_wsa.py; `DEFAULT_TABLE`);
TOKENMILL_INT4_WSA_TABLE ("256,28672,4096=wsa t256 g2 c1 st4;...", or empty) replaces it for A/B runs
without a commit. `PREFILL` (TOKENMILL_INT4_WSA_PREFILL, "28672,4096=wsa t256 g2 c1 st4 r8;...") does
the same per (N, K) for row counts past the last bucket (prefill chunks, where the other path is
dequantize + cuBLAS). This GEMM reads x in the swapped GEMM's K order, so `int4_kperm.swap_route` says
yes for a product listed here (the norms / SiLU-and-mul then write x permuted), and
`triton_int4_mma.mma_matmul` asks `wsa_tiles` before the swapped GEMM's table.
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
class WsaTiles:
    """A launch: BT tokens a CTA (wgmma's N), `wgs` consumer warpgroups of 4 warps, each warp `cpw`
    16-channel blocks (a CTA: 64 wgs cpw channels), `stages` ring slots (x tile, words, scales),
    split-K slices (needs counters; lowered until whole, even slices); sk > 0: the stream-K schedule
    on sk CTAs (`gluon_int4_wsa_streamk`; no split); depth: the wgmmas left in flight behind the one
    issued while the next step is dequantized (1 or 2); raster > 0 (plain kernel): the CTAs in groups
    of that many token tiles, each group's channel tiles in turn (prefill: x stays in L2)."""

    bt: int = 256
    wgs: int = 2
    cpw: int = 1
    stages: int = 4
    split: int = 1
    sk: int = 0
    depth: int = 1
    raster: int = 0

    @property
    def bc(self) -> int:
        return 64 * self.wgs * self.cpw

    def label(self) -> str:
        return (f"wsa t{self.bt} g{self.wgs} c{self.cpw} st{self.stages}{f' s{self.split}' if self.split > 1 else ''}"
                f"{f' sk{self.sk}' if self.sk else ''}{f' d{self.depth}' if self.depth != 1 else ''}"
                f"{f' r{self.raster}' if self.raster else ''}")

    @classmethod
    def parse(cls, label: str) -> WsaTiles:
        """The inverse of `label` ("wsa t256 g2 c1 st4 s2")."""
        m = re.fullmatch(r"wsa t(\d+) g(\d+) c(\d+) st(\d+)(?: s(\d+))?(?: sk(\d+))?(?: d(\d+))?(?: r(\d+))?", label.strip())
        if m is None:
            raise ValueError(f"not a warp-specialized swapped GEMM launch label: {label!r}")
        bt, wgs, cpw, st, split, sk, depth, raster = m.groups()
        return cls(int(bt), int(wgs), int(cpw), int(st), int(split or 1), int(sk or 0), int(depth or 1),
                   int(raster or 0))


def table_from(text: str) -> dict[tuple[int, int, int], WsaTiles]:
    """"256,28672,4096=wsa t256 g2 c1 st4;256,4096,14336=wsa t256 g1 c1 st4 s4" -> TABLE."""
    out = parse_gemm_table(text, WsaTiles.parse)
    for bucket, _, _ in out:
        if bucket not in BUCKETS:
            raise ValueError(f"TOKENMILL_INT4_WSA_TABLE: rows bucket {bucket} is not one of {BUCKETS}")
    return out


def prefill_from(text: str) -> dict[tuple[int, int], WsaTiles]:
    """"28672,4096=wsa t256 g2 c1 st4 r8;..." -> PREFILL ({(N, K): launch})."""
    out: dict[tuple[int, int], WsaTiles] = {}
    for item in filter(None, (p.strip() for p in text.split(";"))):
        key, _, label = item.partition("=")
        n, k = (int(v) for v in key.split(","))
        out[(n, k)] = WsaTiles.parse(label)
    return out


# Session 11 (one H200 each round, scripts/gpu_int4_wsa.py; us a call: wsa / the routed path before / bf16
# cuBLAS), the Llama-8B linears at 256 rows, round 4: gate_up 87.9 / 96.8 / 91.3, down 51.7 / 65.8 / 49.4,
# qkv 27.3 / 33.0 / 21.0, o 24.9 / 28.1 / 19.1; at 8192 rows (dequantize + cuBLAS the other path), rounds
# 2-3: gate_up 2,780-2,798 / 2,882-2,887 / 2,792, down 1,340-1,395 / 1,390-1,405 (qkv and o within 3%
# there: not listed). Round 6 (one H100, the same process): o on 128 CTAs of 64 x 128 without split
# (t64 g2 st6) 21.8 us against 24.9 (t256 g1 st4 s2), bf16 18.1; 256-channel tiles (t64 g4, t32 g4)
# lost everywhere. The environment variables replace them (an empty one: nothing routed here).
DEFAULT_TABLE = ("256,28672,4096=wsa t256 g2 c1 st5;256,4096,14336=wsa t256 g1 c1 st6 s2;"
                 "256,6144,4096=wsa t128 g2 c1 st6;256,4096,4096=wsa t64 g2 c1 st6")
DEFAULT_PREFILL = "28672,4096=wsa t256 g2 c1 st4 r8;4096,14336=wsa t256 g2 c1 st4 r2"
TABLE: dict[tuple[int, int, int], WsaTiles] = table_from(os.environ.get("TOKENMILL_INT4_WSA_TABLE", DEFAULT_TABLE))
# above the last rows bucket (prefill chunks), per (N, K): where the GEMM beats dequantize + cuBLAS
PREFILL: dict[tuple[int, int], WsaTiles] = prefill_from(os.environ.get("TOKENMILL_INT4_WSA_PREFILL", DEFAULT_PREFILL))
ENABLED = True  # False once `int4.gemm_selftest` failed on this process's GPU


def wsa_tiles(m: int, n: int, k: int, group: int, dtype: torch.dtype) -> WsaTiles | None:
    """The launch for an [m, k] x [k, n] product on the mma layout (bf16; N of whole channel tiles,
    the group and K of 64-input steps, an even number of them), or None: another path."""
    bucket = gemm_row_bucket(m)
    t = (TABLE.get((bucket, n, k)) if bucket is not None else PREFILL.get((n, k))) if ENABLED else None
    if t is None or dtype != torch.bfloat16 or n % t.bc or group % 64 or k % group or (k // 64) % 2:
        return None
    return t


def run(x: torch.Tensor, qm: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
        tiles: WsaTiles, counters: torch.Tensor | None = None) -> torch.Tensor:
    """The launch on x already in the swapped GEMM's K order (`int4_kperm`): stream-K where tiles.sk and
    enough counters (one per output tile), else the plain kernel."""
    n_tiles = -(-x.shape[0] // tiles.bt) * (qm.shape[0] * 16 // tiles.bc)
    if tiles.sk and counters is not None and counters.numel() >= n_tiles:
        from tokenmill.layers.quantization.gluon_int4_wsa_streamk import (
            wsa_streamk_gemm,
        )

        return wsa_streamk_gemm(x, qm, scales, zeros, group_size, tiles, counters)
    from tokenmill.layers.quantization.gluon_int4_wsa_gemm import wsa_gemm

    return wsa_gemm(x, qm, scales, zeros, group_size, tiles, counters=counters)
