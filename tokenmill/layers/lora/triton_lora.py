"""Batched LoRA kernels in Triton: shrink (x @ A^T) and expand (y += t @ B^T) over the step's
tokens sorted by adapter slot.

Both take `order` (token indices sorted by slot) and `sorted_slots` (their slots, ascending;
-1 first: tokens without an adapter). A program owns a tile of BLOCK_M sorted tokens and
BLOCK_N output columns; it loops over the slots from its tile's smallest to its largest (one
for a prefill segment, a few for mixed decode rows), each iteration a dot of the tile's rows
of that slot (the others masked to zero) with the slot's A or B block. Rows are gathered and
scattered through `order`, so nothing is copied into sorted order. Grids depend on shapes
only: capture-safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BIG = 1 << 30  # "no slot" / "no more parts", on the host
_NO_SLOT = tl.constexpr(1 << 30)  # the same inside kernels (globals there must be constexpr)
_MAX_SPLITS = 8  # K splits of the shrink (the expand sums that many planes per tile)


@triton.jit(do_not_specialize=["T"])
def _shrink_kernel(x_ptr, a_ptr, out_ptr, order_ptr, slots_ptr, T, N, K, K_PER_SPLIT,
                   stride_xt, stride_as, stride_an, stride_split, stride_ot,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """Program (m, n, split): tokens m's tile, columns n's, the split's range of K (a partial
    sum written to its own plane of `out`: no atomics, the same result on every run)."""
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < T
    tile_slots = tl.load(slots_ptr + m, mask=m_ok, other=-1)
    rows = tl.load(order_ptr + m, mask=m_ok, other=0).to(tl.int64)
    lo = tl.min(tl.where(tile_slots >= 0, tile_slots, _NO_SLOT))
    hi = tl.max(tile_slots)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    k_start = pid_k * K_PER_SPLIT
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in range(lo, hi + 1):
        mine = m_ok & (tile_slots == s)
        for k0 in range(k_start, k_start + K_PER_SPLIT, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < K
            xb = tl.load(x_ptr + rows[:, None] * stride_xt + k[None, :], mask=mine[:, None] & k_ok[None, :], other=0.0)
            ab = tl.load(a_ptr + s * stride_as + n[None, :] * stride_an + k[:, None],
                         mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            if IEEE:  # float32 inputs: exact float32 products, not TF32
                acc += tl.dot(xb, ab, input_precision="ieee")
            else:
                acc += tl.dot(xb, ab)
    tl.store(out_ptr + pid_k * stride_split + rows[:, None] * stride_ot + n[None, :], acc,
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["T"])
def _expand_kernel(t_ptr, b_ptr, y_ptr, order_ptr, slots_ptr, T, N, P1, P2, SPLITS,
                   stride_split, stride_tt, stride_bs, stride_bn, stride_yt,
                   RANK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """Program (m, n): the tile's shrink (its split planes summed here, once) times each of its
    slots' B block, added into y."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < T
    tile_slots = tl.load(slots_ptr + m, mask=m_ok, other=-1)
    rows = tl.load(order_ptr + m, mask=m_ok, other=0).to(tl.int64)
    lo = tl.min(tl.where(tile_slots >= 0, tile_slots, _NO_SLOT))
    hi = tl.max(tile_slots)
    n0 = pid_n * BLOCK_N
    part = (n0 >= P1).to(tl.int32) + (n0 >= P2).to(tl.int32)  # BLOCK_N divides the part boundaries
    n = n0 + tl.arange(0, BLOCK_N)
    n_ok = n < N
    r = tl.arange(0, RANK)
    shrunk = tl.zeros((BLOCK_M, RANK), dtype=tl.float32)
    t_ptrs = t_ptr + rows[:, None] * stride_tt + part * RANK + r[None, :]
    for split in range(0, SPLITS):
        shrunk += tl.load(t_ptrs + split * stride_split, mask=m_ok[:, None], other=0.0)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in range(lo, hi + 1):
        mine = m_ok & (tile_slots == s)
        tb = tl.where(mine[:, None], shrunk, 0.0)
        bb = tl.load(b_ptr + s * stride_bs + n[None, :] * stride_bn + r[:, None],
                     mask=n_ok[None, :], other=0.0)
        if IEEE:  # float32 inputs: exact float32 products, not TF32
            acc += tl.dot(tb, bb, input_precision="ieee")
        else:
            acc += tl.dot(tb.to(bb.dtype), bb)
    write = (m_ok & (tile_slots >= 0))[:, None] & n_ok[None, :]
    y_ptrs = y_ptr + rows[:, None] * stride_yt + n[None, :]
    y = tl.load(y_ptrs, mask=write, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y.dtype), mask=write)


def _block_m(num_tokens: int) -> int:
    return 16 if num_tokens <= 512 else 64


def expand_block_n(part_starts: tuple[int, ...]) -> int:
    """The widest BLOCK_N (16..64) dividing every part boundary; 0 when none does."""
    for block in (64, 32, 16):
        if all(p % block == 0 for p in part_starts[:-1]):
            return block
    return 0


def lora_shrink(x: torch.Tensor, a: torch.Tensor, order: torch.Tensor, sorted_slots: torch.Tensor,
                ) -> torch.Tensor:
    """x[t] @ A[slot(t)]^T as float32 partial sums [splits, T, parts * R] (zeros for tokens
    without an adapter): K is split over up to 8 programs per tile, to fill the GPU at decode
    sizes, and `lora_expand` adds the planes (no atomics: the same result on every run). The
    split depends on shapes only (capture-safe)."""
    num_tokens, k = x.shape
    n = a.shape[1]
    block_m, block_n, block_k = _block_m(num_tokens), 16 if n <= 16 else 32, 64
    tiles = triton.cdiv(num_tokens, block_m) * triton.cdiv(n, block_n)
    splits = max(1, min(triton.cdiv(k, block_k), 1024 // tiles, _MAX_SPLITS))
    splits = 1 << (splits.bit_length() - 1)
    k_per_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    splits = triton.cdiv(k, k_per_split)
    partial = torch.empty(splits, num_tokens, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(num_tokens, block_m), triton.cdiv(n, block_n), splits)
    _shrink_kernel[grid](x, a, partial, order, sorted_slots, num_tokens, n, k, k_per_split,
                         x.stride(0), a.stride(0), a.stride(1), partial.stride(0), partial.stride(1),
                         BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=x.dtype == torch.float32)
    return partial


def lora_expand(shrunk: torch.Tensor, b: torch.Tensor, order: torch.Tensor, sorted_slots: torch.Tensor,
                y: torch.Tensor, part_starts: tuple[int, ...]) -> torch.Tensor:
    """y[t, part i] += shrunk[t, i * R:(i + 1) * R] @ B[slot(t), part i]^T, in place; `shrunk`:
    `lora_shrink`'s partial sums [splits, T, parts * R]."""
    num_tokens = shrunk.shape[1]
    n, rank = b.shape[1], b.shape[2]
    block_n = expand_block_n(part_starts)
    assert block_n and y.stride(1) == 1 and b.stride(2) == 1, "part boundaries must be multiples of 16"
    bounds = list(part_starts[1:-1]) + [_BIG] * (3 - len(part_starts) + 1)
    block_m = _block_m(num_tokens)
    grid = (triton.cdiv(num_tokens, block_m), triton.cdiv(n, block_n))
    _expand_kernel[grid](shrunk, b, y, order, sorted_slots, num_tokens, n, bounds[0], bounds[1], shrunk.shape[0],
                         shrunk.stride(0), shrunk.stride(1), b.stride(0), b.stride(1), y.stride(0),
                         RANK=rank, BLOCK_M=block_m, BLOCK_N=block_n, IEEE=b.dtype == torch.float32)
    return y
