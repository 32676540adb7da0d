"""Triton kernel: the rotary embedding and the KV-cache write of one layer in one launch.

Where q and k come straight from the fused qkv projection (no q/k norm), the rotary kernel
(`triton_ops.rotary`) and the KV write (`triton_kv_write`) are two launches per layer that each
read k; at batch 1 each is a few microseconds of launch and ramp, which do not shrink with tensor
parallelism. This kernel does both, two programs per token (so that at batch 1 the two halves of
the work run side by side, not one after the other):
- program 0: q's heads are rotated in place (the attention reads them next), exactly as `rotate_` does;
- program 1: k's heads are rotated in registers and stored, with v, into the paged cache at the token's slot
  (a slot of -1, padding, and rows past the slot mapping write nothing); k itself is left as it was
  (nothing reads it after the cache write).
Numerics are the two kernels' bit for bit: the same rounding of cos/sin and of each half, and the
cache store casts to the cache dtype. FP8 caches: k (rotated, rounded to q's dtype) and v are multiplied by
the inverse scales in float32 and saturated to the format's range, as `triton_kv_write` stores them.

Requires triton at import; `triton_backend` imports this module lazily.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.layers.attention.backend import check_v_transposable
from tokenmill.layers.triton_ops import pdl
from tokenmill.layers.triton_ops.rotary import _block_heads, _rotate_heads


@triton.jit
def _to_cache(x, inv_scale, cache_dtype: tl.constexpr, FP8_MAX: tl.constexpr):
    """x as the cache stores it: cast, or (FP8_MAX > 0) scaled in float32 and saturated, then cast."""
    if FP8_MAX > 0:
        x = tl.minimum(tl.maximum(x.to(tl.float32) * inv_scale, -FP8_MAX), FP8_MAX)
    return x.to(cache_dtype)


@triton.jit(do_not_specialize_on_alignment=["pos_ptr", "slot_ptr"])
def _rope_kv_write_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, slot_ptr, k_cache_ptr, v_cache_ptr, num_slots,
    inv_k_scale, inv_v_scale,  # fp8 caches (FP8_MAX > 0): what a stored value is multiplied by
    s_qt, s_qh, s_kt, s_kh, s_vt, s_vh,  # token and head strides of q, k, v (head_dim stride 1)
    s_cache,  # row stride of the cos/sin caches
    s_cb, s_cs, s_ch,  # KV cache strides: block, slot in block, head (head_dim stride 1)
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, KV_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_HQ: tl.constexpr,
    ROTARY_DIM: tl.constexpr, PASS: tl.constexpr, PASS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, FP8_MAX: tl.constexpr,
    V_TRANS: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # `pdl`: launched early, waits for the kernel before it before reading anything
    PREWAIT: tl.constexpr = False,  # the position, cos / sin and slot read before the PDL wait
):
    pdl.launch_dependents(USE_PDL)
    if not PREWAIT:
        pdl.wait(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    dtype = q_ptr.dtype.element_ty
    offs_d = tl.arange(0, HALF_PAD)
    d_ok = offs_d < HALF
    pos = tl.load(pos_ptr + t).to(tl.int64)
    c = tl.load(cos_ptr + pos * s_cache + offs_d, mask=d_ok, other=0.0).to(dtype).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + pos * s_cache + offs_d, mask=d_ok, other=0.0).to(dtype).to(tl.float32)[None, :]
    kv_prog = tl.program_id(1) == 1
    slot = tl.load(slot_ptr + t, mask=kv_prog & (t < num_slots), other=-1).to(tl.int64)  # rows past the mapping: none
    if PREWAIT:
        pdl.wait(USE_PDL)
    if not kv_prog:
        _rotate_heads(q_ptr + t * s_qt, s_qh, c, s, tl.arange(0, BLOCK_HQ), offs_d, d_ok, NUM_Q_HEADS, HALF, BLOCK_HQ)
        return
    if slot < 0:
        return
    cache_dtype = k_cache_ptr.dtype.element_ty
    h = tl.arange(0, KV_HEADS_PAD)[:, None]
    h_ok = h < NUM_KV_HEADS
    dst = (slot // BLOCK_SIZE) * s_cb + (slot % BLOCK_SIZE) * s_cs + h * s_ch
    # k: the rotary dims rotated half by half (as `_rotate_heads`), the rest passed through.
    mask = h_ok & d_ok[None, :]
    k_row = k_ptr + t * s_kt + h * s_kh
    x1 = tl.load(k_row + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(k_row + HALF + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    o1 = ((x1 * c).to(dtype).to(tl.float32) - x2 * s).to(dtype)
    o2 = ((x2 * c).to(dtype).to(tl.float32) + x1 * s).to(dtype)
    tl.store(k_cache_ptr + dst + offs_d[None, :], _to_cache(o1, inv_k_scale, cache_dtype, FP8_MAX), mask=mask)
    tl.store(k_cache_ptr + dst + HALF + offs_d[None, :], _to_cache(o2, inv_k_scale, cache_dtype, FP8_MAX), mask=mask)
    if PASS > 0:
        offs_p = ROTARY_DIM + tl.arange(0, PASS_PAD)[None, :]
        p_mask = h_ok & (offs_p < HEAD_DIM)
        tl.store(k_cache_ptr + dst + offs_p,
                 _to_cache(tl.load(k_row + offs_p, mask=p_mask), inv_k_scale, cache_dtype, FP8_MAX), mask=p_mask)
    offs_v = tl.arange(0, HEAD_DIM_PAD)[None, :]
    v_mask = h_ok & (offs_v < HEAD_DIM)
    v = tl.load(v_ptr + t * s_vt + h * s_vh + offs_v, mask=v_mask)
    if V_TRANS:  # [head, head_dim, slot] per block
        dst_v = (slot // BLOCK_SIZE) * s_cb + (h * HEAD_DIM + offs_v) * BLOCK_SIZE + slot % BLOCK_SIZE
    else:
        dst_v = dst + offs_v
    tl.store(v_cache_ptr + dst_v, _to_cache(v, inv_v_scale, cache_dtype, FP8_MAX), mask=v_mask)


def rotate_and_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                        cos_cache: torch.Tensor, sin_cache: torch.Tensor, rotary_dim: int,
                        kv_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: float = 1.0,
                        v_scale: float = 1.0, v_transposed: bool = False, prewait: bool = False) -> None:
    """q [T, Hq, D] rotated in place; k [T, Hkv, D] rotated and, with v, written into `kv_cache`
    ([2, num_blocks, block_size, Hkv, D]) at `slot_mapping` (its rows only); an FP8 cache stores
    k / k_scale and v / v_scale, saturated. `v_transposed`: values stored per block as [Hkv, D, block_size].
    `prewait` (under PDL): the token's position, its cos / sin rows and its slot (step inputs and
    constants: no kernel of the step writes them) are read before waiting for the kernel before it."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 3 or x.stride(-1) != 1:
            raise ValueError(f"{name} must be [T, heads, head_dim] with a contiguous head_dim axis, "
                             f"got shape {tuple(x.shape)} strides {x.stride()}")
    fp8 = kv_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    if positions.shape[0] < q.shape[0]:
        raise ValueError(f"{positions.shape[0]} positions for {q.shape[0]} tokens")
    num_tokens = q.shape[0]
    if num_tokens == 0:
        return
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    half = rotary_dim // 2
    half_pad = triton.next_power_of_2(max(half, 1))
    passed = head_dim - rotary_dim
    block_q = _block_heads(q.shape[1], half_pad)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    if v_transposed:
        check_v_transposable(kv_cache)
    tile = max(block_q * half_pad, triton.next_power_of_2(num_kv_heads) * triton.next_power_of_2(head_dim))
    _rope_kv_write_kernel[(num_tokens, 2)](
        q, k, v, positions, cos_cache, sin_cache, slot_mapping, k_cache, v_cache, min(num_tokens, slot_mapping.shape[0]),
        1.0 / k_scale, 1.0 / v_scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_cache.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_Q_HEADS=q.shape[1], NUM_KV_HEADS=num_kv_heads, KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HALF=half, HALF_PAD=half_pad, BLOCK_HQ=block_q, ROTARY_DIM=rotary_dim, PASS=passed,
        PASS_PAD=triton.next_power_of_2(max(passed, 1)), HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size,
        FP8_MAX=torch.finfo(kv_cache.dtype).max if fp8 else 0.0, V_TRANS=v_transposed, PREWAIT=prewait,
        num_warps=min(max(tile // 256, 1), 8), **pdl.launch_kwargs(q.device),
    )
