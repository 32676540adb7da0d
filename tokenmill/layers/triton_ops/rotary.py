"""Triton kernel: neox rotary embedding of q and k heads, in place, cos/sin read by position.

One program per token: it reads the token's position, its cos/sin row from the float32
caches (so no per-step gather of cos/sin exists), then rotates every head of q and of k in
tiles of heads: the first `rotary_dim` dims of each head as `x * cos + rotate_half(x) * sin`,
half by half. Dims past `rotary_dim` (partial rotary) are not touched at all.

Numerics are `tokenmill.layers.rotary.apply_rotary`'s, op for op: cos and sin rounded to the
activation dtype, then o1 = (x1 * cos rounded) - x2 * sin and o2 = (x2 * cos rounded) + x1 * sin,
each rounded once (torch's mul then addcmul_).

q and k are [T, heads, head_dim] views whose head_dim axis is contiguous, with any token and
head strides: the q and k heads inside the fused qkv projection rotate where they sit.
Positions must lie in [0, rows of the caches), as for the torch path's index_select.

Requires triton at import; `tokenmill.layers.rotary` imports this module lazily.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE_ELEMENTS = 4096  # half-head elements per tile of heads, at most


@triton.jit
def _rotate_heads(base_ptr, s_head, c, s, offs_h, offs_d, d_ok,
                  NUM_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    """Rotates heads [0, NUM_HEADS) at base_ptr + head * s_head, BLOCK_H heads at a time."""
    dtype = base_ptr.dtype.element_ty
    for first in tl.static_range(0, NUM_HEADS, BLOCK_H):
        heads = first + offs_h
        mask = (heads < NUM_HEADS)[:, None] & d_ok[None, :]
        ptrs1 = base_ptr + heads[:, None] * s_head + offs_d[None, :]
        ptrs2 = ptrs1 + HALF
        x1 = tl.load(ptrs1, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(ptrs2, mask=mask, other=0.0).to(tl.float32)
        o1 = (x1 * c).to(dtype).to(tl.float32) - x2 * s
        o2 = (x2 * c).to(dtype).to(tl.float32) + x1 * s
        tl.store(ptrs1, o1.to(dtype), mask=mask)
        tl.store(ptrs2, o2.to(dtype), mask=mask)


# `positions` may be a view at any offset into a packed input buffer (eager steps): its one scalar
# load gains nothing from alignment, so alignment must not make a second compiled variant.
@triton.jit(do_not_specialize_on_alignment=["pos_ptr"])
def _rotary_kernel(
    q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr,
    s_qt, s_qh, s_kt, s_kh,  # token and head strides of q and k (head_dim stride 1)
    s_cache,  # row stride of the cos/sin caches
    NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr,  # NUM_K_HEADS = 0: q only
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    dtype = q_ptr.dtype.element_ty
    offs_d = tl.arange(0, HALF_PAD)
    d_ok = offs_d < HALF
    pos = tl.load(pos_ptr + t).to(tl.int64)
    # cos/sin repeat over the two halves of the rotary dims: the first half is all there is to read.
    c = tl.load(cos_ptr + pos * s_cache + offs_d, mask=d_ok, other=0.0).to(dtype).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + pos * s_cache + offs_d, mask=d_ok, other=0.0).to(dtype).to(tl.float32)[None, :]
    _rotate_heads(q_ptr + t * s_qt, s_qh, c, s, tl.arange(0, BLOCK_HQ), offs_d, d_ok,
                  NUM_Q_HEADS, HALF, BLOCK_HQ)
    if NUM_K_HEADS > 0:
        _rotate_heads(k_ptr + t * s_kt, s_kh, c, s, tl.arange(0, BLOCK_HK), offs_d, d_ok,
                      NUM_K_HEADS, HALF, BLOCK_HK)


def _block_heads(num_heads: int, half_pad: int) -> int:
    return max(min(triton.next_power_of_2(max(num_heads, 1)), TILE_ELEMENTS // half_pad), 1)


def rotate_(q: torch.Tensor, k: torch.Tensor | None, positions: torch.Tensor, cos_cache: torch.Tensor,
            sin_cache: torch.Tensor, rotary_dim: int) -> None:
    """Rotates q ([T, Hq, D]) and k ([T, Hk, D], or None) in place, token t at `positions[t]`.

    cos_cache / sin_cache: [max_position, >= rotary_dim // 2], any float dtype, columns contiguous.
    """
    for name, x in (("q", q), ("k", k)):
        if x is not None and (x.dim() != 3 or x.stride(-1) != 1 or x.shape[-1] < rotary_dim):
            raise ValueError(f"{name} must be [T, heads, head_dim >= {rotary_dim}] with a contiguous "
                             f"head_dim axis, got shape {tuple(x.shape)} strides {x.stride()}")
    if k is not None and (k.shape[0] != q.shape[0] or k.dtype != q.dtype):
        raise ValueError("q and k must have the same tokens and dtype")
    if positions.shape[0] < q.shape[0]:
        raise ValueError(f"{positions.shape[0]} positions for {q.shape[0]} tokens")
    if cos_cache.stride(-1) != 1 or sin_cache.stride() != cos_cache.stride():
        raise ValueError("cos/sin caches must share one layout with contiguous columns")
    num_tokens = q.shape[0]
    if num_tokens == 0 or rotary_dim == 0:
        return
    half = rotary_dim // 2
    half_pad = triton.next_power_of_2(half)
    num_q, num_k = q.shape[1], 0 if k is None else k.shape[1]
    block_q, block_k = _block_heads(num_q, half_pad), _block_heads(num_k, half_pad)
    tile = max(block_q, block_k) * half_pad
    _rotary_kernel[(num_tokens,)](
        q, q if k is None else k, positions, cos_cache, sin_cache,
        q.stride(0), q.stride(1), 0 if k is None else k.stride(0), 0 if k is None else k.stride(1),
        cos_cache.stride(0),
        NUM_Q_HEADS=num_q, NUM_K_HEADS=num_k, HALF=half, HALF_PAD=half_pad, BLOCK_HQ=block_q, BLOCK_HK=block_k,
        num_warps=min(max(tile // 256, 1), 8),
    )
