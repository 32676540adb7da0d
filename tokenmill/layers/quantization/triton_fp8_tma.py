"""Triton kernel: FP8 W8A8 GEMM whose operand tiles arrive by TMA (Hopper's tensor memory
accelerator, through tensor descriptors), for the 64..1024-row batches where `torch._scaled_mm`'s
128 x 128 tiles leave the tensor cores waiting on L2: out = (xq @ wq^T) * x_scale * w_scale.

Why other tiles: at 256 rows a GEMM's operand traffic from L2 into the SMs is
M * N * K * (1 / tile_n + 1 / tile_m) bytes, so 128 x 128 tiles move 459 MB for gate_up
(28672 x 4096) against 352 MB for 256 x 128; the largest tiles that fit the registers win there.
- `swap`: the tile is computed as W_tile @ X_tile^T (the weight's rows on the MMA's M side, the
  tokens on its N side), so 128 weight rows x 256 tokens run as m64n256 wgmma per warpgroup and the
  weight tile is read once; the tile is transposed back on store.
- `split`: K cut into slices for the N = 4096 shapes whose tiles cannot fill the SMs; each slice
  writes float32 partials and the tile's last program sums them in order (`triton_split_k`).
- `persistent`: one program per SM walks the (tile, K slice) units (flattened loops, so the next
  tile's loads overlap this tile's epilogue).
- `ws`: Triton's automatic warp specialization of the K loop (producer / consumer warps).
- `tstore` (1 or 2 pieces): the output tile leaves through a TMA store (staged in shared memory,
  asynchronous: a persistent program's next tile starts while it drains) instead of scattered
  register stores; unsplit tiles only.
Every configuration is a `TmaTiles`; `stream_tiles.W8A8_MEASURED` names the measured winners
(`scripts/gpu_quant.py --parts w8a8tma`).

Operands: xq [M, K] and wq [N, K] e4m3, both K-contiguous with 16-byte aligned rows (TMA's rule;
`tma_refusal` says why not), one float32 scale per token and per output channel, float32
accumulation. Rows past M (and K past the end) read as zeros.

Torch reference: `fp8_ops.scaled_mm_reference`. Under TRITON_INTERPRET=1 the fp8 operands may be
float32 tensors holding fp8 values (descriptors work in the interpreter).
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tokenmill.layers.quantization.triton_split_k import store_tile


@dataclass(frozen=True)
class TmaTiles:
    """One launch configuration: tile rows (tokens) x tile columns (weight rows) x BLOCK_K, group
    of row tiles walking the columns together (L2 reuse), warps, pipeline stages, K slices, and
    the swap / persistent / warp-specialized variants (module docstring)."""

    block_m: int
    block_n: int
    block_k: int = 128
    group: int = 8
    warps: int = 8
    stages: int = 4
    split: int = 1
    swap: bool = False
    persistent: bool = False
    ws: bool = False
    tstore: int = 0  # the output tile stored by TMA (asynchronous) in this many column pieces; 0: plain stores

    def label(self) -> str:
        return (f"tma-m{self.block_m}n{self.block_n}k{self.block_k}g{self.group}w{self.warps}st{self.stages}"
                f"s{self.split}{'-swap' if self.swap else ''}{'-pers' if self.persistent else ''}"
                f"{'-ws' if self.ws else ''}{f'-t{self.tstore}' if self.tstore else ''}")

    @classmethod
    def parse(cls, label: str) -> TmaTiles:
        """The inverse of `label`."""
        m = re.fullmatch(r"tma-m(\d+)n(\d+)k(\d+)g(\d+)w(\d+)st(\d+)s(\d+)(-swap)?(-pers)?(-ws)?(?:-t([12]))?",
                         label)
        if m is None:
            raise ValueError(f"not a TMA tiles label: {label!r}")
        bm, bn, bk, g, w, st, sp = map(int, m.groups()[:7])
        return cls(bm, bn, bk, g, w, st, sp, swap=bool(m.group(8)), persistent=bool(m.group(9)),
                   ws=bool(m.group(10)), tstore=int(m.group(11) or 0))


# TOKENMILL_FP8_TMA_STORE=0: every tile stored plainly, whatever its label's `tstore` (A/B runs).
TMA_STORE = os.environ.get("TOKENMILL_FP8_TMA_STORE", "1") != "0"


@triton.jit
def _tile_of(unit, tiles_m, tiles_n, split, GROUP: tl.constexpr):
    """(row tile, column tile, K slice) of a work unit; GROUP row tiles walk the columns together."""
    tile = unit // split
    per_group = GROUP * tiles_n
    first_m = (tile // per_group) * GROUP
    size_m = tl.minimum(tiles_m - first_m, GROUP)
    pid_m = first_m + (tile % per_group) % size_m
    pid_n = (tile % per_group) // size_m
    return pid_m, pid_n, tile, unit % split


@triton.jit
def _unit(a_desc, b_desc, c_desc, as_ptr, bs_ptr, c_ptr, part_ptr, cnt_ptr, M, N, K, s_cm, unit, tiles_m, tiles_n,
          split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
          SWAP: tl.constexpr, SPLIT_K: tl.constexpr, WS: tl.constexpr, DOT_PRECISION: tl.constexpr,
          TSTORE: tl.constexpr):
    pid_m, pid_n, tile, pid_k = _tile_of(unit, tiles_m, tiles_n, split, GROUP)
    k_tiles = tl.cdiv(K, BLOCK_K)
    k_steps = tl.cdiv(k_tiles, split)
    k_lo = pid_k * k_steps
    k_hi = tl.minimum(k_lo + k_steps, k_tiles)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for ki in tl.range(k_lo, k_hi, warp_specialize=WS):
            a = a_desc.load([off_m, ki * BLOCK_K])
            b = b_desc.load([off_n, ki * BLOCK_K])
            acc = tl.dot(b, a.T, acc, input_precision=DOT_PRECISION)
        acc = tl.trans(acc)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for ki in tl.range(k_lo, k_hi, warp_specialize=WS):
            a = a_desc.load([off_m, ki * BLOCK_K])
            b = b_desc.load([off_n, ki * BLOCK_K])
            acc = tl.dot(a, b.T, acc, input_precision=DOT_PRECISION)
    offs_m = off_m + tl.arange(0, BLOCK_M)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    sa = tl.load(as_ptr + offs_m, mask=offs_m < M, other=0.0)
    sb = tl.load(bs_ptr + offs_n, mask=offs_n < N, other=0.0)
    acc = acc * sa[:, None] * sb[None, :]
    if TSTORE == 1:  # (rows past M and columns past N are clipped by the TMA unit)
        c_desc.store([off_m, off_n], acc.to(c_desc.dtype))
    elif TSTORE == 2:  # two column halves: half the shared-memory staging of the whole tile
        halves = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
        c0, c1 = tl.split(halves)
        c_desc.store([off_m, off_n], c0.to(c_desc.dtype))
        c_desc.store([off_m, off_n + BLOCK_N // 2], c1.to(c_desc.dtype))
    else:
        store_tile(acc, c_ptr, part_ptr, cnt_ptr, offs_m, offs_n, M, N, s_cm, tile, pid_k, split, SPLIT_K)


@triton.jit(do_not_specialize=["M", "units"])
def _fp8_tma_kernel(a_desc, b_desc, c_desc, as_ptr, bs_ptr, c_ptr, part_ptr, cnt_ptr, M, N, K, s_cm, units, split,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
                    SWAP: tl.constexpr, SPLIT_K: tl.constexpr, PERSISTENT: tl.constexpr, WS: tl.constexpr,
                    DOT_PRECISION: tl.constexpr, TSTORE: tl.constexpr = 0):
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    if PERSISTENT:
        for unit in tl.range(tl.program_id(0), units, tl.num_programs(0), flatten=True):
            _unit(a_desc, b_desc, c_desc, as_ptr, bs_ptr, c_ptr, part_ptr, cnt_ptr, M, N, K, s_cm, unit, tiles_m,
                  tiles_n, split, BLOCK_M, BLOCK_N, BLOCK_K, GROUP, SWAP, SPLIT_K, WS, DOT_PRECISION, TSTORE)
    else:
        _unit(a_desc, b_desc, c_desc, as_ptr, bs_ptr, c_ptr, part_ptr, cnt_ptr, M, N, K, s_cm, tl.program_id(0),
              tiles_m, tiles_n, split, BLOCK_M, BLOCK_N, BLOCK_K, GROUP, SWAP, SPLIT_K, WS, DOT_PRECISION, TSTORE)


def _store_pieces(t: TmaTiles, split: int, out: torch.Tensor) -> int:
    """The column pieces in which `t`'s output tile leaves by TMA store, or 0 (plain stores): unsplit tiles
    whose output rows TMA can address (16-byte aligned) only."""
    if not (TMA_STORE and t.tstore and split == 1):
        return 0
    aligned = (out.shape[1] * out.element_size()) % 16 == 0
    return t.tstore if aligned and t.block_n % (2 * t.tstore) == 0 else 0


@functools.cache
def tiles_of(label: str) -> TmaTiles:
    """`TmaTiles.parse`, once per label (the engine's table names tiles by their labels)."""
    return TmaTiles.parse(label)


def tma_refusal(xq: torch.Tensor, wq: torch.Tensor) -> str | None:
    """Why TMA descriptors cannot describe these operands (None: they can)."""
    if xq.is_cuda and torch.cuda.get_device_capability(xq.device) < (9, 0):
        return "TMA needs compute capability 9.0+"
    for name, t in (("activations", xq), ("weight", wq)):
        if t.dim() != 2 or t.stride(1) != 1:
            return f"{name} not K-contiguous"
        if t.data_ptr() % 16 or (t.stride(0) * t.element_size()) % 16:
            return f"{name} rows not 16-byte aligned"
    return None


def fp8_gemm_tma(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                 out_dtype: torch.dtype, tiles: TmaTiles, counters: torch.Tensor | None = None,
                 sms: int = 132) -> torch.Tensor:
    """xq [M, K] fp8 (x_scale [M, 1] or [M]) @ wq [N, K]^T fp8 (w_scale [N, 1] or [N]) -> [M, N] in
    out_dtype. `tiles.split` > 1 needs `counters` (zeroed int32, one per output tile), else (or
    where they are too few) the GEMM runs unsplit. Raises ValueError where `tma_refusal` refuses."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    reason = tma_refusal(xq, wq)
    if reason is not None:
        raise ValueError(f"fp8 TMA GEMM: {reason}")
    m, k = xq.shape
    n = wq.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    if m == 0:
        return out
    t = tiles
    tiles_mn = triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n)
    split = max(1, min(t.split, triton.cdiv(k, t.block_k)))
    if counters is None or tiles_mn > counters.numel():
        split = 1
    units = tiles_mn * split
    part = torch.empty((split, m, n), dtype=torch.float32, device=xq.device) if split > 1 else out
    a_desc = TensorDescriptor.from_tensor(xq, [t.block_m, t.block_k])
    b_desc = TensorDescriptor.from_tensor(wq, [t.block_n, t.block_k])
    tstore = _store_pieces(t, split, out)
    c_desc = TensorDescriptor.from_tensor(out, [t.block_m, t.block_n // tstore]) if tstore else out
    grid = (min(units, sms),) if t.persistent else (units,)
    _fp8_tma_kernel[grid](a_desc, b_desc, c_desc, x_scale.reshape(-1), w_scale.reshape(-1), out, part,
                          counters if split > 1 else out, m, n, k, out.stride(0), units, split,
                          BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP=t.group, SWAP=t.swap,
                          SPLIT_K=split > 1, PERSISTENT=t.persistent, WS=t.ws,
                          DOT_PRECISION="ieee" if xq.dtype == torch.float32 else "tf32", TSTORE=tstore,
                          num_warps=t.warps, num_stages=t.stages)
    return out
