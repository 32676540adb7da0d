"""Triton kernel: write a step's new K and V into the paged KV cache by slot mapping.

One program per token row, all of its KV heads at once. A slot of -1 (padding)
writes nothing, so rows padded for a fixed batch shape leave the cache as it was.
Values are cast to the cache dtype on store; an fp8 cache stores k * inv_k_scale and
v * inv_v_scale saturated to the format's range (FP8_MAX). V_TRANS (`v_transposed`): each block's
values are stored [head, head_dim, slot] (see `backend.transpose_v_blocks`), keys as always.

Requires triton at import; `triton_backend` imports this module lazily.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.layers.attention.backend import check_v_transposable


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, inv_k_scale, inv_v_scale,
    s_kt, s_kh, s_vt, s_vh,  # new k / v strides: token, head (the head_dim stride is 1)
    s_cb, s_cs, s_ch,  # cache strides: block, slot in block, head (the head_dim stride is 1)
    NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, FP8_MAX: tl.constexpr,
    V_TRANS: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, HEAD_DIM_PAD)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    dst = block * s_cb + offset * s_cs + h * s_ch + d
    k = tl.load(k_ptr + t.to(tl.int64) * s_kt + h * s_kh + d, mask=mask)
    v = tl.load(v_ptr + t.to(tl.int64) * s_vt + h * s_vh + d, mask=mask)
    if FP8_MAX > 0:
        k = tl.minimum(tl.maximum(k.to(tl.float32) * inv_k_scale, -FP8_MAX), FP8_MAX)
        v = tl.minimum(tl.maximum(v.to(tl.float32) * inv_v_scale, -FP8_MAX), FP8_MAX)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    if V_TRANS:
        dst = block * s_cb + (h * HEAD_DIM + d) * BLOCK_SIZE + offset
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale: float = 1.0, v_scale: float = 1.0, v_transposed: bool = False) -> None:
    """k, v: [T, num_kv_heads, head_dim]; kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]
    (`v_transposed`: its values stored per block as [num_kv_heads, head_dim, block_size]).

    Rows past `slot_mapping`'s length are not written (a shorter slot mapping covers only real rows).
    """
    num_rows = min(k.shape[0], slot_mapping.shape[0])
    if num_rows == 0:
        return
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    if v_transposed:
        check_v_transposable(kv_cache)
    fp8 = kv_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    _write_kv_kernel[(num_rows,)](
        k, v, k_cache, v_cache, slot_mapping, 1.0 / k_scale, 1.0 / v_scale,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size,
        FP8_MAX=torch.finfo(kv_cache.dtype).max if fp8 else 0.0, V_TRANS=v_transposed,
    )
