"""The LoRA expand in Triton: y[t, part i] += t[t, part i] @ B[slot(t), part i]^T in place (the
shrink's K-slice planes summed first), per token (rows) or over one slot's tiles (tiles)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from tokenmill.layers.lora import triton_lora as dispatch
from tokenmill.layers.lora.triton_lora import StepPlan


@triton.jit(do_not_specialize=["SPLITS"])
def _expand_rows_kernel(t_ptr, b_ptr, y_ptr, slots_ptr, N, P1, P2, SPLITS,
                        stride_split, stride_tt, stride_bs, stride_bn, stride_yt,
                        RANK: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS_PAD: tl.constexpr):
    """Program (token, n): the token's shrink (planes summed) times its slot's B block, into y."""
    t, pid_n = tl.program_id(0), tl.program_id(1)
    s = tl.load(slots_ptr + t).to(tl.int64)
    if s < 0:
        return
    n0 = pid_n * BLOCK_N
    part = (n0 >= P1).to(tl.int32) + (n0 >= P2).to(tl.int32)  # BLOCK_N divides the part boundaries
    r = tl.arange(0, RANK)
    sp = tl.arange(0, SPLITS_PAD)
    planes = tl.load(t_ptr + sp[:, None] * stride_split + t * stride_tt + part * RANK + r[None, :],
                     mask=(sp < SPLITS)[:, None], other=0.0)
    shrunk = tl.sum(planes, axis=0)  # [RANK]
    n = n0 + tl.arange(0, BLOCK_N)
    n_ok = n < N
    bb = tl.load(b_ptr + s * stride_bs + n[:, None].to(tl.int64) * stride_bn + r[None, :],
                 mask=n_ok[:, None], other=0.0).to(tl.float32)
    delta = tl.sum(bb * shrunk[None, :], axis=1)
    y_ptrs = y_ptr + t.to(tl.int64) * stride_yt + n
    y = tl.load(y_ptrs, mask=n_ok, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y.dtype), mask=n_ok)



@triton.jit(do_not_specialize=["MAX_TILES", "GRID_M", "SPLITS"])
def _expand_tiles_kernel(t_ptr, b_ptr, y_ptr, order_ptr, tiles_ptr, count_ptr, MAX_TILES, GRID_M, N, P1, P2,
                         SPLITS, stride_split, stride_tt, stride_bs, stride_bn, stride_yt,
                         RANK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
                         UNROLL: tl.constexpr, SPLITS_MAX: tl.constexpr, ADD: tl.constexpr = True):
    """Program (i, n): for tiles i, i + GRID_M, ...: the tile's shrink (planes summed once) times
    its slot's B block, into y (ADD: added to it; else written over it, zeros for the tiles of
    tokens without an adapter: y then is the delta alone, every row written)."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    n0 = pid_n * BLOCK_N
    part = (n0 >= P1).to(tl.int32) + (n0 >= P2).to(tl.int32)  # BLOCK_N divides the part boundaries
    n = n0 + tl.arange(0, BLOCK_N)
    n_ok = n < N
    r = tl.arange(0, RANK)
    for i in range(pid_m, tl.load(count_ptr), GRID_M):
        s = tl.load(tiles_ptr + i).to(tl.int64)
        if s >= 0:
            row0 = tl.load(tiles_ptr + MAX_TILES + i)
            row1 = tl.load(tiles_ptr + 2 * MAX_TILES + i)
            m = row0 + tl.arange(0, BLOCK_M)
            m_ok = m < row1
            rows = tl.load(order_ptr + m, mask=m_ok, other=0).to(tl.int64)
            t_ptrs = t_ptr + rows[:, None] * stride_tt + part * RANK + r[None, :]
            shrunk = tl.zeros((BLOCK_M, RANK), dtype=tl.float32)
            if UNROLL:  # the planes' loads issued back to back, not one load's latency after another
                for split in tl.static_range(SPLITS_MAX):  # (masked past SPLITS: one compile for every step size)
                    live = m_ok[:, None] & (tl.full((BLOCK_M, 1), split, tl.int32) < SPLITS)
                    shrunk += tl.load(t_ptrs + split * stride_split, mask=live, other=0.0)
            else:
                for split in range(0, SPLITS):
                    shrunk += tl.load(t_ptrs + split * stride_split, mask=m_ok[:, None], other=0.0)
            bb = tl.load(b_ptr + s * stride_bs + n[None, :].to(tl.int64) * stride_bn + r[:, None],
                         mask=n_ok[None, :], other=0.0)
            if IEEE:
                acc = tl.dot(shrunk, bb, input_precision="ieee")
            else:
                acc = tl.dot(shrunk.to(bb.dtype), bb)
            write = m_ok[:, None] & n_ok[None, :]
            y_ptrs = y_ptr + rows[:, None] * stride_yt + n[None, :]
            if ADD:
                y = tl.load(y_ptrs, mask=write, other=0.0)
                tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y.dtype), mask=write)
            else:
                tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=write)
        elif not ADD:
            if s == -1:  # (NO_TILE entries lie past the count: never here)
                row0 = tl.load(tiles_ptr + MAX_TILES + i)
                row1 = tl.load(tiles_ptr + 2 * MAX_TILES + i)
                m = row0 + tl.arange(0, BLOCK_M)
                m_ok = m < row1
                rows = tl.load(order_ptr + m, mask=m_ok, other=0).to(tl.int64)
                zero = tl.zeros((BLOCK_M, BLOCK_N), dtype=y_ptr.dtype.element_ty)
                tl.store(y_ptr + rows[:, None] * stride_yt + n[None, :], zero, mask=m_ok[:, None] & n_ok[None, :])



@functools.cache
def _expand_launch(rows: bool, num_tokens: int, n: int, part_starts: tuple[int, ...], lead: int,
                   tile_block_n: int) -> tuple:
    block_n = dispatch.expand_block_n(part_starts, 256 if rows else tile_block_n)
    assert block_n, "part boundaries must be multiples of 16"
    bounds = list(part_starts[1:-1]) + [dispatch._BIG] * (3 - len(part_starts) + 1)
    return (lead, triton.cdiv(n, block_n)), block_n, bounds[0], bounds[1]


def lora_expand(planes: torch.Tensor, b: torch.Tensor, plan: StepPlan, y: torch.Tensor,
                part_starts: tuple[int, ...], add: bool = True) -> torch.Tensor:
    """y[t, part i] += shrunk[t, i * R:(i + 1) * R] @ B[slot(t), part i]^T in place; `planes`:
    `lora_shrink`'s partial sums [splits, T, parts * R]. `add=False` (tile kernels only): y
    becomes the delta alone (zeros for tokens without an adapter)."""
    splits, num_tokens, _ = planes.shape
    n, rank = b.shape[1], b.shape[2]
    assert y.stride(1) == 1 and b.stride(2) == 1
    rows = plan.order is None
    lead = num_tokens if rows else plan.grid_m
    small = dispatch.tile_rows(num_tokens) == dispatch.TILE_ROWS_SMALL
    widest = dispatch.EXPAND_TILE_BLOCK_N_SMALL if small else dispatch.EXPAND_TILE_BLOCK_N
    grid, block_n, p1, p2 = _expand_launch(rows, num_tokens, n, part_starts, lead, widest)
    assert add or not rows, "the per-token expand only adds"
    if rows:
        _expand_rows_kernel[grid](planes, b, y, plan.token_slots, n, p1, p2, splits,
                                  planes.stride(0), planes.stride(1), b.stride(0), b.stride(1), y.stride(0),
                                  RANK=rank, BLOCK_N=block_n, SPLITS_PAD=dispatch._ROWS_MAX_SPLITS)
    else:
        _expand_tiles_kernel[grid](planes, b, y, plan.order, plan.tiles, plan.count, plan.tiles.shape[1],
                                   plan.grid_m, n, p1, p2, splits,
                                   planes.stride(0), planes.stride(1), b.stride(0), b.stride(1), y.stride(0),
                                   RANK=rank, BLOCK_M=dispatch.tile_rows(num_tokens), BLOCK_N=block_n,
                                   IEEE=b.dtype == torch.float32, UNROLL=dispatch.TILE_SPLITS_UNROLL,
                                   SPLITS_MAX=dispatch._splits_max(splits), ADD=add,
                                   num_warps=dispatch._tile_warps(dispatch.tile_rows(num_tokens), block_n))
    return y
