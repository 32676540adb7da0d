"""Triton kernels for multi-head latent attention over the paged latent cache (see `mla.py`).

`_mla_write_kernel`: one program per token writes [latent | k_pe] at its slot (slot -1: padding,
skipped). `_mla_attention_kernel`: grid (row, head block). A row is one query token of the flat
batch; it finds its sequence by counting query_start_loc entries <= row (on the device), and
attends causally to keys 0..context + its index, BLOCK_N keys at a time (looked up key by key in
the block table), BLOCK_H heads sharing each latent tile load: scores = q_lat . c + q_pe . k_pe,
an online softmax in float32 (log2 domain), acc += p . c. Rows past the last sequence are
zeroed. The grid depends only on the padded row count and the head count: capture-safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
SEARCH_CHUNK = 128


@triton.jit
def _mla_write_kernel(latent_ptr, pe_ptr, slots_ptr, cache_ptr, s_lt, s_pt,
                      KV_LORA: tl.constexpr, ROPE: tl.constexpr, KV_PAD: tl.constexpr, ROPE_PAD: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t)
    if slot < 0:
        return
    dst = cache_ptr + slot * (KV_LORA + ROPE)
    offs = tl.arange(0, KV_PAD)
    lat = tl.load(latent_ptr + t * s_lt + offs, mask=offs < KV_LORA)
    tl.store(dst + offs, lat.to(cache_ptr.dtype.element_ty), mask=offs < KV_LORA)
    offs_r = tl.arange(0, ROPE_PAD)
    pe = tl.load(pe_ptr + t * s_pt + offs_r, mask=offs_r < ROPE)
    tl.store(dst + KV_LORA + offs_r, pe.to(cache_ptr.dtype.element_ty), mask=offs_r < ROPE)


def mla_write(kv_cache: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor, slots: torch.Tensor) -> None:
    num_rows = min(latent.shape[0], slots.shape[0])
    if num_rows == 0:
        return
    kv_lora, rope = latent.shape[-1], k_pe.shape[-1]
    _mla_write_kernel[(num_rows,)](latent, k_pe, slots, kv_cache, latent.stride(0), k_pe.stride(0),
                                   KV_LORA=kv_lora, ROPE=rope, KV_PAD=triton.next_power_of_2(kv_lora),
                                   ROPE_PAD=triton.next_power_of_2(rope))


@triton.jit(do_not_specialize=["num_seqs", "num_heads", "s_bt"])
def _mla_attention_kernel(q_lat_ptr, q_pe_ptr, cache_ptr, out_ptr, qsl_ptr, seq_lens_ptr, block_table_ptr,
                          qk_scale, num_seqs, num_heads, s_ql_t, s_ql_h, s_qp_t, s_qp_h, s_ot, s_oh, s_bt,
                          KV_LORA: tl.constexpr, ROPE: tl.constexpr, KV_PAD: tl.constexpr, ROPE_PAD: tl.constexpr,
                          BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                          SEARCH: tl.constexpr, DOT_PRECISION: tl.constexpr):
    row = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_valid = heads < num_heads
    offs_l = tl.arange(0, KV_PAD)
    offs_r = tl.arange(0, ROPE_PAD)
    l_valid = offs_l < KV_LORA
    r_valid = offs_r < ROPE
    # The row's sequence: how many of query_start_loc[1..num_seqs] are <= row.
    seq = row * 0
    for start in range(1, num_seqs + 1, SEARCH):
        i = start + tl.arange(0, SEARCH)
        ends = tl.load(qsl_ptr + i, mask=i <= num_seqs, other=2147483647)
        seq += tl.sum((ends <= row).to(tl.int32), axis=0)
    out_rows = out_ptr + row.to(tl.int64) * s_ot + heads[:, None] * s_oh + offs_l[None, :]
    out_mask = head_valid[:, None] & l_valid[None, :]
    if seq >= num_seqs:  # padding row
        tl.store(out_rows, tl.zeros([BLOCK_H, KV_PAD], dtype=out_ptr.dtype.element_ty), mask=out_mask)
        return
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    kv_len = seq_len - q_len + (row - q_start) + 1  # causal: keys 0..context + query index
    cache_dtype = cache_ptr.dtype.element_ty
    q_lat = tl.load(q_lat_ptr + row.to(tl.int64) * s_ql_t + heads[:, None] * s_ql_h + offs_l[None, :],
                    mask=out_mask, other=0.0).to(cache_dtype)
    q_pe = tl.load(q_pe_ptr + row.to(tl.int64) * s_qp_t + heads[:, None] * s_qp_h + offs_r[None, :],
                   mask=head_valid[:, None] & r_valid[None, :], other=0.0).to(cache_dtype)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, KV_PAD], dtype=tl.float32)
    table_row = block_table_ptr + seq.to(tl.int64) * s_bt
    offs_n = tl.arange(0, BLOCK_N)
    for k0 in range(0, kv_len, BLOCK_N):
        keys = k0 + offs_n
        key_valid = keys < kv_len
        block = tl.load(table_row + keys // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        entry = cache_ptr + (block * BLOCK_SIZE + keys % BLOCK_SIZE) * (KV_LORA + ROPE)
        c = tl.load(entry[:, None] + offs_l[None, :], mask=key_valid[:, None] & l_valid[None, :], other=0.0)
        pe = tl.load(entry[:, None] + KV_LORA + offs_r[None, :], mask=key_valid[:, None] & r_valid[None, :],
                     other=0.0)
        s = tl.dot(q_lat, tl.trans(c), input_precision=DOT_PRECISION)
        s = tl.dot(q_pe, tl.trans(pe), s, input_precision=DOT_PRECISION) * qk_scale
        s = tl.where(key_valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(cache_dtype), c, acc, input_precision=DOT_PRECISION)
        m_i = m_new
    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a graph's padding sequence (no keys): zeros
    tl.store(out_rows, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def mla_attention(q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                  seq_lens: torch.Tensor, block_table: torch.Tensor, scale: float, kv_lora_rank: int,
                  block_n: int | None = None) -> torch.Tensor:
    """q_lat [T, H, L], q_pe [T, H, R] (rows past query_start_loc[-1]: padding) -> o_lat [T, H, L]."""
    num_rows, num_heads, _ = q_lat.shape
    rope = q_pe.shape[-1]
    out = torch.empty(q_lat.shape, dtype=q_lat.dtype, device=q_lat.device)
    if num_rows == 0:
        return out
    block_h = max(16, min(64, triton.next_power_of_2(num_heads)))
    kv_pad = triton.next_power_of_2(kv_lora_rank)
    block_n = block_n or (16 if kv_pad >= 512 else 32)
    precision = "ieee" if q_lat.dtype == torch.float32 else "tf32"
    grid = (num_rows, triton.cdiv(num_heads, block_h))
    _mla_attention_kernel[grid](
        q_lat, q_pe, kv_cache, out, query_start_loc, seq_lens, block_table, scale * LOG2E,
        seq_lens.shape[0], num_heads, q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1),
        out.stride(0), out.stride(1), block_table.stride(0),
        KV_LORA=kv_lora_rank, ROPE=rope, KV_PAD=kv_pad, ROPE_PAD=triton.next_power_of_2(rope),
        BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_SIZE=kv_cache.shape[2], SEARCH=SEARCH_CHUNK,
        DOT_PRECISION=precision, num_warps=4)
    return out
