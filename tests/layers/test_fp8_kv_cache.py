"""FP8 KV cache in the attention backends: the torch reference (CPU path) and the Triton kernels
(under TRITON_INTERPRET=1), against the float32 reference backend run over the same values
rounded to fp8 and scaled back (the reference reads exactly what an fp8 cache holds).

Rows with cached context and a fresh prefill (which the torch backend computes from its new K/V,
rounded as the cache holds them). Scales other than 1 check that k_scale joins the softmax scale
and v_scale the output.
"""

from __future__ import annotations

import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from tests.helpers.requirements import require_module
from tests.layers.test_attention import make_case
from tokenmill.layers.attention.backend import quantize_kv, transpose_v_blocks
from tokenmill.layers.attention.torch_ref import TorchRefAttentionBackend

HEAD_DIM = 32
# (contexts, query lengths): decodes, a multi-token decode and chunks over cached context.
ROWS = ([5, 40, 17, 9, 30, 0], [1, 1, 3, 6, 20, 12])
DECODE_ROWS = ([5, 40, 17, 9, 30], [1, 1, 3, 6, 1])  # decode launches (query length <= 8)
FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]


def _fp8_case(dtype: torch.dtype, k_scale: float, v_scale: float, heads=(4, 2), block_size=16, rows=ROWS):
    case = make_case(*rows, block_size, *heads, torch.float32, "cpu", pad_tokens=2, head_dim=HEAD_DIM)
    cache8 = torch.empty(case.kv_cache.shape, dtype=dtype)
    cache8[0] = quantize_kv(case.kv_cache[0], k_scale, dtype)
    cache8[1] = quantize_kv(case.kv_cache[1], v_scale, dtype)
    # What the fp8 cache stands for, in float32: the reference backend's cache and inputs.
    ref_cache = torch.stack([cache8[0].float() * k_scale, cache8[1].float() * v_scale])
    k_rt = quantize_kv(case.k, k_scale, dtype).float() * k_scale
    v_rt = quantize_kv(case.v, v_scale, dtype).float() * v_scale
    ref = TorchRefAttentionBackend(*heads, HEAD_DIM, 1 / math.sqrt(HEAD_DIM))
    expected = ref.forward(case.q, k_rt, v_rt, ref_cache, case.meta)
    case.k_rt, case.v_rt = k_rt, v_rt
    return case, cache8, expected


def _layout(backend, cache8: torch.Tensor) -> torch.Tensor:
    """`cache8` (plain layout) as `backend` stores it (its values transposed per block where it does)."""
    return transpose_v_blocks(cache8) if backend.v_transposed(cache8) else cache8


def _plain(backend, cache: torch.Tensor) -> torch.Tensor:
    return transpose_v_blocks(cache, inverse=True) if backend.v_transposed(cache) else cache


def _check(case, cache8, out, expected, k_scale, v_scale, dtype, tol):
    n = case.meta.num_tokens
    torch.testing.assert_close(out[:n], expected[:n], atol=tol, rtol=tol)
    # The step's K/V were stored rounded to fp8 at their slots.
    slots = case.meta.slot_mapping
    real = slots >= 0
    flat = cache8.view(2, -1, *cache8.shape[3:])
    assert torch.equal(flat[0, slots[real]].float(), quantize_kv(case.k[real], k_scale, dtype).float())
    assert torch.equal(flat[1, slots[real]].float(), quantize_kv(case.v[real], v_scale, dtype).float())
    # Something was rounded: the exact float attention differs.
    assert not torch.allclose(out[:n].double(), case.expected, atol=1e-5)
    torch.testing.assert_close(out[:n].double(), case.expected, atol=0.3, rtol=0.3)


@pytest.mark.parametrize("dtype", FP8_DTYPES)
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.5, 2.0)])
def test_torch_reference_reads_fp8_blocks(dtype, scales):
    k_scale, v_scale = scales
    case, cache8, expected = _fp8_case(dtype, k_scale, v_scale)
    backend = TorchRefAttentionBackend(4, 2, HEAD_DIM, 1 / math.sqrt(HEAD_DIM))
    backend.k_scale, backend.v_scale = k_scale, v_scale
    out = backend.forward(case.q, case.k, case.v, cache8, case.meta)
    _check(case, cache8, out, expected, k_scale, v_scale, dtype, 1e-5)


@pytest.mark.parametrize("dtype", FP8_DTYPES)
@pytest.mark.parametrize("splits,q_dtype", [(None, torch.float32), (3, torch.float32), (3, torch.float16)])
def test_triton_kernels_read_fp8_blocks(dtype, splits, q_dtype):
    """float16 queries take the kernel's float16 dots over fp8 blocks (as bf16 ones do on a GPU)."""
    require_module("triton")
    from tokenmill.layers.attention.triton_backend import TritonAttentionBackend, TritonAttentionConfig

    k_scale, v_scale = 0.5, 2.0
    case, cache8, expected = _fp8_case(dtype, k_scale, v_scale)
    backend = TritonAttentionBackend(4, 2, HEAD_DIM, 1 / math.sqrt(HEAD_DIM),
                                     config=TritonAttentionConfig(kv_splits=splits))
    backend.k_scale, backend.v_scale = k_scale, v_scale
    # The interpreter's float -> fp8 conversion mis-rounds values that carry into the next power of
    # two, so the new K/V given here are already fp8 values times the scale: the write scales them
    # and stores them exactly. (Rounding on the device: scripts/gpu_quant.py's kernel checks.)
    case.k, case.v = case.k_rt, case.v_rt
    cache = _layout(backend, cache8)
    out = backend.forward(case.q.to(q_dtype), case.k.to(q_dtype), case.v.to(q_dtype), cache, case.meta)
    _check(case, _plain(backend, cache), out.float(), expected, k_scale, v_scale, dtype,
           1e-4 if q_dtype == torch.float32 else 5e-3)


@pytest.mark.parametrize("splits", [None, 3])
def test_triton_fp8_query_key_dot(splits):
    """fp8_qk_dot: q . k as two fp8 dots over unconverted e4m3 keys (float16 queries, scaled per row
    to 448), against the float32 reference over what the cache holds. The interpreter mis-rounds
    float -> fp8, so the queries here are fp8 values whose row maxima are 448 / 64: the scaled
    query is exact in its first term (the second term's precision shows only on a GPU:
    scripts/gpu_attention.py checks it against the reference)."""
    require_module("triton")
    from tokenmill.layers.attention.triton_backend import TritonAttentionBackend, TritonAttentionConfig

    k_scale, v_scale = 0.5, 2.0
    case, cache8, _ = _fp8_case(torch.float8_e4m3fn, k_scale, v_scale)
    q = (case.q * 100).to(torch.float8_e4m3fn).float()
    q[..., 0] = 448.0
    q16 = (q / 64).to(torch.float16)  # values up to 7: scores far from the unscaled query's
    ref_cache = torch.stack([cache8[0].float() * k_scale, cache8[1].float() * v_scale])
    expected = TorchRefAttentionBackend(4, 2, HEAD_DIM, 1 / math.sqrt(HEAD_DIM)).forward(
        q16.float(), case.k_rt, case.v_rt, ref_cache, case.meta)
    backend = TritonAttentionBackend(4, 2, HEAD_DIM, 1 / math.sqrt(HEAD_DIM),
                                     config=TritonAttentionConfig(kv_splits=splits, fp8_qk_dot=True))
    backend.k_scale, backend.v_scale = k_scale, v_scale
    out = backend.forward(q16, case.k_rt.half(), case.v_rt.half(), _layout(backend, cache8), case.meta)
    n = case.meta.num_tokens
    torch.testing.assert_close(out[:n].float(), expected[:n], atol=5e-3, rtol=5e-3)


@pytest.mark.parametrize("splits", [None, 3])
def test_triton_fp8_weights_value_dot(splits):
    """fp8_pv_dot: p @ v as two fp8 dots (p scaled to 448, as hi + lo e4m3 terms) over unconverted
    e4m3 values, with fp8 q . k too and without. The interpreter mis-rounds float -> fp8 (a value
    that rounds up into the next power of two comes out halved), which the lo term absorbs to
    within one e4m3 rounding: 3e-2 here (the hi term alone misses by 0.2 and more; on a GPU
    scripts/gpu_attention.py checks it against the reference at bf16's tolerance)."""
    require_module("triton")
    from tokenmill.layers.attention.triton_backend import DecodeTiles, TritonAttentionBackend, TritonAttentionConfig

    k_scale, v_scale = 0.5, 2.0
    case, cache8, expected = _fp8_case(torch.float8_e4m3fn, k_scale, v_scale)
    n = case.meta.num_tokens
    for qk, vt in ((False, False), (True, False), (True, True)):  # vt: values transposed (K-major for the dot)
        backend = TritonAttentionBackend(4, 2, HEAD_DIM, 1 / math.sqrt(HEAD_DIM), config=TritonAttentionConfig(
            kv_splits=splits, fp8_pv_dot=True, fp8_qk_dot=qk, fp8_decode_tiles=DecodeTiles(16),
            fp8_split_decode_tiles=None, fp8_v_transposed=vt))
        backend.k_scale, backend.v_scale = k_scale, v_scale
        cache = transpose_v_blocks(cache8) if vt else cache8
        out = backend.forward(case.q.half(), case.k_rt.half(), case.v_rt.half(), cache, case.meta)
        torch.testing.assert_close(out[:n].float(), expected[:n], atol=3e-2, rtol=3e-2)



@pytest.mark.parametrize("dtype", FP8_DTYPES)
@pytest.mark.parametrize("splits,early_v,rows,mode", [(None, False, ROWS, True), (3, True, DECODE_ROWS, True),
                                                     (None, True, DECODE_ROWS, True), (None, False, ROWS, 2),
                                                     (3, False, DECODE_ROWS, 2)])
def test_triton_fp8_convert_on_load(dtype, splits, early_v, rows, mode):
    """fp8_convert_on_load (K/V tiles converted to float16 where they load; on a GPU by inline PTX the
    compiler cannot move, here the plain conversion: scripts/gpu_attention.py checks the PTX against
    the reference) with float16 queries, early_v_load (decode launches only: decode rows) with and
    without split KV; subnormals, the largest value and -0 in a block that is read. Mode 2: the
    values only (the keys converted where the dot takes them)."""
    require_module("triton")
    from tokenmill.layers.attention.triton_backend import TritonAttentionBackend, TritonAttentionConfig

    k_scale, v_scale = 0.5, 2.0
    case, cache8, expected = _fp8_case(dtype, k_scale, v_scale, rows=rows)
    cache8[0, 0, 1, 0, :4] = torch.tensor([2.0 ** -9, -(2.0 ** -7), 448.0 if dtype == torch.float8_e4m3fn else 57344.0,
                                           -0.0]).to(dtype)
    ref_cache = torch.stack([cache8[0].float() * k_scale, cache8[1].float() * v_scale])
    expected = TorchRefAttentionBackend(4, 2, HEAD_DIM, 1 / math.sqrt(HEAD_DIM)).forward(
        case.q, case.k_rt, case.v_rt, ref_cache, case.meta)
    backend = TritonAttentionBackend(4, 2, HEAD_DIM, 1 / math.sqrt(HEAD_DIM), config=TritonAttentionConfig(
        kv_splits=splits, fp8_convert_on_load=mode, early_v_load=early_v))
    backend.k_scale, backend.v_scale = k_scale, v_scale
    out = backend.forward(case.q.half(), case.k_rt.half(), case.v_rt.half(), _layout(backend, cache8), case.meta)
    n = case.meta.num_tokens
    torch.testing.assert_close(out[:n].float(), expected[:n], atol=5e-3, rtol=5e-3)


def test_transpose_v_blocks_round_trip():
    """The transposed-values layout: block b's values at [head, dim, slot] of its run, keys untouched."""
    cache = torch.randn(2, 3, 4, 2, 5)
    t = transpose_v_blocks(cache)
    assert t.shape == cache.shape and torch.equal(t[0], cache[0])
    runs = t[1].reshape(3, 2, 5, 4)  # [block, head, dim, slot]
    assert torch.equal(runs[1, 1, 3, 2], cache[1, 1, 2, 1, 3])
    assert torch.equal(transpose_v_blocks(t, inverse=True), cache)


@pytest.mark.parametrize("dtype", FP8_DTYPES)
@pytest.mark.parametrize("splits,rows,block_size,prefetch", [(None, ROWS, 16, False), (3, DECODE_ROWS, 16, False),
                                                             (None, DECODE_ROWS, 8, True)])
def test_triton_fp8_transposed_values(dtype, splits, rows, block_size, prefetch):
    """fp8_v_transposed: the cache's value blocks stored [head, dim, slot]; the backend's write puts
    the step's values there (read back through the inverse transpose) and the kernel reads them so
    (unmasked tiles: contiguous runs of a block's slots; masked ones: per key), with float16 and
    float32 queries, split and not, the block-table lookahead, a block size of 8."""
    require_module("triton")
    from tokenmill.layers.attention.triton_backend import DecodeTiles, TritonAttentionBackend, TritonAttentionConfig

    k_scale, v_scale = 0.5, 2.0
    case, cache8, expected = _fp8_case(dtype, k_scale, v_scale, rows=rows, block_size=block_size)
    n = case.meta.num_tokens
    for q_dtype, tol in ((torch.float32, 1e-4), (torch.float16, 5e-3)):
        cache_t = transpose_v_blocks(cache8)
        tiles = DecodeTiles(block_n=32, stages=2)  # 32 keys: tiles of whole blocks and interior ones
        backend = TritonAttentionBackend(4, 2, HEAD_DIM, 1 / math.sqrt(HEAD_DIM), config=TritonAttentionConfig(
            kv_splits=splits, fp8_v_transposed=True, fp8_decode_tiles=tiles, fp8_split_decode_tiles=tiles,
            block_n=32, table_prefetch=prefetch))
        backend.k_scale, backend.v_scale = k_scale, v_scale
        out = backend.forward(case.q.to(q_dtype), case.k_rt.to(q_dtype), case.v_rt.to(q_dtype), cache_t, case.meta)
        _check(case, transpose_v_blocks(cache_t, inverse=True), out.float(), expected, k_scale, v_scale, dtype, tol)


@pytest.mark.parametrize("dtype", FP8_DTYPES)
def test_triton_fp8_rope_write_transposed_values(dtype):
    """The fused rotary + KV write stores values transposed per block as the plain write does."""
    require_module("triton")
    from tokenmill.layers.attention import triton_kv_write, triton_rope_kv_write

    torch.manual_seed(0)
    t, hq, hkv, d, bs = 5, 4, 2, HEAD_DIM, 8
    q, k = torch.randn(t, hq, d), torch.randn(t, hkv, d)
    v = (torch.randn(t, hkv, d) * 4).to(dtype).float()  # fp8 values: stored exactly
    pos = torch.arange(t) + 3
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    ang = torch.arange(64).float()[:, None] * inv[None, :]
    cos, sin = ang.cos(), ang.sin()
    slots = torch.tensor([9, 0, -1, 17, 4])
    plain = torch.zeros(2, 3, bs, hkv, d, dtype=dtype)
    trans = transpose_v_blocks(plain)
    triton_kv_write.write_kv(k, v, plain, slots)
    triton_rope_kv_write.rotate_and_write_kv(q.clone(), k, v, pos, cos, sin, d, trans, slots, v_transposed=True)
    assert torch.equal(transpose_v_blocks(trans, inverse=True)[1].float(), plain[1].float())
    assert trans[1].float().abs().sum() > 0
