"""Triton kernel: per-head RMSNorm (times its weight) and neox rotary of q and k, from float32
inputs (the qkv projection's unrounded result), rounded once into new half-precision q and k.

One program per token: its position's cos/sin row is read from the float32 caches (not rounded),
then every head of q and of k, in tiles of heads: the head's mean square over head_dim, then
`y = x * rsqrt(mean + eps) * w` (w: the norm's float32 factor), the first `rotary_dim` dims
rotated half by half (`y1 * cos - y2 * sin`, `y2 * cos + y1 * sin`), the rest passed through.
Everything in float32; the stores round once. The torch reference is
`tokenmill.layers.qk_norm.norm_rope_reference` (same formula; summation order and rsqrt's last
bit may differ).

q and k are [T, heads, head_dim] float32 views with a contiguous head_dim axis and any token and
head strides (they sit inside the float32 qkv). Requires triton at import.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE_ELEMENTS = 4096  # elements of one tile of heads, at most


@triton.jit
def _norm_rotate_heads(src, s_h, dst, d_h, w_ptr, eps, c, s, offs_h, offs_d, offs_r,
                       NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
                       ROT: tl.constexpr, BLOCK_H: tl.constexpr):
    dtype = dst.dtype.element_ty
    d_ok = offs_d < HEAD_DIM
    r_ok = offs_r < HALF
    w = tl.load(w_ptr + offs_d, mask=d_ok, other=0.0)[None, :]
    w1 = tl.load(w_ptr + offs_r, mask=r_ok, other=0.0)[None, :]
    w2 = tl.load(w_ptr + HALF + offs_r, mask=r_ok, other=0.0)[None, :]
    for first in tl.static_range(0, NUM_HEADS, BLOCK_H):
        heads = first + offs_h
        h_ok = (heads < NUM_HEADS)[:, None]
        row_ptr = src + heads[:, None] * s_h
        out_ptr = dst + heads[:, None] * d_h
        x = tl.load(row_ptr + offs_d[None, :], mask=h_ok & d_ok[None, :], other=0.0)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)[:, None]
        m = h_ok & r_ok[None, :]
        y1 = tl.load(row_ptr + offs_r[None, :], mask=m, other=0.0) * rstd * w1
        y2 = tl.load(row_ptr + HALF + offs_r[None, :], mask=m, other=0.0) * rstd * w2
        tl.store(out_ptr + offs_r[None, :], (y1 * c - y2 * s).to(dtype), mask=m)
        tl.store(out_ptr + HALF + offs_r[None, :], (y2 * c + y1 * s).to(dtype), mask=m)
        # Dims past rotary_dim (partial rotary): normalized, not rotated.
        tl.store(out_ptr + offs_d[None, :], (x * rstd * w).to(dtype), mask=h_ok & d_ok[None, :] & (offs_d >= ROT)[None, :])


@triton.jit(do_not_specialize_on_alignment=["pos_ptr"])
def _qk_norm_rope_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, wq_ptr, wk_ptr, pos_ptr, cos_ptr, sin_ptr, eps_q, eps_k,
                         s_qt, s_qh, s_kt, s_kh, s_qot, s_qoh, s_kot, s_koh, s_cache,
                         NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                         D_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr, ROT: tl.constexpr,
                         BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, D_PAD)
    offs_r = tl.arange(0, HALF_PAD)
    r_ok = offs_r < HALF
    pos = tl.load(pos_ptr + t).to(tl.int64)
    c = tl.load(cos_ptr + pos * s_cache + offs_r, mask=r_ok, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + pos * s_cache + offs_r, mask=r_ok, other=0.0).to(tl.float32)[None, :]
    _norm_rotate_heads(q_ptr + t * s_qt, s_qh, qo_ptr + t * s_qot, s_qoh, wq_ptr, eps_q, c, s,
                       tl.arange(0, BLOCK_HQ), offs_d, offs_r, NUM_Q_HEADS, HEAD_DIM, HALF, ROT, BLOCK_HQ)
    _norm_rotate_heads(k_ptr + t * s_kt, s_kh, ko_ptr + t * s_kot, s_koh, wk_ptr, eps_k, c, s,
                       tl.arange(0, BLOCK_HK), offs_d, offs_r, NUM_K_HEADS, HEAD_DIM, HALF, ROT, BLOCK_HK)


def _block_heads(num_heads: int, d_pad: int) -> int:
    return max(min(triton.next_power_of_2(max(num_heads, 1)), TILE_ELEMENTS // d_pad), 1)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, eps_q: float, eps_k: float,
                 positions: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor, rotary_dim: int,
                 out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """New contiguous (q, k) in `out_dtype`: q [T, Hq, D] and k [T, Hk, D] (float32) normalized by
    wq / wk (float32 [D]) and rotated at `positions` (cos/sin caches: float32 [rows, >= rotary_dim // 2])."""
    for name, x in (("q", q), ("k", k)):
        if x.dim() != 3 or x.stride(-1) != 1 or x.dtype != torch.float32:
            raise ValueError(f"{name} must be float32 [T, heads, head_dim] with a contiguous head_dim axis, "
                             f"got {x.dtype} shape {tuple(x.shape)} strides {x.stride()}")
    num_tokens, num_q, head_dim = q.shape
    if k.shape[0] != num_tokens or k.shape[2] != head_dim:
        raise ValueError(f"k {tuple(k.shape)} does not match q {tuple(q.shape)}")
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"rotary_dim must be even and in (0, head_dim={head_dim}], got {rotary_dim}")
    if positions.shape[0] < num_tokens:
        raise ValueError(f"{positions.shape[0]} positions for {num_tokens} tokens")
    if cos_cache.stride(-1) != 1 or sin_cache.stride() != cos_cache.stride():
        raise ValueError("cos/sin caches must share one layout with contiguous columns")
    num_k = k.shape[1]
    q_out = torch.empty((num_tokens, num_q, head_dim), dtype=out_dtype, device=q.device)
    k_out = torch.empty((num_tokens, num_k, head_dim), dtype=out_dtype, device=q.device)
    if num_tokens == 0:
        return q_out, k_out
    d_pad = triton.next_power_of_2(head_dim)
    half = rotary_dim // 2
    block_q, block_k = _block_heads(num_q, d_pad), _block_heads(num_k, d_pad)
    _qk_norm_rope_kernel[(num_tokens,)](
        q, k, q_out, k_out, wq.float().contiguous(), wk.float().contiguous(), positions, cos_cache, sin_cache,
        float(eps_q), float(eps_k),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), q_out.stride(0), q_out.stride(1),
        k_out.stride(0), k_out.stride(1), cos_cache.stride(0),
        NUM_Q_HEADS=num_q, NUM_K_HEADS=num_k, HEAD_DIM=head_dim, D_PAD=d_pad, HALF=half,
        HALF_PAD=triton.next_power_of_2(half), ROT=rotary_dim, BLOCK_HQ=block_q, BLOCK_HK=block_k,
        num_warps=min(max(max(block_q, block_k) * d_pad // 256, 1), 8),
    )
    return q_out, k_out
