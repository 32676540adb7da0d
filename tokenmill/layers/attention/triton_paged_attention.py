"""Triton kernels: causal attention over the paged KV cache for a whole mixed batch in one launch.

Grid (query tile, KV head, KV split). A query tile is up to BLOCK_Q consecutive
query tokens of ONE sequence, times the GROUP query heads that share the KV head
(GQA): BLOCK_Q * GROUP_PAD rows sharing every K/V tile load. Sequence i owns the
tiles [first_tile(i), first_tile(i+1)) with first_tile(i) = qsl[i] // BLOCK_Q + i,
which is at least ceil(q_len / BLOCK_Q) tiles; the extra ones exit at once. So
the grid depends only on the padded row count and the number of sequences:
num_rows // BLOCK_Q + num_seqs + 1 tiles (the spare ones, past the last
sequence, zero the padding rows), and every program finds its sequence by
counting first_tile values <= its tile id, reading query_start_loc on the device.

Each program walks the KV tiles (BLOCK_N keys, looked up key by key in the block
table, so any block size works) up to its last query's causal limit
(context + query index), with an online softmax in float32 (log2 domain). Tiles that every row
of the query tile sees whole (INTERIOR) are walked without masks; only the tiles at the window's
start and the causal edge are masked.
A sliding window W (`window`; a huge value means none) masks keys <= query - W, and
the walk starts at the tile holding the first key the tile's first query sees: keys
before it are neither loaded nor looked up in the block table (the KV manager may
have given their blocks to another request). SOFTCAP: scores become
softcap * tanh(scores / softcap) before the softmax (Gemma 2). SINKS: each head's sink logit
(`sinks_ptr`, float32 [NUM_HEADS]) joins the softmax's denominator at the end (with the split
partials merged, in the reduce kernel): l += exp(sink - m), with the running max raised to the
sink first where the sink is larger (gpt-oss).

FP8 KV cache: K/V tiles are converted to the query's dtype as they load (float16 when the query
is bf16 or fp16: the cheap conversion of fp8; the query is converted once); k_scale joins the
softmax scale and v_scale multiplies the accumulator (both host floats, the layer's). CVT_ON_LOAD
(1: keys and values, 2: values only) pins the conversion where the tile loads; V_TRANS reads a cache
whose value blocks are stored [head, head_dim, slot] (slots contiguous: p @ v without a transpose). F8_QK (opt-in,
e4m3 caches): the keys enter q . k unconverted, as two fp8 dots with the query split into two
fp8 terms scaled per row (about bf16's precision), saving one conversion per key value. F8_PV
(opt-in, e4m3 caches) does the same for p @ v: p scaled to 448 as two e4m3 terms, the values
unconverted, the 448 divided out with v_scale. (H200: neither is faster than converting, except
pipelined through shared memory, where they tie; docs/results/gpu-attention.md.)

Split-KV (flash-decoding): with SPLIT, a program takes only its share of the KV
tiles (num_splits shares, sized on the device from seq_len, so any seq_len is
right) and writes partial (max, sum, unnormalised acc); `_reduce_splits_kernel`
merges the shares and writes the output, zeros for padding rows. (Merging in the last split
program instead, one launch less, lost on H200s in sessions 9 and 10; retired in session 11.)

PREWAIT (decode launches under PDL, `triton_backend.DecodeTiles.prewait`): at batch 1 a program's
work is one KV tile (~100 keys of one KV head), a chain of dependent reads (the step's sizes, the
block table, K, V) that started only when the KV write before it had finished. With PREWAIT a
program reads the step's inputs (query_start_loc, seq_lens, the block table: written before the
forward's first kernel, by non-PDL kernels or copies) and the K/V of its first tile's keys cached
before this step (written by earlier steps) before its PDL wait, while the qkv GEMV and the KV
write still run; after the wait it reads q and the tile's keys of this step (the KV write's
slots), then walks the rest of its tiles as before. (No kernel in the step writes a slot below the
context: the step's KV write takes the slots of its own queries' positions.) Programs with nothing to
do exit without waiting, except program (0, 0, 0): the grid never completes before the kernel before
it, so a kernel waiting for this one still finds every earlier kernel done (`pdl`'s transitivity).

ROPE (with PREWAIT, one query a sequence: `paged_attention`'s `rope`): no rotary + KV write launch
before this one. Each program reads its rows' positions and cos / sin rows and the step's slot before
the wait, rotates q in registers after it (q itself stays unrotated: nothing reads it after), and
makes this step's key (rotated) and value from the qkv projection's k and v; the program whose
share holds the key's tile (the last one) writes them into the cache and merges them into that tile
(attended last), never reading that slot back.

Requires triton at import; `triton_backend` imports this module lazily.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from tokenmill.layers.attention.backend import check_v_transposable
from tokenmill.layers.quantization.triton_x_permute import kperm_dst
from tokenmill.layers.triton_ops import pdl

LOG2E = 1.4426950408889634
SEARCH_CHUNK = 256  # query_start_loc entries read per step of the sequence search (a 256-row batch: one)
REDUCE_CHUNK = 32  # split partials merged per step of the reduce
F8_P_SCALE = 448.0  # fp8_pv_dot: softmax weights (<= 1) scaled to e4m3's largest value
NO_WINDOW = 1 << 30  # the window of a full-attention layer: wider than any context
CVT_KV, CVT_VALUES = 1, 2  # fp8_convert_on_load: keys and values, or the values only
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"  # no inline PTX under the interpreter


@triton.jit
def _fp8_to_f16(x, E5M2: tl.constexpr, PTX: tl.constexpr):
    """An fp8 tile to float16 where it stands (CVT_ON_LOAD): the conversion instruction in inline PTX
    marked impure (4 values per call), which the compiler cannot move past the tile's layout change
    for the dot, so that change moves 16-bit values (ldmatrix, transposed for V) instead of reading
    the fp8 tile back byte by byte. Without PTX (TRITON_INTERPRET) the plain conversion: the same values."""
    if PTX:
        fmt: tl.constexpr = "e5m2x2" if E5M2 else "e4m3x2"
        return tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2." + fmt + " $0, lo; cvt.rn.f16x2." + fmt
            + " $1, hi; }", "=r,=r,r", [x.to(tl.uint8, bitcast=True)], dtype=tl.float16, is_pure=False, pack=4)
    return x.to(tl.float16)


@triton.jit
def _find_sequence(qsl_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr, CHUNK: tl.constexpr):
    """The sequence owning `tile`: how many of first_tile(1..num_seqs) are <= tile.

    Returns num_seqs for the spare tiles past the last sequence.
    """
    count = tile * 0
    for start in range(1, num_seqs + 1, CHUNK):
        i = start + tl.arange(0, CHUNK)
        in_range = i <= num_seqs
        first_tile = tl.load(qsl_ptr + i, mask=in_range, other=0) // BLOCK_Q + i
        count += tl.sum(((first_tile <= tile) & in_range).to(tl.int32), axis=0)
    return count


@triton.jit
def _tile_offsets(j, table_row, kv_head, kv_len, kv_lo, s_cb, s_cs, s_ch,
                  BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr,
                  LOOKUP_BLOCKS: tl.constexpr):
    """Keys j*BLOCK_N .. of the tile, which of them are valid (all, unmasked) and their cache offsets.
    LOOKUP_BLOCKS (unmasked tiles, BLOCK_N a multiple of BLOCK_SIZE): one block-table read per cache
    block of the tile, its slots' offsets spread from it, instead of one read per key."""
    offs_n = tl.arange(0, BLOCK_N)
    key = j * BLOCK_N + offs_n
    if MASKED:
        key_valid = (key < kv_len) & (key >= kv_lo)
        block = tl.load(table_row + key // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        kv_off = block * s_cb + (key % BLOCK_SIZE) * s_cs + kv_head * s_ch
    else:
        key_valid = offs_n < BLOCK_N
        if LOOKUP_BLOCKS:
            NB: tl.constexpr = BLOCK_N // BLOCK_SIZE
            blocks = tl.load(table_row + j * NB + tl.arange(0, NB)).to(tl.int64)
            slot_off = blocks[:, None] * s_cb + tl.arange(0, BLOCK_SIZE)[None, :] * s_cs
            kv_off = tl.reshape(slot_off, [BLOCK_N]) + kv_head * s_ch
        else:
            block = tl.load(table_row + key // BLOCK_SIZE).to(tl.int64)
            kv_off = block * s_cb + (key % BLOCK_SIZE) * s_cs + kv_head * s_ch
    return key, key_valid, kv_off


@triton.jit
def _load_rows(cache_ptr, kv_off, key_valid, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
               MASKED: tl.constexpr):
    """One tile of K or V rows at `kv_off` (masked: invalid keys and head_dim padding read 0)."""
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    if HEAD_DIM == HEAD_DIM_PAD and not MASKED:
        x = tl.load(cache_ptr + kv_off[:, None] + offs_d[None, :])
    else:
        x = tl.load(cache_ptr + kv_off[:, None] + offs_d[None, :],
                    mask=key_valid[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    return x


@triton.jit
def _load_v_rows(v_cache_ptr, kv_off, key, key_valid, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                 MASKED: tl.constexpr, V_TRANS: tl.constexpr, BLOCK_SIZE: tl.constexpr, SLOT_STRIDE: tl.constexpr):
    """One tile of V rows [keys, head_dim]. V_TRANS: the cache holds each block's values as
    [head, head_dim, slot] (slots contiguous; `v_cache_ptr` already points at this program's head), so
    the tile's keys come in contiguous runs of BLOCK_SIZE: the p @ v dot takes this keys-contiguous
    operand as it is (no transpose through shared memory). (Loaded [head_dim, keys] and transposed with
    tl.trans instead, triton 3.6 spilled the kernel: 584 bytes of stack.)
    `kv_off` is the row layout's offset (block, slot, head); SLOT_STRIDE that layout's slot stride."""
    if V_TRANS:
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        slot = key % BLOCK_SIZE
        vt_off = kv_off + slot * (1 - SLOT_STRIDE)  # block * s_cb + slot (the head: in the pointer)
        if MASKED or HEAD_DIM != HEAD_DIM_PAD:
            x = tl.load(v_cache_ptr + vt_off[:, None] + offs_d[None, :] * BLOCK_SIZE,
                        mask=key_valid[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
        else:
            # A tile of whole blocks (a power of two of slots): its keys come in runs of BLOCK_SIZE
            # contiguous values starting at a multiple of BLOCK_SIZE (the cache's block stride and a
            # head's run, head_dim * BLOCK_SIZE, are), which the compiler cannot see through the table.
            if key.shape[0] % BLOCK_SIZE == 0 and (BLOCK_SIZE & (BLOCK_SIZE - 1)) == 0:
                vt_off = tl.max_contiguous(tl.multiple_of(vt_off, BLOCK_SIZE), BLOCK_SIZE)
            x = tl.load(v_cache_ptr + vt_off[:, None] + offs_d[None, :] * BLOCK_SIZE)
        return x
    return _load_rows(v_cache_ptr, kv_off, key_valid, HEAD_DIM, HEAD_DIM_PAD, MASKED)


@triton.jit
def _softmax_step(q, q_lo, row_scale, m_i, l_i, k, key, key_valid, key_limit, window, softcap, qk_scale,
                  DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr, KV_FP8: tl.constexpr,
                  MASKED: tl.constexpr, F8_QK: tl.constexpr, CVT_ON_LOAD: tl.constexpr, E5M2: tl.constexpr):
    """Scores of one K tile into the online softmax: (p, alpha, new max, new sum).
    F8_QK: q and q_lo are the query's two fp8 terms (q * scale = q + q_lo, row_scale = 1 / scale per
    row), and the fp8 keys enter the dot unconverted."""
    if F8_QK:
        s = (tl.dot(q, tl.trans(k)) + tl.dot(q_lo, tl.trans(k))) * (qk_scale * row_scale)[:, None]
    else:
        if KV_FP8 and CVT_ON_LOAD != 1:  # (CVT_ON_LOAD 1: the rows came in as float16, the queries' dtype)
            k = k.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if SOFTCAP:  # in the log2 domain: cap' = softcap * log2(e); tanh(x) = 1 - 2 / (exp(2x) + 1)
        cap = softcap * 1.4426950408889634
        s = cap * (1.0 - 2.0 / (tl.exp2(2.0 * s / cap * 1.4426950408889634) + 1.0))
    if MASKED:
        visible = ((key[None, :] <= key_limit[:, None]) & (key[None, :] > key_limit[:, None] - window)
                   & key_valid[None, :])
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet: no NaN
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_i


@triton.jit
def _accumulate(acc, alpha, p, v, q_dtype: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
                F8_QK: tl.constexpr, F8_PV: tl.constexpr, CVT_ON_LOAD: tl.constexpr, E5M2: tl.constexpr):
    """acc * alpha + p @ v. F8_PV (e4m3 values): p (<= 1) scaled to 448 as two e4m3 terms, hi + lo
    (about bf16's precision), against the unconverted values: the accumulator carries the factor
    448, which the caller divides out with v_scale."""
    if F8_PV:
        ps = p * 448.0  # F8_P_SCALE
        p_hi = ps.to(v.dtype)
        p_lo = (ps - p_hi.to(tl.float32)).to(v.dtype)
        return acc * alpha[:, None] + tl.dot(p_hi, v) + tl.dot(p_lo, v)
    if CVT_ON_LOAD != 0:  # the rows came in as float16
        pass
    elif F8_QK:
        v = v.to(tl.float16)
    elif KV_FP8:
        v = v.to(q_dtype)
    return acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)


@triton.jit
def _attend_rows(q, q_lo, row_scale, m_i, l_i, acc, key, key_valid, kv_off, k_cache_ptr, v_cache_ptr,
                 key_limit, window, softcap, qk_scale, BLOCK_N: tl.constexpr,
                 HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 SOFTCAP: tl.constexpr, KV_FP8: tl.constexpr, MASKED: tl.constexpr, F8_QK: tl.constexpr,
                 F8_PV: tl.constexpr, EARLY_V: tl.constexpr, CVT_ON_LOAD: tl.constexpr, E5M2: tl.constexpr,
                 PTX: tl.constexpr, V_TRANS: tl.constexpr, BLOCK_SIZE: tl.constexpr, SLOT_STRIDE: tl.constexpr):
    """The keys of one tile (cache offsets `kv_off`) into the online softmax. EARLY_V: the V rows are
    loaded with the K rows, before the scores (both loads in flight at once)."""
    k = _load_rows(k_cache_ptr, kv_off, key_valid, HEAD_DIM, HEAD_DIM_PAD, MASKED)
    if CVT_ON_LOAD == 1:  # (2: the values only; the keys convert after their layout change, which reads
        k = _fp8_to_f16(k, E5M2, PTX)  # them from shared memory as wide loads: no transpose for q . k)
    if EARLY_V:
        v = _load_v_rows(v_cache_ptr, kv_off, key, key_valid, HEAD_DIM, HEAD_DIM_PAD, MASKED, V_TRANS, BLOCK_SIZE,
                         SLOT_STRIDE)
        if CVT_ON_LOAD != 0:
            v = _fp8_to_f16(v, E5M2, PTX)
    p, alpha, m_new, l_i = _softmax_step(q, q_lo, row_scale, m_i, l_i, k, key, key_valid, key_limit, window,
                                         softcap, qk_scale, DOT_PRECISION, SOFTCAP, KV_FP8, MASKED, F8_QK, CVT_ON_LOAD,
                                         E5M2)
    if not EARLY_V:
        v = _load_v_rows(v_cache_ptr, kv_off, key, key_valid, HEAD_DIM, HEAD_DIM_PAD, MASKED, V_TRANS, BLOCK_SIZE,
                         SLOT_STRIDE)
        if CVT_ON_LOAD != 0:
            v = _fp8_to_f16(v, E5M2, PTX)
    acc = _accumulate(acc, alpha, p, v, q.dtype, DOT_PRECISION, KV_FP8, F8_QK, F8_PV, CVT_ON_LOAD, E5M2)
    return m_new, l_i, acc


@triton.jit
def _attend_tile(q, q_lo, row_scale, m_i, l_i, acc, j, k_cache_ptr, v_cache_ptr, table_row, kv_head, kv_len, kv_lo,
                 key_limit, window, softcap, qk_scale, s_cb, s_cs, s_ch,
                 BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                 HEAD_DIM_PAD: tl.constexpr, DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr,
                 KV_FP8: tl.constexpr, MASKED: tl.constexpr, LOOKUP_BLOCKS: tl.constexpr, F8_QK: tl.constexpr,
                 F8_PV: tl.constexpr, EARLY_V: tl.constexpr, CVT_ON_LOAD: tl.constexpr, E5M2: tl.constexpr,
                 PTX: tl.constexpr, V_TRANS: tl.constexpr, SLOT_STRIDE: tl.constexpr):
    """One KV tile (keys j*BLOCK_N ..) into the online softmax. MASKED=False: the caller vouches that
    every key of the tile is valid and visible to every row (no masks, no table-load guard)."""
    key, key_valid, kv_off = _tile_offsets(j, table_row, kv_head, kv_len, kv_lo, s_cb, s_cs, s_ch,
                                           BLOCK_N, BLOCK_SIZE, MASKED, LOOKUP_BLOCKS)
    return _attend_rows(q, q_lo, row_scale, m_i, l_i, acc, key, key_valid, kv_off, k_cache_ptr, v_cache_ptr,
                        key_limit, window, softcap, qk_scale, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, DOT_PRECISION, SOFTCAP,
                        KV_FP8, MASKED, F8_QK, F8_PV, EARLY_V, CVT_ON_LOAD, E5M2, PTX, V_TRANS, BLOCK_SIZE,
                        SLOT_STRIDE)


@triton.jit
def _preload_tile(j, tile_hi, table_row, kv_head, kv_len, kv_lo, context, k_cache_ptr, v_cache_ptr, s_cb, s_cs, s_ch,
                  BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                  V_TRANS: tl.constexpr, SLOT_STRIDE: tl.constexpr):
    """PREWAIT, before the PDL wait: tile j's (none where j >= tile_hi) block-table lookups and the K/V
    rows of its keys cached before this step (key < context): neither the block table nor those
    slots is written by any kernel of the step (module docstring). Returns the tile's keys, which
    are valid (seen by some row of the tile), their cache offsets, and the K / V rows (zero for the
    keys this step writes: `_complete_tile` loads them after the wait)."""
    key, valid, kv_off = _tile_offsets(j, table_row, kv_head, kv_len, kv_lo, s_cb, s_cs, s_ch, BLOCK_N, BLOCK_SIZE,
                                       True, False)
    valid = valid & (key < tile_hi * BLOCK_N)  # (j < tile_hi)
    cached = valid & (key < context)
    k = _load_rows(k_cache_ptr, kv_off, cached, HEAD_DIM, HEAD_DIM_PAD, True)
    v = _load_v_rows(v_cache_ptr, kv_off, key, cached, HEAD_DIM, HEAD_DIM_PAD, True, V_TRANS, BLOCK_SIZE, SLOT_STRIDE)
    return key, valid, kv_off, k, v


@triton.jit
def _complete_tile(k, v, key, valid, kv_off, context, k_cache_ptr, v_cache_ptr, HEAD_DIM: tl.constexpr,
                   HEAD_DIM_PAD: tl.constexpr, V_TRANS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   SLOT_STRIDE: tl.constexpr):
    """PREWAIT, after the wait: the preloaded tile's rows of this step's keys (key >= context, just
    written by the KV write; at batch 1 one row of one program's tile) loaded into it."""
    fresh = valid & (key >= context)
    k_new = _load_rows(k_cache_ptr, kv_off, fresh, HEAD_DIM, HEAD_DIM_PAD, True)
    v_new = _load_v_rows(v_cache_ptr, kv_off, key, fresh, HEAD_DIM, HEAD_DIM_PAD, True, V_TRANS, BLOCK_SIZE,
                         SLOT_STRIDE)
    return tl.where(fresh[:, None], k_new, k), tl.where(fresh[:, None], v_new, v)


@triton.jit
def _rotate(x, partner, c, s, offs_d, HALF: tl.constexpr, dtype: tl.constexpr):
    """ROPE: rows of x (float32) rotated with their partner values (x at d +- HALF) and cos / sin (float32,
    rounded to `dtype`), rounded as `triton_rope_kv_write` (`_rotate_heads`) rounds: first half
    (x c) - partner s, second half (x c) + partner s, the product x c rounded to dtype first."""
    xc = (x * c).to(dtype).to(tl.float32)
    return tl.where(offs_d < HALF, xc - partner * s, xc + partner * s).to(dtype)  # (the kernel's two forms)


@triton.jit
def _fresh_kv(kn_ptr, vn_ptr, t, kv_head, s_knt, s_knh, s_vnt, s_vnh, c, s, inv_k_scale, inv_v_scale, offs_d,
              HALF: tl.constexpr, HEAD_DIM: tl.constexpr, dtype: tl.constexpr, cache_dtype: tl.constexpr,
              FP8_MAX: tl.constexpr):
    """ROPE: this step's key of token t and KV head (k rotated) and value, as the cache stores them
    (`triton_rope_kv_write._to_cache`: cast, or fp8 scaled and saturated)."""
    row = kn_ptr + t * s_knt + kv_head * s_knh
    k = tl.load(row + offs_d).to(tl.float32)
    partner = tl.load(row + (offs_d + HALF) % HEAD_DIM).to(tl.float32)
    k = _rotate(k, partner, c, s, offs_d, HALF, dtype)
    v = tl.load(vn_ptr + t * s_vnt + kv_head * s_vnh + offs_d)
    if FP8_MAX > 0:
        k = tl.minimum(tl.maximum(k.to(tl.float32) * inv_k_scale, -FP8_MAX), FP8_MAX)
        v = tl.minimum(tl.maximum(v.to(tl.float32) * inv_v_scale, -FP8_MAX), FP8_MAX)
    return k.to(cache_dtype), v.to(cache_dtype)


# Host ints that change from step to step are not specialised on (==1, %16), so they cost no recompiles.
@triton.jit(do_not_specialize=["num_seqs", "num_rows", "num_splits", "s_bt", "window"])
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    part_m_ptr, part_l_ptr, part_acc_ptr,  # split partials: [num_rows, NUM_HEADS, num_splits(, HEAD_DIM_PAD)]
    qsl_ptr, seq_lens_ptr, block_table_ptr,
    qk_scale,  # softmax scale * log2(e) (* k_scale for an fp8 cache)
    v_scale,  # 1.0, or an fp8 cache's V scale
    num_seqs, num_rows, num_splits,
    window, softcap,  # sliding window (keys); logit soft-cap (used only with SOFTCAP)
    sinks_ptr,  # float32 [NUM_HEADS] sink logits (read only with SINKS)
    s_qt, s_qh, s_ot, s_oh,  # q / out strides: token, head (the head_dim stride is 1)
    s_cb, s_cs, s_ch,  # cache strides: block, slot in block, head (the head_dim stride is 1)
    s_bt,  # block table row stride
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr, SEARCH: tl.constexpr, SOFTCAP: tl.constexpr,
    KV_FP8: tl.constexpr, SINKS: tl.constexpr, F16_DOT: tl.constexpr, INTERIOR: tl.constexpr,
    LOOKUP_BLOCKS: tl.constexpr, WINDOWED: tl.constexpr, F8_QK: tl.constexpr, F8_PV: tl.constexpr,
    EARLY_V: tl.constexpr, CVT_ON_LOAD: tl.constexpr, E5M2: tl.constexpr, PREFETCH_TABLE: tl.constexpr,
    PTX: tl.constexpr, V_TRANS: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # `pdl`: launched early, waits for the kernel before it before reading anything
    KPERM: tl.constexpr = False,  # out's head_dim in the INT4 swapped GEMM's K order (`int4_kperm`)
    PREWAIT: tl.constexpr = False,  # the first KV tile's cached keys loaded before the PDL wait (`_preload_tile`)
    # ROPE (with PREWAIT; one query a sequence): q rotated here, this step's key rotated and written with its
    # value into the cache here (module docstring); kn / vn: this step's k / v [T, KV heads, HEAD_DIM]
    ROPE: tl.constexpr = False, pos_ptr=None, cos_ptr=None, sin_ptr=None, s_cos=0, slot_ptr=None, num_slots=0,
    kn_ptr=None, vn_ptr=None, s_knt=0, s_knh=0, s_vnt=0, s_vnh=0, inv_k_scale=1.0, inv_v_scale=1.0,
    FP8_MAX: tl.constexpr = 0.0,
):
    pdl.launch_dependents(USE_PDL)
    if not PREWAIT:  # (PREWAIT: the step's inputs and the cached keys are read first, then the wait)
        pdl.wait(USE_PDL)
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    SLOT_STRIDE: tl.constexpr = NUM_HEADS // GROUP * HEAD_DIM  # V_TRANS: the contiguous cache's slot stride
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_valid = offs_d < HEAD_DIM
    in_group = offs_m % GROUP_PAD
    head = kv_head * GROUP + in_group

    seq = _find_sequence(qsl_ptr, num_seqs, tile, BLOCK_Q, SEARCH)
    if seq >= num_seqs:
        if not SPLIT:  # spare tile: zero its share of the rows past the last sequence (SPLIT: the reduce does)
            if PREWAIT:  # (out may still be another kernel's memory until the wait)
                pdl.wait(USE_PDL)
            total = tl.load(qsl_ptr + num_seqs)
            spare = tile - (total // BLOCK_Q + num_seqs)
            tok = (total // BLOCK_Q + spare) * BLOCK_Q + offs_m // GROUP_PAD
            pad = (tok >= total) & (tok < num_rows) & (in_group < GROUP)
            dst = out_ptr + tok.to(tl.int64)[:, None] * s_ot + head[:, None] * s_oh + offs_d[None, :]
            zeros = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=out_ptr.dtype.element_ty)
            tl.store(dst, zeros, mask=pad[:, None] & d_valid[None, :])
        return

    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    q_first = (tile - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # this tile's first query, within the sequence
    if q_first >= q_len:
        if PREWAIT:  # program (0, 0, 0) waits even with nothing to do (module docstring: PREWAIT)
            if (tile == 0) & (kv_head == 0) & (split == 0):
                pdl.wait(USE_PDL)
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len  # keys cached before this step's queries

    q_idx = q_first + offs_m // GROUP_PAD
    row_valid = (q_idx < q_len) & (in_group < GROUP)
    key_limit = context + q_idx  # causal: a query sees keys 0..key_limit
    tok = (q_start + q_idx).to(tl.int64)
    kv_len = context + tl.minimum(q_first + BLOCK_Q, q_len)  # keys the tile's last query sees
    kv_lo = tl.maximum(context + q_first - window + 1, 0)  # the first key the tile's first query sees
    num_kv_tiles = tl.cdiv(kv_len, BLOCK_N)
    first_kv_tile = kv_lo // BLOCK_N
    if SPLIT:
        per_split = tl.cdiv(num_kv_tiles - first_kv_tile, num_splits)
        tile_lo = first_kv_tile + split * per_split
        tile_hi = tl.minimum(tile_lo + per_split, num_kv_tiles)
    else:
        tile_lo = first_kv_tile
        tile_hi = num_kv_tiles

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    table_row = block_table_ptr + seq.to(tl.int64) * s_bt
    if V_TRANS:  # this head's [head_dim, slot] values of a block start at head * head_dim * block_size
        v_cache_ptr += kv_head * (HEAD_DIM * BLOCK_SIZE - s_ch)
    if ROPE:  # positions, cos / sin rows and the slot: step inputs and constants, read before the wait
        half_d = offs_d % (HEAD_DIM // 2)
        pos_r = tl.load(pos_ptr + tok, mask=row_valid, other=0).to(tl.int64)
        c_r = tl.load(cos_ptr + pos_r[:, None] * s_cos + half_d[None, :], mask=row_valid[:, None], other=0.0)
        s_r = tl.load(sin_ptr + pos_r[:, None] * s_cos + half_d[None, :], mask=row_valid[:, None], other=0.0)
        pos_0 = tl.load(pos_ptr + q_start).to(tl.int64)  # the sequence's one token (this step's key)
        c_0 = tl.load(cos_ptr + pos_0 * s_cos + half_d)
        s_0 = tl.load(sin_ptr + pos_0 * s_cos + half_d)
        slot_0 = tl.load(slot_ptr + q_start, mask=q_start < num_slots, other=-1).to(tl.int64)
        fresh_tile = context // BLOCK_N  # the tile of this step's key (key index `context`): the last one
        owner = (context >= 0) & (fresh_tile >= tile_lo) & (fresh_tile < tile_hi)
    tile_first = tile_lo
    if PREWAIT:  # the program's first tile: its cached keys' K/V in flight while the kernels before still run
        key_p, valid_p, off_p, k_p, v_p = _preload_tile(tile_lo, tile_hi, table_row, kv_head, kv_len, kv_lo, context,
                                                        k_cache_ptr, v_cache_ptr, s_cb, s_cs, s_ch, BLOCK_N,
                                                        BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PAD, V_TRANS, SLOT_STRIDE)
        tile_lo += 1  # the walk below starts after it
        pdl.wait(USE_PDL)
    q = tl.load(q_ptr + tok[:, None] * s_qt + head[:, None] * s_qh + offs_d[None, :],
                mask=row_valid[:, None] & d_valid[None, :], other=0.0)
    if ROPE:  # q rotated here (not in place: nothing reads q after), this step's key and value made here
        q_dt: tl.constexpr = q_ptr.dtype.element_ty
        qp = tl.load(q_ptr + tok[:, None] * s_qt + head[:, None] * s_qh + ((offs_d + HEAD_DIM // 2) % HEAD_DIM)[None, :],
                     mask=row_valid[:, None], other=0.0)
        q = _rotate(q.to(tl.float32), qp.to(tl.float32), c_r.to(q_dt).to(tl.float32), s_r.to(q_dt).to(tl.float32),
                    offs_d[None, :], HEAD_DIM // 2, q_dt)
        k_0, v_0 = _fresh_kv(kn_ptr, vn_ptr, q_start.to(tl.int64), kv_head, s_knt, s_knh, s_vnt, s_vnh,
                             c_0.to(q_dt).to(tl.float32), s_0.to(q_dt).to(tl.float32), inv_k_scale, inv_v_scale, offs_d,
                             HEAD_DIM // 2, HEAD_DIM, q_dt, k_cache_ptr.dtype.element_ty, FP8_MAX)
        if owner & (slot_0 >= 0):  # into the cache (read by later steps; this one takes it from registers)
            dst = (slot_0 // BLOCK_SIZE) * s_cb + (slot_0 % BLOCK_SIZE) * s_cs + kv_head * s_ch + offs_d
            tl.store(k_cache_ptr + dst, k_0)
            tl.store(v_cache_ptr + dst, v_0)
    if not KV_FP8:
        q = q.to(k_cache_ptr.dtype.element_ty)
    elif F16_DOT:  # fp8 K/V meet q in float16: fp8 -> fp16 is one cheap conversion per two values, fp8 -> bf16
        # costs a second, quarter-rate one per value (as many as the HBM reads save, at long contexts).
        # Queries past fp16's range are clamped: the softmax sees them as the largest finite values.
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    q_lo = q  # (unused without F8_QK)
    row_scale = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    if F8_QK:  # e4m3 queries of two terms, scaled per row to the format's largest value (448):
        # q * scale = hi + lo to about 2^-8 of each value, as bf16 holds it; the keys stay fp8.
        qf = q.to(tl.float32)
        q_max = tl.max(tl.abs(qf), 1)
        q_up = 448.0 / tl.where(q_max > 0.0, q_max, 1.0)
        qs = qf * q_up[:, None]
        q = qs.to(k_cache_ptr.dtype.element_ty)
        q_lo = (qs - q.to(tl.float32)).to(k_cache_ptr.dtype.element_ty)
        row_scale = 1.0 / q_up

    if PREWAIT:  # this step's keys of the tile (written by the kernel before) join it, then it is attended
        if ROPE:
            is_new = (key_p == context)[:, None]
            k_p = tl.where(is_new, k_0[None, :], k_p)
            v_p = tl.where(is_new, v_0[None, :], v_p)
        else:
            k_p, v_p = _complete_tile(k_p, v_p, key_p, valid_p, off_p, context, k_cache_ptr, v_cache_ptr, HEAD_DIM,
                                      HEAD_DIM_PAD, V_TRANS, BLOCK_SIZE, SLOT_STRIDE)
        if CVT_ON_LOAD == 1:
            k_p = _fp8_to_f16(k_p, E5M2, PTX)
        if CVT_ON_LOAD != 0:
            v_p = _fp8_to_f16(v_p, E5M2, PTX)
        p, alpha, m_i, l_i = _softmax_step(q, q_lo, row_scale, m_i, l_i, k_p, key_p, valid_p, key_limit, window,
                                           softcap, qk_scale, DOT_PRECISION, SOFTCAP, KV_FP8, True, F8_QK, CVT_ON_LOAD,
                                           E5M2)
        acc = _accumulate(acc, alpha, p, v_p, q.dtype, DOT_PRECISION, KV_FP8, F8_QK, F8_PV, CVT_ON_LOAD, E5M2)
    if ROPE:  # the walk stops before the tile of this step's key: it is attended last, below
        tile_hi = tl.minimum(tile_hi, fresh_tile)
    if INTERIOR:
        # Interior tiles: every key valid and seen by every row of the tile (after the window start
        # of the tile's last query, up to the causal limit of its first): no masks there.
        if WINDOWED:
            q_last = tl.minimum(q_first + BLOCK_Q, q_len) - 1
            lo_max = tl.maximum(context + q_last - window + 1, 0)
            mid_lo = tl.minimum(tl.maximum(tl.cdiv(lo_max, BLOCK_N), tile_lo), tile_hi)
        else:
            mid_lo = tile_lo
        mid_hi = tl.maximum(tl.minimum((context + q_first + 1) // BLOCK_N, tile_hi), mid_lo)
    else:  # every tile masked
        mid_lo = tile_lo
        mid_hi = tile_lo
    if INTERIOR and WINDOWED:  # masked tiles the window starts in
        for j in range(tile_lo, mid_lo):
            m_i, l_i, acc = _attend_tile(
                q, q_lo, row_scale, m_i, l_i, acc, j, k_cache_ptr, v_cache_ptr, table_row, kv_head, kv_len, kv_lo,
                key_limit,
                window, softcap, qk_scale, s_cb, s_cs, s_ch,
                BLOCK_N, BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PAD, DOT_PRECISION, SOFTCAP, KV_FP8, True, False, F8_QK,
                F8_PV, EARLY_V, CVT_ON_LOAD, E5M2, PTX, V_TRANS, SLOT_STRIDE)
    if INTERIOR and PREFETCH_TABLE:
        # The next tile's block-table lookups are issued before this tile's K/V loads, so a tile waits
        # on one round trip (its K/V), not two (table, then K/V). The lookups are the masked ones
        # (valid keys only), so the one past the last interior tile reads nothing out of bounds.
        interior_len = tl.minimum(kv_len, mid_hi * BLOCK_N)
        key_n, valid_n, off_n = _tile_offsets(mid_lo, table_row, kv_head, interior_len, kv_lo, s_cb, s_cs, s_ch,
                                              BLOCK_N, BLOCK_SIZE, True, False)
        for j in range(mid_lo, mid_hi):
            key, valid, kv_off = key_n, valid_n, off_n
            key_n, valid_n, off_n = _tile_offsets(j + 1, table_row, kv_head, interior_len, kv_lo, s_cb, s_cs, s_ch,
                                                  BLOCK_N, BLOCK_SIZE, True, False)
            m_i, l_i, acc = _attend_rows(q, q_lo, row_scale, m_i, l_i, acc, key, valid, kv_off, k_cache_ptr,
                                         v_cache_ptr, key_limit, window, softcap, qk_scale, BLOCK_N, HEAD_DIM,
                                         HEAD_DIM_PAD,
                                         DOT_PRECISION, SOFTCAP, KV_FP8, False, F8_QK, F8_PV, EARLY_V, CVT_ON_LOAD,
                                         E5M2, PTX, V_TRANS, BLOCK_SIZE, SLOT_STRIDE)
    elif INTERIOR:
        for j in range(mid_lo, mid_hi):
            m_i, l_i, acc = _attend_tile(
                q, q_lo, row_scale, m_i, l_i, acc, j, k_cache_ptr, v_cache_ptr, table_row, kv_head, kv_len, kv_lo,
                key_limit,
                window, softcap, qk_scale, s_cb, s_cs, s_ch,
                BLOCK_N, BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PAD, DOT_PRECISION, SOFTCAP, KV_FP8, False, LOOKUP_BLOCKS,
                F8_QK, F8_PV, EARLY_V, CVT_ON_LOAD, E5M2, PTX, V_TRANS, SLOT_STRIDE)
    for j in range(mid_hi, tile_hi):  # masked tiles at the causal edge (all of them without INTERIOR)
        m_i, l_i, acc = _attend_tile(
            q, q_lo, row_scale, m_i, l_i, acc, j, k_cache_ptr, v_cache_ptr, table_row, kv_head, kv_len, kv_lo,
            key_limit,
            window, softcap, qk_scale, s_cb, s_cs, s_ch,
            BLOCK_N, BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PAD, DOT_PRECISION, SOFTCAP, KV_FP8, True, False, F8_QK, F8_PV,
            EARLY_V, CVT_ON_LOAD, E5M2, PTX, V_TRANS, SLOT_STRIDE)

    if ROPE:
        if owner & (fresh_tile > tile_first):  # the tile of this step's key, where PREWAIT did not take it
            key_f, valid_f, off_f, k_f, v_f = _preload_tile(fresh_tile, fresh_tile + 1, table_row, kv_head, kv_len,
                                                            kv_lo, context, k_cache_ptr, v_cache_ptr, s_cb, s_cs, s_ch,
                                                            BLOCK_N, BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PAD, V_TRANS,
                                                            SLOT_STRIDE)
            is_new = (key_f == context)[:, None]
            k_f = tl.where(is_new, k_0[None, :], k_f)
            v_f = tl.where(is_new, v_0[None, :], v_f)
            if CVT_ON_LOAD == 1:
                k_f = _fp8_to_f16(k_f, E5M2, PTX)
            if CVT_ON_LOAD != 0:
                v_f = _fp8_to_f16(v_f, E5M2, PTX)
            p, alpha, m_i, l_i = _softmax_step(q, q_lo, row_scale, m_i, l_i, k_f, key_f, valid_f, key_limit, window,
                                               softcap, qk_scale, DOT_PRECISION, SOFTCAP, KV_FP8, True, F8_QK,
                                               CVT_ON_LOAD, E5M2)
            acc = _accumulate(acc, alpha, p, v_f, q.dtype, DOT_PRECISION, KV_FP8, F8_QK, F8_PV, CVT_ON_LOAD, E5M2)
    if KV_FP8:
        acc = acc * v_scale
    if SPLIT:
        part = (tok * NUM_HEADS + head) * num_splits + split
        tl.store(part_m_ptr + part, m_i, mask=row_valid)
        tl.store(part_l_ptr + part, l_i, mask=row_valid)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM_PAD + offs_d[None, :], acc, mask=row_valid[:, None])
    else:
        if SINKS:  # the sink in the log2 domain, as one more (valueless) key
            sink = tl.load(sinks_ptr + head, mask=row_valid, other=0.0) * 1.4426950408889634
            m_fin = tl.maximum(m_i, sink)
            rescale = tl.exp2(m_i - m_fin)
            acc = acc * rescale[:, None]
            l_i = l_i * rescale + tl.exp2(sink - m_fin)
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        offs_o = kperm_dst(offs_d) if KPERM else offs_d  # (a permutation inside each 64 of head_dim)
        tl.store(out_ptr + tok[:, None] * s_ot + head[:, None] * s_oh + offs_o[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & d_valid[None, :])


@triton.jit(do_not_specialize=["num_seqs", "num_splits"])
def _reduce_splits_kernel(
    out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, qsl_ptr, sinks_ptr,
    num_seqs, num_splits, s_ot, s_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, MAX_SPLITS: tl.constexpr,
    SINKS: tl.constexpr, CHUNK: tl.constexpr, USE_PDL: tl.constexpr = False, KPERM: tl.constexpr = False,
    PREWAIT: tl.constexpr = False,
):
    """One program per (row, head): merge the split partials; rows past the last sequence get zeros.
    The shares' accumulators are read CHUNK at a time (the maxima and sums of all of them first).
    PREWAIT: the step's query_start_loc (no kernel of the step writes it) is read before the PDL wait."""
    pdl.launch_dependents(USE_PDL)
    if not PREWAIT:
        pdl.wait(USE_PDL)
    row = tl.program_id(0)
    head = tl.program_id(1)
    num_shares = tl.where(row < tl.load(qsl_ptr + num_seqs), num_splits, 0)  # padding rows read none
    if PREWAIT:
        pdl.wait(USE_PDL)
    offs_s = tl.arange(0, MAX_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    s_mask = offs_s < num_shares
    base = (row.to(tl.int64) * NUM_HEADS + head) * num_splits
    m = tl.load(part_m_ptr + base + offs_s, mask=s_mask, other=float("-inf"))
    l = tl.load(part_l_ptr + base + offs_s, mask=s_mask, other=0.0)
    m_max = tl.max(m, 0)
    if SINKS:
        sink = tl.load(sinks_ptr + head) * 1.4426950408889634
        m_max = tl.maximum(m_max, sink)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # padding rows: no share at all
    den = tl.sum(l * tl.exp2(m - m_max), 0)  # empty shares (max -inf) weigh nothing
    num = tl.zeros([HEAD_DIM_PAD], dtype=tl.float32)
    for c in tl.static_range(0, MAX_SPLITS, CHUNK):
        offs_c = c + tl.arange(0, CHUNK)
        c_mask = offs_c < num_shares
        m_c = tl.load(part_m_ptr + base + offs_c, mask=c_mask, other=float("-inf"))
        acc = tl.load(part_acc_ptr + (base + offs_c)[:, None] * HEAD_DIM_PAD + offs_d[None, :],
                      mask=c_mask[:, None], other=0.0)
        num += tl.sum(acc * tl.exp2(m_c - m_max)[:, None], 0)
    if SINKS:
        den += tl.where(num_shares > 0, tl.exp2(sink - m_max), 0.0)
    o = num / tl.where(den > 0.0, den, 1.0)
    offs_o = kperm_dst(offs_d) if KPERM else offs_d
    tl.store(out_ptr + row.to(tl.int64) * s_ot + head * s_oh + offs_o, o.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, block_table: torch.Tensor, scale: float, num_kv_heads: int, *,
                    block_q: int, block_n: int, num_splits: int, max_splits: int,
                    num_warps: int, num_stages: int, interior: bool = True, lookup_blocks: bool = False,
                    fp8_qk_dot: bool = False, fp8_pv_dot: bool = False, early_v_load: bool = False,
                    fp8_convert_on_load: bool | int = False, table_prefetch: bool = False,
                    v_transposed: bool = False, sliding_window: int | None = None,
                    logit_softcap: float | None = None, k_scale: float = 1.0, v_scale: float = 1.0,
                    sinks: torch.Tensor | None = None, kperm: bool = False, prewait: bool = False,
                    rope: tuple | None = None) -> torch.Tensor:
    """q: [T, num_heads, head_dim] (rows past query_start_loc[-1] are padding) -> out, same shape.
    `sinks`: [num_heads] sink logits (read as float32), or None.
    `kperm` (head_dim a multiple of 64): each head's output in the INT4 swapped GEMM's K order
    (`quantization.int4_kperm`; out viewed as [T, num_heads * head_dim] is `permute_x` of the natural one).

    The launch depends only on shapes and the arguments given here, never on device data.
    `interior`: walk the tiles every row sees whole without masks (False: mask every tile).
    `lookup_blocks`: in those tiles, one block-table read per cache block (where block_n is a
    multiple of the block size), not one per key.
    `fp8_qk_dot` (e4m3 cache, 16-bit queries): q . k as two fp8 dots (the query split into two fp8
    terms), so the keys are not converted; values still are.
    `fp8_pv_dot` (e4m3 cache, 16-bit queries): p @ v likewise (p as two e4m3 terms), values unconverted.
    `early_v_load`: each tile's V rows are loaded together with its K rows (before the scores).
    `fp8_convert_on_load` (fp8 cache, 16-bit queries, neither fp8 dot): K/V tiles converted to float16
    where they load (pinned there in inline PTX), so the dot's layout change moves 16-bit values.
    CVT_VALUES (2): the value tiles only (the keys' layout change needs no transpose).
    `v_transposed`: the cache (contiguous) holds each block's values as [num_kv_heads, head_dim,
    block_size] (`backend.transpose_v_blocks`; the writers' `v_transposed`), so p @ v reads its
    operand keys-contiguous, without a transpose: an fp8 tile goes from shared memory to the dot as
    the keys do, with no float16 round trip through shared memory.
    `table_prefetch`: in the unmasked walk, each tile's block-table lookups are issued one tile ahead.
    `prewait` (decode launches under PDL): each program reads the step's inputs and its first tile's
    cached K/V before waiting for the kernel before it (the KV write), the reduce its input sizes
    (module docstring).
    `rope` (with prewait, one query a sequence; full rotary, head_dim a power of two, values not
    transposed): (RotaryStep, k, v, slot_mapping) of this step, k unrotated and not yet in the
    cache: the kernel rotates q (in registers) and k, and writes k and v at the slots
    (`triton_rope_kv_write`'s arithmetic and roundings).
    """
    num_rows, num_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    cache_v_scale = v_scale  # (the fp8 p @ v folds a factor into v_scale below)
    if kperm and head_dim % 64:
        raise ValueError(f"paged_attention kperm: head_dim {head_dim} must be a multiple of 64")
    if num_splits > max_splits:
        raise ValueError(f"num_splits={num_splits} exceeds max_splits={max_splits} (the reduce's size)")
    group = num_heads // num_kv_heads
    head_dim_pad = triton.next_power_of_2(head_dim)
    out = torch.empty((num_rows, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_rows == 0:
        return out
    if num_seqs == 0:
        return out.zero_()
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    kv_fp8 = kv_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    split = num_splits > 1
    f8_pv = fp8_pv_dot and kv_cache.dtype == torch.float8_e4m3fn and q.dtype != torch.float32
    if f8_pv:  # the accumulator carries p's factor 448
        v_scale = v_scale / F8_P_SCALE
    f8_qk = fp8_qk_dot and kv_cache.dtype == torch.float8_e4m3fn and q.dtype != torch.float32
    cvt_on_load = int(fp8_convert_on_load) if kv_fp8 and q.dtype != torch.float32 and not (f8_qk or f8_pv) else 0
    if cvt_on_load not in (0, CVT_KV, CVT_VALUES):
        raise ValueError(f"fp8_convert_on_load={fp8_convert_on_load}: False, True (keys and values) or 2 (values)")
    if v_transposed:  # both tiles reach the dot without a transpose: converting after it is the cheap way
        check_v_transposable(kv_cache)
        cvt_on_load = 0
    if split:
        part_m = torch.empty((num_rows, num_heads, num_splits), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((num_rows, num_heads, num_splits, head_dim_pad), dtype=torch.float32,
                               device=q.device)
    else:
        part_m = part_l = part_acc = out  # unused
    sinks_f32 = out if sinks is None else sinks.float().contiguous()  # (unused without sinks)
    grid = (num_rows // block_q + num_seqs + 1, num_kv_heads, num_splits)
    fused = {}
    if rope is not None:
        step, k_new, v_new, slots = rope
        if not prewait or v_transposed or head_dim != head_dim_pad or step.rotary_dim != head_dim:
            raise ValueError("paged_attention rope: prewait launches of full-rotary power-of-two heads, values not "
                             "transposed")
        fused = dict(ROPE=True, pos_ptr=step.positions, cos_ptr=step.cos_cache, sin_ptr=step.sin_cache,
                     s_cos=step.cos_cache.stride(0), slot_ptr=slots, num_slots=min(num_rows, slots.shape[0]),
                     kn_ptr=k_new, vn_ptr=v_new, s_knt=k_new.stride(0), s_knh=k_new.stride(1), s_vnt=v_new.stride(0),
                     s_vnh=v_new.stride(1), inv_k_scale=1.0 / k_scale, inv_v_scale=1.0 / cache_v_scale,
                     FP8_MAX=torch.finfo(kv_cache.dtype).max if kv_fp8 else 0.0)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, part_m, part_l, part_acc,
        query_start_loc, seq_lens, block_table,
        scale * LOG2E * (k_scale if kv_fp8 else 1.0), v_scale if kv_fp8 else 1.0, num_seqs, num_rows, num_splits,
        sliding_window if sliding_window is not None else NO_WINDOW, float(logit_softcap or 0.0), sinks_f32,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_table.stride(0),
        NUM_HEADS=num_heads, GROUP=group, GROUP_PAD=triton.next_power_of_2(group),
        BLOCK_Q=block_q, BLOCK_N=block_n, BLOCK_SIZE=kv_cache.shape[2],
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        SPLIT=split, DOT_PRECISION="ieee" if (q.dtype if kv_fp8 else kv_cache.dtype) == torch.float32 else "tf32",
        SEARCH=SEARCH_CHUNK, SOFTCAP=logit_softcap is not None, KV_FP8=kv_fp8,
        F16_DOT=kv_fp8 and q.dtype != torch.float32, SINKS=sinks is not None, INTERIOR=interior,
        LOOKUP_BLOCKS=lookup_blocks and block_n % kv_cache.shape[2] == 0, WINDOWED=sliding_window is not None,
        F8_QK=f8_qk, F8_PV=f8_pv, EARLY_V=early_v_load, CVT_ON_LOAD=cvt_on_load,
        E5M2=kv_cache.dtype == torch.float8_e5m2, PREFETCH_TABLE=table_prefetch, PTX=not _INTERPRETED,
        V_TRANS=v_transposed, KPERM=kperm,
        num_warps=num_warps,
        num_stages=num_stages,
        PREWAIT=prewait, **fused,
        **pdl.launch_kwargs(q.device),
    )
    if split:
        _reduce_splits_kernel[(num_rows, num_heads)](
            out, part_m, part_l, part_acc, query_start_loc, sinks_f32, num_seqs, num_splits,
            out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, MAX_SPLITS=max_splits,
            SINKS=sinks is not None, CHUNK=min(max_splits, REDUCE_CHUNK), KPERM=kperm, PREWAIT=prewait,
            **pdl.launch_kwargs(q.device),
        )
    return out
