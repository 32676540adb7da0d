"""Batched LoRA kernels in Triton: shrink (x @ A^T) and expand (y += t @ B^T), two shapes of work.

- **rows** (decode sizes, up to `ROWS_MAX_TOKENS` tokens): a program owns one token, a block of
  columns and (in the shrink) one slice of K; it reads its token's slot and does a vector-matrix product with
  vectorised loads (no tensor-core tile of 16 rows for one token). Tokens without an adapter
  (slot -1) return at once. The shrink's K slices give the parallelism a single token lacks.
- **tiles** (larger steps): the step's tokens sorted by slot are cut into tiles of BLOCK_M rows
  that never cross a slot boundary (`plan_tiles`, once per step, on the device); a program owns
  one tile and one block of columns and does tensor-core dots with its slot's A or B block. Each
  adapter's weights are read once per tile, never for a slot absent from the tile.

The shrink writes float32 partial sums [splits, T, parts * R] (K split over programs, no
atomics: the same result on every run) into the step's workspace; the expand adds the planes
once per tile and adds its delta into y in place (the base projection's output). Grids, splits
and block sizes depend on shapes only (capture-safe), and are computed once per shape
(`ShrinkConfig`, cached), not per call.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

_BIG = 1 << 30  # "no more parts" on the host
ROWS_MAX_TOKENS = 16  # steps up to this many tokens use the per-token (rows) kernels
_ROWS_BLOCK_K = 128
_ROWS_MAX_SPLITS = 64  # the rows expand loads this many planes of a token in one (masked) block
_TILES_BLOCK_K = 64
_TILES_MAX_SPLITS = 8


# ---------------------------------------------------------------- rows: one token per program

@triton.jit
def _shrink_rows_kernel(x_ptr, a_ptr, out_ptr, slots_ptr, N, K, K_PER_SPLIT,
                        stride_xt, stride_as, stride_an, stride_split, stride_ot,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (token, n, split): the token's x over the split's K range times its slot's A rows."""
    t, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    s = tl.load(slots_ptr + t).to(tl.int64)
    if s < 0:
        return
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    x_row = x_ptr + t.to(tl.int64) * stride_xt
    a_rows = a_ptr + s * stride_as + n[:, None].to(tl.int64) * stride_an
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    k_start = pid_k * K_PER_SPLIT
    for k0 in range(k_start, k_start + K_PER_SPLIT, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        xv = tl.load(x_row + k, mask=k_ok, other=0.0).to(tl.float32)
        av = tl.load(a_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(av * xv[None, :], axis=1)
    tl.store(out_ptr + pid_k * stride_split + t * stride_ot + n, acc, mask=n_ok)


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


# ---------------------------------------------------------------- tiles: one slot per tile

@triton.jit(do_not_specialize=["MAX_TILES", "GRID_M"])
def _shrink_tiles_kernel(x_ptr, a_ptr, out_ptr, order_ptr, tiles_ptr, count_ptr, MAX_TILES, GRID_M, N, K,
                         K_PER_SPLIT, stride_xt, stride_as, stride_an, stride_split, stride_ot,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         IEEE: tl.constexpr):
    """Program (i, n, split): tiles i, i + GRID_M, ... of the step (each of one slot), over the
    split's K range, a dot each."""
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    k_start = pid_k * K_PER_SPLIT
    for i in range(pid_m, tl.load(count_ptr), GRID_M):
        s = tl.load(tiles_ptr + i).to(tl.int64)
        if s >= 0:  # (-1: tokens without an adapter)
            row0 = tl.load(tiles_ptr + MAX_TILES + i)
            row1 = tl.load(tiles_ptr + 2 * MAX_TILES + i)
            m = row0 + tl.arange(0, BLOCK_M)
            m_ok = m < row1
            rows = tl.load(order_ptr + m, mask=m_ok, other=0).to(tl.int64)
            a_base = a_ptr + s * stride_as + n[None, :].to(tl.int64) * stride_an
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(k_start, k_start + K_PER_SPLIT, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                k_ok = k < K
                xb = tl.load(x_ptr + rows[:, None] * stride_xt + k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                             other=0.0)
                ab = tl.load(a_base + k[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
                if IEEE:  # float32 inputs: exact float32 products, not TF32
                    acc += tl.dot(xb, ab, input_precision="ieee")
                else:
                    acc += tl.dot(xb, ab)
            tl.store(out_ptr + pid_k * stride_split + rows[:, None] * stride_ot + n[None, :], acc,
                     mask=m_ok[:, None] & n_ok[None, :])


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


# ---------------------------------------------------------------- gate_up: expand fused with SiLU-and-mul

@triton.jit(do_not_specialize=["SPLITS"])
def _expand_silu_rows_kernel(t_ptr, b_ptr, y_ptr, out_ptr, slots_ptr, I, SPLITS,
                             stride_split, stride_tt, stride_bs, stride_bn, stride_yt, stride_ot,
                             a2_ptr, t2_ptr, N2, stride_a2s, stride_a2n, stride_t2split, stride_t2t,
                             RANK: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS_PAD: tl.constexpr,
                             NEXT: tl.constexpr, BLOCK_N2: tl.constexpr):
    """Program (token, n): silu(gate + delta) * (up + delta) for columns n of the token, from the
    base [gate | up] output y (every token: those without an adapter get no delta). NEXT: also
    the next projection's shrink over these columns (its input is this output: down_proj's A
    [slots, N2, I]), as plane `n` of its float32 partial sums [I / BLOCK_N, T, N2]."""
    dtype = y_ptr.dtype.element_ty
    t, pid_n = tl.program_id(0).to(tl.int64), tl.program_id(1)
    s = tl.load(slots_ptr + t).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < I
    gate = tl.load(y_ptr + t * stride_yt + n, mask=n_ok, other=0.0).to(tl.float32)
    up = tl.load(y_ptr + t * stride_yt + I + n, mask=n_ok, other=0.0).to(tl.float32)
    if s >= 0:
        r = tl.arange(0, RANK)
        sp = tl.arange(0, SPLITS_PAD)
        planes = t_ptr + sp[:, None] * stride_split + t * stride_tt + r[None, :]
        sp_ok = (sp < SPLITS)[:, None]
        s_gate = tl.sum(tl.load(planes, mask=sp_ok, other=0.0), axis=0)
        s_up = tl.sum(tl.load(planes + RANK, mask=sp_ok, other=0.0), axis=0)
        b_rows = b_ptr + s * stride_bs + n[:, None].to(tl.int64) * stride_bn + r[None, :]
        b_gate = tl.load(b_rows, mask=n_ok[:, None], other=0.0).to(tl.float32)
        b_up = tl.load(b_rows + I * stride_bn, mask=n_ok[:, None], other=0.0).to(tl.float32)
        # y + delta rounded as the unfused path stores it, then the activation's own roundings.
        gate = (gate + tl.sum(b_gate * s_gate[None, :], axis=1)).to(dtype).to(tl.float32)
        up = (up + tl.sum(b_up * s_up[None, :], axis=1)).to(dtype).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    res = (silu * up).to(dtype)
    tl.store(out_ptr + t * stride_ot + n, res, mask=n_ok)
    if NEXT:
        if s >= 0:
            n2 = tl.arange(0, BLOCK_N2)
            a2 = tl.load(a2_ptr + s * stride_a2s + n2[:, None].to(tl.int64) * stride_a2n + n[None, :],
                         mask=(n2 < N2)[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
            part = tl.sum(a2 * res.to(tl.float32)[None, :], axis=1)
            tl.store(t2_ptr + pid_n * stride_t2split + t * stride_t2t + n2, part, mask=n2 < N2)


@triton.jit(do_not_specialize=["MAX_TILES", "GRID_M", "SPLITS"])
def _expand_silu_tiles_kernel(t_ptr, b_ptr, y_ptr, out_ptr, order_ptr, tiles_ptr, count_ptr, MAX_TILES, GRID_M, I,
                              SPLITS, stride_split, stride_tt, stride_bs, stride_bn, stride_yt, stride_ot,
                              RANK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              IEEE: tl.constexpr, UNROLL: tl.constexpr, SPLITS_MAX: tl.constexpr):
    """Program (i, n): for tiles i, i + GRID_M, ...: the activation of the tile's rows, columns n;
    tiles of tokens without an adapter (slot -1) get no delta."""
    dtype = y_ptr.dtype.element_ty
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < I
    r = tl.arange(0, RANK)
    for i in range(pid_m, tl.load(count_ptr), GRID_M):
        s = tl.load(tiles_ptr + i).to(tl.int64)
        row0 = tl.load(tiles_ptr + MAX_TILES + i)
        row1 = tl.load(tiles_ptr + 2 * MAX_TILES + i)
        m = row0 + tl.arange(0, BLOCK_M)
        m_ok = m < row1
        rows = tl.load(order_ptr + m, mask=m_ok, other=0).to(tl.int64)
        ok = m_ok[:, None] & n_ok[None, :]
        y_ptrs = y_ptr + rows[:, None] * stride_yt + n[None, :]
        gate = tl.load(y_ptrs, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(y_ptrs + I, mask=ok, other=0.0).to(tl.float32)
        if s >= 0:
            t_ptrs = t_ptr + rows[:, None] * stride_tt + r[None, :]
            s_gate = tl.zeros((BLOCK_M, RANK), dtype=tl.float32)
            s_up = tl.zeros((BLOCK_M, RANK), dtype=tl.float32)
            if UNROLL:
                for split in tl.static_range(SPLITS_MAX):
                    live = m_ok[:, None] & (tl.full((BLOCK_M, 1), split, tl.int32) < SPLITS)
                    s_gate += tl.load(t_ptrs + split * stride_split, mask=live, other=0.0)
                    s_up += tl.load(t_ptrs + split * stride_split + RANK, mask=live, other=0.0)
            else:
                for split in range(0, SPLITS):
                    s_gate += tl.load(t_ptrs + split * stride_split, mask=m_ok[:, None], other=0.0)
                    s_up += tl.load(t_ptrs + split * stride_split + RANK, mask=m_ok[:, None], other=0.0)
            b_cols = b_ptr + s * stride_bs + n[None, :].to(tl.int64) * stride_bn + r[:, None]
            b_gate = tl.load(b_cols, mask=n_ok[None, :], other=0.0)
            b_up = tl.load(b_cols + I * stride_bn, mask=n_ok[None, :], other=0.0)
            if IEEE:
                gate = (gate + tl.dot(s_gate, b_gate, input_precision="ieee")).to(dtype).to(tl.float32)
                up = (up + tl.dot(s_up, b_up, input_precision="ieee")).to(dtype).to(tl.float32)
            else:
                gate = (gate + tl.dot(s_gate.to(dtype), b_gate)).to(dtype).to(tl.float32)
                up = (up + tl.dot(s_up.to(dtype), b_up)).to(dtype).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        tl.store(out_ptr + rows[:, None] * stride_ot + n[None, :], (silu * up).to(dtype), mask=ok)


@triton.jit
def _silu_mul_add_kernel(y_ptr, d_ptr, out_ptr, I, stride_yt, stride_dt, stride_ot, BLOCK: tl.constexpr):
    """Program (token, n): silu(gate + its delta) * (up + its delta), the sums rounded to y's dtype
    (as y + delta is stored) and the activation's own roundings (`SiluAndMul`)."""
    dtype = y_ptr.dtype.element_ty
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = n < I
    y_row, d_row = y_ptr + t * stride_yt, d_ptr + t * stride_dt
    gate = tl.load(y_row + n, mask=ok, other=0.0).to(tl.float32) + tl.load(d_row + n, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(y_row + I + n, mask=ok, other=0.0).to(tl.float32) + tl.load(d_row + I + n, mask=ok, other=0.0).to(tl.float32)
    gate = gate.to(dtype).to(tl.float32)
    up = up.to(dtype).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + n, (silu * up).to(dtype), mask=ok)


def silu_mul_add(y: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of y + delta ([T, 2I] each, [gate | up]) in one pass: a new [T, I] tensor."""
    num_tokens, inter = y.shape[0], y.shape[1] // 2
    assert y.shape == delta.shape and y.stride(1) == 1 and delta.stride(1) == 1
    out = torch.empty(num_tokens, inter, dtype=y.dtype, device=y.device)
    block = min(triton.next_power_of_2(inter), 1024)
    if num_tokens:
        _silu_mul_add_kernel[(num_tokens, triton.cdiv(inter, block))](y, delta, out, inter, y.stride(0), delta.stride(0),
                                                                      out.stride(0), BLOCK=block, num_warps=4)
    return out


# ---------------------------------------------------------------- per step: the plan

# BLOCK_M of the tile kernels for steps of up to 512 tokens (larger ones: 64). A knob: a step's
# one adapter would take fewer, larger tiles; many adapters of a few tokens each, smaller ones.
TILE_ROWS_SMALL = 16


def tile_rows(num_tokens: int) -> int:
    """BLOCK_M of the tiles kernels for a step of `num_tokens` tokens."""
    return TILE_ROWS_SMALL if num_tokens <= 512 else 64


def max_tiles(num_tokens: int, num_slots: int) -> int:
    """An upper bound on a step's tiles: every tile has a token; each group of tokens (a slot's,
    and the tokens without an adapter) adds at most one partial tile."""
    return min(num_tokens, triton.cdiv(num_tokens, tile_rows(num_tokens)) + num_slots + 1)


NO_TILE = -2  # a tile table entry past the step's tiles (-1: a tile of tokens without an adapter)


def plan_tiles(token_slots: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step's tiles, on the device without a host sync: `order` (int32 [T], token indices sorted
    by slot, -1 first), `tiles` (int32 [3, max_tiles]: each tile's slot (-1: tokens without an
    adapter, which only the fused activation reads; NO_TILE: none), first and end position in
    `order`) and `count` (int32 [1]: the real tiles, which come first). Each group's tokens are cut
    into ceil(count / BLOCK_M) tiles, the groups in order."""
    num_tokens, device = token_slots.shape[0], token_slots.device
    block_m, limit = tile_rows(num_tokens), max_tiles(num_tokens, num_slots)
    sorted_slots, order = torch.sort(token_slots.to(torch.int32), stable=True)
    groups = torch.arange(-1, num_slots, dtype=torch.int32, device=device)
    starts = torch.searchsorted(sorted_slots, groups)
    ends = torch.searchsorted(sorted_slots, groups, right=True)
    per_group = (ends - starts + block_m - 1) // block_m
    tile_end = per_group.cumsum(0)
    tile = torch.arange(limit, dtype=torch.int64, device=device)
    group = torch.searchsorted(tile_end, tile, right=True)
    real = group <= num_slots
    group = group.clamp_max(num_slots)
    first = starts[group] + (tile - (tile_end[group] - per_group[group])) * block_m
    tiles = torch.stack([torch.where(real, group - 1, NO_TILE), first, torch.minimum(first + block_m, ends[group])])
    return order.to(torch.int32), tiles.to(torch.int32), tile_end[-1:].to(torch.int32)


@triton.jit(do_not_specialize=["T", "MAX_TILES", "GROUPS"])
def _plan_tiles_kernel(slots_ptr, order_ptr, tiles_ptr, count_ptr, T, MAX_TILES, GROUPS,
                       BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr, NO_TILE_: tl.constexpr):
    """`plan_tiles` in one program (one launch instead of a sort and a dozen small ops): a
    counting sort of the tokens by group (slot + 1; stable), then the tile table."""
    g = tl.arange(0, BLOCK_G)
    counts = tl.zeros((BLOCK_G,), dtype=tl.int32)
    for t0 in range(0, T, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        grp = tl.load(slots_ptr + t, mask=t < T, other=-2).to(tl.int32) + 1
        counts += tl.sum((grp[:, None] == g[None, :]).to(tl.int32), axis=0)
    starts = tl.cumsum(counts, axis=0) - counts
    per_group = (counts + BLOCK_M - 1) // BLOCK_M
    tile_end = tl.cumsum(per_group, axis=0)
    total = tl.sum(per_group, axis=0)
    running = starts
    for t0 in range(0, T, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        grp = tl.load(slots_ptr + t, mask=t < T, other=-2).to(tl.int32) + 1
        hot = (grp[:, None] == g[None, :]).to(tl.int32)
        rank = tl.cumsum(hot, axis=0) - hot  # earlier tokens of the same group in this block
        pos = tl.sum(hot * (running[None, :] + rank), axis=1)
        tl.store(order_ptr + pos, t, mask=t < T)
        running += tl.sum(hot, axis=0)
    for i0 in range(0, MAX_TILES, BLOCK_T):
        i = i0 + tl.arange(0, BLOCK_T)
        valid_g = g < GROUPS
        grp = tl.sum(((tile_end[None, :] <= i[:, None]) & valid_g[None, :]).to(tl.int32), axis=1)
        grp = tl.minimum(grp, GROUPS - 1)
        hot = (grp[:, None] == g[None, :]).to(tl.int32)
        start = tl.sum(hot * starts[None, :], axis=1)
        first_tile = tl.sum(hot * (tile_end - per_group)[None, :], axis=1)
        end = start + tl.sum(hot * counts[None, :], axis=1)
        first = start + (i - first_tile) * BLOCK_M
        real = i < total
        ok = i < MAX_TILES
        tl.store(tiles_ptr + i, tl.where(real, grp - 1, NO_TILE_), mask=ok)
        tl.store(tiles_ptr + MAX_TILES + i, first, mask=ok)
        tl.store(tiles_ptr + 2 * MAX_TILES + i, tl.minimum(first + BLOCK_M, end), mask=ok)
    tl.store(count_ptr, total)


def plan_tiles_fused(token_slots: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`plan_tiles`' result (the same order, tiles and count) from one kernel."""
    num_tokens, device = token_slots.shape[0], token_slots.device
    limit = max_tiles(num_tokens, num_slots)
    order = torch.empty(num_tokens, dtype=torch.int32, device=device)
    tiles = torch.empty(3, limit, dtype=torch.int32, device=device)
    count = torch.empty(1, dtype=torch.int32, device=device)
    slots = token_slots if token_slots.stride(0) == 1 else token_slots.contiguous()
    _plan_tiles_kernel[(1,)](slots, order, tiles, count, num_tokens, limit, num_slots + 1,
                             BLOCK_M=tile_rows(num_tokens), BLOCK_T=64,
                             BLOCK_G=max(16, triton.next_power_of_2(num_slots + 1)), NO_TILE_=NO_TILE,
                             num_warps=4)
    return order, tiles, count


# Steps of up to this many tokens get their tile plan from `_plan_tiles_kernel` (one launch; its
# one program is slower than the torch ops' sort beyond), larger ones from `plan_tiles`.
PLAN_KERNEL_MAX_TOKENS = 1024


# The tile kernels' grid: GRID_M programs along the tiles, each looping over tiles i, i + GRID_M,
# ... up to the step's real count (read on the device). None: GRID_M = the worst-case bound
# (`max_tiles`, one tile a program at most). A factor f: about f * ceil(T / BLOCK_M) programs
# (no empty programs for one adapter; but a program then runs several tiles in a row when the
# step mixes adapters: on an H200, 256 tokens of 64 adapters took 388 us a layer at f = 1 and
# 307 at the bound, one adapter the same either way; gpu_lora.py --parts layer).
TILE_GRID_FACTOR: float | None = None
# The shrink splits K until about this many programs per SM run; more splits cost more in the
# expand, which sums the planes (H200: 4 per SM and 16 splits, or 8 and 32, were slower).
TILE_PROGRAMS_PER_SM = 2
# The tile expands sum the shrink's K-split planes in a loop; unrolled (loads back to back) it was
# slower on an H200 (gpu_lora layer, 256 tokens: 272 vs 247 us a layer with 1 adapter, 375 vs 312
# with 64; the unrolled loop of a constexpr split count), so it stays rolled by default.
TILE_SPLITS_UNROLL = False
SILU_TILE_BLOCK_N = 64  # columns of gate (and of up) per program of the fused activation's tiles
EXPAND_TILE_BLOCK_N = 128  # the widest column block of the expand's tiles (it must divide the parts)
# ... in steps of small tiles (up to 512 tokens): wider (H200, 32 layers at 256 tokens: 243.4 vs
# 247.2 us a layer with 1 adapter, 288.6 vs 294.4 with 64; at 8192 tokens 256 was slower).
EXPAND_TILE_BLOCK_N_SMALL = 256


def _splits_max(splits: int) -> int:
    """The unrolled split loop's length: the tile shrink's most splits (a knob), so one compile
    serves every step size."""
    return max(splits, _TILES_MAX_SPLITS)


def tile_grid(num_tokens: int, num_slots: int, factor: float | None | str = "default") -> int:
    factor = TILE_GRID_FACTOR if factor == "default" else factor
    bound = max_tiles(num_tokens, num_slots)
    if factor is None:
        return bound
    fewest = triton.cdiv(num_tokens, tile_rows(num_tokens))
    return max(1, min(bound, int(fewest * factor + 0.999)))


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


@dataclass(frozen=True)
class ShrinkConfig:
    """A shrink's launch for one shape: grid, K split and blocks; `planes`: the workspace it fills."""
    rows: bool  # the per-token kernels (else the tiles kernels)
    grid: tuple[int, int, int]
    splits: int
    k_per_split: int
    block_n: int
    block_k: int
    block_m: int

    def planes_numel(self, num_tokens: int, n: int) -> int:
        return self.splits * num_tokens * n


def shrink_config(num_tokens: int, n: int, k: int, num_slots: int, sm_count: int, rows: bool) -> ShrinkConfig:
    return _shrink_config(num_tokens, n, k, num_slots, sm_count, rows, TILE_GRID_FACTOR, TILE_PROGRAMS_PER_SM,
                          _TILES_MAX_SPLITS, tile_rows(num_tokens))


@functools.cache
def _shrink_config(num_tokens: int, n: int, k: int, num_slots: int, sm_count: int, rows: bool, grid_factor: float,
                   per_sm: int, tiles_max_splits: int, tile_block_m: int) -> ShrinkConfig:
    """K is split so that a few programs per SM run (a decode step has few tokens)."""
    if rows:
        block_n = min(64, triton.next_power_of_2(n))
        block_k, block_m, max_splits = _ROWS_BLOCK_K, 1, _ROWS_MAX_SPLITS
        lead, programs = num_tokens, num_tokens * triton.cdiv(n, block_n)
        per_sm = 2
    else:
        block_n = 16 if n <= 16 else (32 if n <= 32 else 64)
        block_k, block_m, max_splits = _TILES_BLOCK_K, tile_block_m, tiles_max_splits
        lead = tile_grid(num_tokens, num_slots, grid_factor)
        programs = triton.cdiv(num_tokens, block_m) * triton.cdiv(n, block_n)  # the fewest real tiles
    splits = max(1, min(per_sm * sm_count // programs, triton.cdiv(k, block_k), max_splits))
    k_per_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    splits = triton.cdiv(k, k_per_split)
    return ShrinkConfig(rows, (lead, triton.cdiv(n, block_n), splits), splits, k_per_split, block_n, block_k, block_m)


def _tile_warps(block_m: int, block_n: int) -> int:
    """Warps of a tile kernel holding float32 [block_m, block_n] values (few registers per thread)."""
    return 8 if block_m * block_n >= 8192 else 4


def expand_block_n(part_starts: tuple[int, ...], widest: int = 64) -> int:
    """The widest BLOCK_N (16..`widest`) dividing every part boundary; 0 when none does."""
    block = widest
    while block >= 16:
        if all(p % block == 0 for p in part_starts[:-1]):
            return block
        block //= 2
    return 0


@dataclass
class StepPlan:
    """What every LoRA projection of one step shares: the token -> slot map in the form its
    kernels read, and one float32 workspace for the shrink's planes (reused by every projection:
    each expand consumes its shrink's planes before the next projection's shrink runs)."""
    num_tokens: int
    num_slots: int
    token_slots: torch.Tensor  # int32 [T] (rows kernels)
    order: torch.Tensor | None  # int32 [T] (tiles kernels)
    tiles: torch.Tensor | None  # int32 [3, max_tiles] (tiles kernels)
    workspace: torch.Tensor  # float32, at least every projection's planes
    count: torch.Tensor | None = None  # int32 [1]: the step's real tiles (tiles kernels)
    grid_m: int = 0  # the tile kernels' programs along the tiles (`tile_grid`)
    # rows kernels: the planes of a shrink fused into the previous kernel (`lora_expand_silu`), apart
    # from `workspace` (read by that same kernel)
    next_workspace: torch.Tensor | None = None


def plan_step(token_slots: torch.Tensor, num_slots: int, shapes: set[tuple[int, int]],
              rows_max: int = ROWS_MAX_TOKENS) -> StepPlan:
    """`shapes`: every LoRA projection's (parts * R, in_features): the workspace fits the largest.
    Steps of up to `rows_max` tokens run the per-token kernels, larger ones the tile kernels."""
    num_tokens, device = token_slots.shape[0], token_slots.device
    sms, rows = _sm_count(device), num_tokens <= rows_max
    numel = max((shrink_config(num_tokens, n, k, num_slots, sms, rows).planes_numel(num_tokens, n)
                 for n, k in shapes), default=0)
    workspace = torch.empty(max(numel, 1), dtype=torch.float32, device=device)
    if rows:  # the rows kernels index token_slots by token: a dense int32 copy when not one already
        # (a one-row prompt chunk's slots are an expanded view with stride 0: read past its element)
        widest = max((n for n, _ in shapes), default=1)
        fused = torch.empty(_ROWS_MAX_SPLITS * num_tokens * widest, dtype=torch.float32, device=device)
        return StepPlan(num_tokens, num_slots, token_slots.to(torch.int32).contiguous(), None, None, workspace,
                        next_workspace=fused)
    planner = plan_tiles_fused if num_tokens <= PLAN_KERNEL_MAX_TOKENS else plan_tiles
    order, tiles, count = planner(token_slots, num_slots)
    return StepPlan(num_tokens, num_slots, token_slots, order, tiles, workspace, count,
                    tile_grid(num_tokens, num_slots))


# ---------------------------------------------------------------- launches

def lora_shrink(x: torch.Tensor, a: torch.Tensor, plan: StepPlan) -> torch.Tensor:
    """x[t] @ A[slot(t)]^T as float32 partial sums [splits, T, parts * R] (a view of the plan's
    workspace; rows of tokens without an adapter are left unwritten)."""
    num_tokens, k = x.shape
    n = a.shape[1]
    cfg = shrink_config(num_tokens, n, k, plan.num_slots, _sm_count(x.device), plan.order is None)
    planes = plan.workspace[:cfg.planes_numel(num_tokens, n)].view(cfg.splits, num_tokens, n)
    assert x.stride(1) == 1 and a.stride(2) == 1
    if cfg.rows:
        _shrink_rows_kernel[cfg.grid](x, a, planes, plan.token_slots, n, k, cfg.k_per_split,
                                      x.stride(0), a.stride(0), a.stride(1), planes.stride(0), planes.stride(1),
                                      BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k)
    else:
        grid = (plan.grid_m,) + cfg.grid[1:]
        _shrink_tiles_kernel[grid](x, a, planes, plan.order, plan.tiles, plan.count, plan.tiles.shape[1],
                                       plan.grid_m, n, k, cfg.k_per_split, x.stride(0), a.stride(0), a.stride(1),
                                       planes.stride(0), planes.stride(1), BLOCK_M=cfg.block_m,
                                       BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, IEEE=x.dtype == torch.float32)
    return planes


@functools.cache
def _expand_launch(rows: bool, num_tokens: int, n: int, part_starts: tuple[int, ...], lead: int,
                   tile_block_n: int) -> tuple:
    block_n = expand_block_n(part_starts, 256 if rows else tile_block_n)
    assert block_n, "part boundaries must be multiples of 16"
    bounds = list(part_starts[1:-1]) + [_BIG] * (3 - len(part_starts) + 1)
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
    widest = EXPAND_TILE_BLOCK_N_SMALL if tile_rows(num_tokens) == TILE_ROWS_SMALL else EXPAND_TILE_BLOCK_N
    grid, block_n, p1, p2 = _expand_launch(rows, num_tokens, n, part_starts, lead, widest)
    assert add or not rows, "the per-token expand only adds"
    if rows:
        _expand_rows_kernel[grid](planes, b, y, plan.token_slots, n, p1, p2, splits,
                                  planes.stride(0), planes.stride(1), b.stride(0), b.stride(1), y.stride(0),
                                  RANK=rank, BLOCK_N=block_n, SPLITS_PAD=_ROWS_MAX_SPLITS)
    else:
        _expand_tiles_kernel[grid](planes, b, y, plan.order, plan.tiles, plan.count, plan.tiles.shape[1],
                                   plan.grid_m, n, p1, p2, splits,
                                   planes.stride(0), planes.stride(1), b.stride(0), b.stride(1), y.stride(0),
                                   RANK=rank, BLOCK_M=tile_rows(num_tokens), BLOCK_N=block_n,
                                   IEEE=b.dtype == torch.float32, UNROLL=TILE_SPLITS_UNROLL,
                                   SPLITS_MAX=_splits_max(splits), ADD=add,
                                   num_warps=_tile_warps(tile_rows(num_tokens), block_n))
    return y



def _silu_rows_block_n(inter: int) -> int:
    return min(256, triton.next_power_of_2(inter))


def can_fuse_next_shrink(plan: StepPlan, inter: int, next_a: torch.Tensor) -> bool:
    """Whether `lora_expand_silu` can also do the next projection's shrink (A [slots, N2, inter]):
    per-token kernels only, and no more planes than the rows expand sums."""
    return (plan.order is None and next_a.shape[2] == inter and next_a.stride(2) == 1
            and triton.cdiv(inter, _silu_rows_block_n(inter)) <= _ROWS_MAX_SPLITS and next_a.shape[1] <= 64)


def lora_expand_silu(planes: torch.Tensor, b: torch.Tensor, plan: StepPlan, y: torch.Tensor,
                     next_a: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """silu(gate) * up of the [gate | up] projection's output `y` plus its LoRA deltas, in one pass
    (instead of the expand adding into y and the activation reading it back): a new [T, I] tensor
    with `SiluAndMul`'s roundings. `b`: [slots, 2 * I, R]; `planes`: the shrink's [splits, T, 2R].
    `next_a` (per-token kernels, `can_fuse_next_shrink`): the next projection's A, whose shrink of
    the output the same kernel computes: returns (output, that shrink's planes) (a view of the
    plan's `next_workspace`)."""
    splits, num_tokens, _ = planes.shape
    inter, rank = b.shape[1] // 2, b.shape[2]
    assert y.stride(1) == 1 and b.stride(2) == 1 and y.shape[1] == 2 * inter
    out = torch.empty(num_tokens, inter, dtype=y.dtype, device=y.device)
    if plan.order is None:
        block_n = _silu_rows_block_n(inter)
        grid = (num_tokens, triton.cdiv(inter, block_n))
        if next_a is not None:
            assert can_fuse_next_shrink(plan, inter, next_a)
            n2 = next_a.shape[1]
            next_planes = plan.next_workspace[:grid[1] * num_tokens * n2].view(grid[1], num_tokens, n2)
            fused = (next_a, next_planes, n2, next_a.stride(0), next_a.stride(1), next_planes.stride(0),
                     next_planes.stride(1))
        else:
            fused = (y, y, 0, 0, 0, 0, 0)  # (unused)
        _expand_silu_rows_kernel[grid](
            planes, b, y, out, plan.token_slots, inter, splits, planes.stride(0), planes.stride(1),
            b.stride(0), b.stride(1), y.stride(0), out.stride(0), *fused, RANK=rank, BLOCK_N=block_n,
            SPLITS_PAD=_ROWS_MAX_SPLITS, NEXT=next_a is not None,
            BLOCK_N2=triton.next_power_of_2(max(fused[2], 16)))
        return out if next_a is None else (out, next_planes)
    else:
        block_n = min(SILU_TILE_BLOCK_N, triton.next_power_of_2(inter))
        _expand_silu_tiles_kernel[(plan.grid_m, triton.cdiv(inter, block_n))](
            planes, b, y, out, plan.order, plan.tiles, plan.count, plan.tiles.shape[1], plan.grid_m, inter, splits, planes.stride(0), planes.stride(1),
            b.stride(0), b.stride(1), y.stride(0), out.stride(0), RANK=rank, BLOCK_M=tile_rows(num_tokens),
            BLOCK_N=block_n, IEEE=b.dtype == torch.float32, UNROLL=TILE_SPLITS_UNROLL,
            SPLITS_MAX=_splits_max(splits),
            num_warps=_tile_warps(tile_rows(num_tokens), 2 * block_n))
    return out
