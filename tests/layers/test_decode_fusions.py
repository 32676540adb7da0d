"""Fused decode kernels under Triton's CPU interpreter, each bit for bit the path it replaces: the
rotary + KV-cache write (triton_rope_kv_write) against `rotate_` then `write_kv`, and a TP rank's
vocab embedding lookup (triton_ops.vocab_embedding) against VocabParallelEmbedding's torch path."""

from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are defined: before the first import

import pytest
import torch

from tests.helpers.triton_required import require_triton

require_triton()

from tokenmill.config import RopeConfig
from tokenmill.layers.attention.triton_backend import TritonAttentionBackend
from tokenmill.layers.attention.triton_kv_write import write_kv
from tokenmill.layers.attention.triton_rope_kv_write import rotate_and_write_kv
from tokenmill.layers.rotary import RotaryEmbedding, RotaryStep
from tokenmill.layers.triton_ops.rotary import rotate_

BLOCK, BLOCKS = 4, 6


def _case(dtype, head_dim, partial, heads=(4, 2), tokens=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    hq, hkv = heads
    qkv = torch.randn(tokens, (hq + 2 * hkv) * head_dim, generator=g).to(dtype)
    rope = RotaryEmbedding(head_dim, 64, RopeConfig(theta=10000.0, partial_rotary_factor=partial))
    positions = torch.tensor([3, 17, 0, 40, 63, 9, 11][:tokens])
    # slots: token 2 is padding (-1); the mapping is one row short (the last token writes nothing)
    slots = torch.tensor([5, 22, -1, 0, 13, 7, 1][:tokens - 1])
    cache = torch.full((2, BLOCKS, BLOCK, hkv, head_dim), float("nan")).to(dtype)
    return qkv, rope, positions, slots, cache


def _views(qkv, heads, head_dim):
    hq, hkv = heads
    t = qkv.shape[0]
    qk = qkv[:, :(hq + hkv) * head_dim].view(t, hq + hkv, head_dim)
    v = qkv[:, (hq + hkv) * head_dim:].view(t, hkv, head_dim)
    return qk, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim, partial, prewait", [(64, 1.0, False), (32, 0.5, False), (48, 1.0, False),
                                                         (64, 1.0, True), (48, 1.0, True)])
def test_matches_rotary_then_kv_write_bit_for_bit(dtype, head_dim, partial, prewait):
    """prewait: the position, cos / sin and slot read before the PDL wait (the same values)."""
    heads = (4, 2)
    qkv, rope, positions, slots, cache = _case(dtype, head_dim, partial, heads)
    ref_qkv, ref_cache = qkv.clone(), cache.clone()
    qk, v = _views(ref_qkv, heads, head_dim)
    rotate_(qk, None, positions, rope.cos_cache, rope.sin_cache, rope.rotary_dim)
    q_ref, k_ref = qk.split(list(heads), dim=1)
    write_kv(k_ref, v, ref_cache, slots)

    qk, v = _views(qkv, heads, head_dim)
    q, k = qk.split(list(heads), dim=1)
    k_before = k.clone()
    rotate_and_write_kv(q, k, v, positions, rope.cos_cache, rope.sin_cache, rope.rotary_dim, cache, slots,
                        prewait=prewait)
    assert torch.equal(q, q_ref)  # q rotated in place
    assert torch.equal(k, k_before)  # k left as it was
    written = ~ref_cache.isnan()
    assert torch.equal(written, ~cache.isnan())  # the same slots written (none for padding or past the map)
    assert torch.equal(cache[written], ref_cache[written])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_cache_matches_rotary_then_scaled_kv_write_bit_for_bit(dtype, cache_dtype):
    """An fp8 cache: the rotated k (rounded to q's dtype) and v stored times the inverse scales,
    saturated (values past the format's range here), as `write_kv` stores them after `rotate_`."""
    heads, head_dim = (4, 2), 64
    fmax = torch.finfo(cache_dtype).max
    k_scale, v_scale = 225 / fmax, 300 / fmax  # values ~N(0, 150): those past 1.5 / 2 sigma saturate
    qkv, rope, positions, slots, cache = _case(dtype, head_dim, 1.0, heads)
    qkv = (qkv.float() * 150).to(dtype)
    cache = cache.to(cache_dtype)
    ref_qkv, ref_cache = qkv.clone(), cache.clone()
    qk, v = _views(ref_qkv, heads, head_dim)
    rotate_(qk, None, positions, rope.cos_cache, rope.sin_cache, rope.rotary_dim)
    write_kv(qk[:, heads[0]:], v, ref_cache, slots, k_scale, v_scale)
    qk, v = _views(qkv, heads, head_dim)
    q, k = qk.split(list(heads), dim=1)
    rotate_and_write_kv(q, k, v, positions, rope.cos_cache, rope.sin_cache, rope.rotary_dim, cache, slots,
                        k_scale, v_scale)
    written = ~ref_cache.float().isnan()
    assert torch.equal(written, ~cache.float().isnan())
    assert written.any() and (ref_cache.float().abs() == torch.finfo(cache_dtype).max).any()  # saturated
    assert torch.equal(cache.float()[written], ref_cache.float()[written])


def test_backend_fuses_only_on_the_fused_rotary_path():
    backend = TritonAttentionBackend(4, 2, 64, 0.125)
    rope = RotaryEmbedding(64, 64, RopeConfig(theta=10000.0))
    fused_step = RotaryStep(torch.arange(3), rope.cos_cache, rope.sin_cache, 64)
    torch_step = RotaryStep(torch.arange(3), rope.cos_cache, rope.sin_cache, 64, *rope.cos_sin(torch.arange(3), torch.float32))
    cache = torch.zeros(2, 1, 4, 2, 64, dtype=torch.bfloat16)
    assert backend.fuses_rope(fused_step, cache)
    assert not backend.fuses_rope(torch_step, cache)
    assert backend.fuses_rope(fused_step, cache.to(torch.float8_e4m3fn))  # scaled stores, fused too


def test_backend_forward_with_rope_equals_rotating_first():
    """A decode batch plus a short prefill: `forward(..., rope=)` on unrotated q and k gives the
    output and cache of rotating them first and calling `forward` without it."""
    from tests.layers.test_attention import make_case
    num_heads, num_kv_heads, head_dim = 4, 2, 32
    case = make_case([9, 0, 20], [1, 5, 1], BLOCK, num_heads, num_kv_heads, torch.float32, "cpu", pad_tokens=2,
                     head_dim=head_dim)
    rope = RotaryEmbedding(head_dim, 64, RopeConfig(theta=10000.0))
    positions = torch.tensor([9, 0, 1, 2, 3, 4, 20, 0, 0])
    step = RotaryStep(positions, rope.cos_cache, rope.sin_cache, head_dim)
    backend = TritonAttentionBackend(num_heads, num_kv_heads, head_dim, head_dim ** -0.5)
    q, k, cache = case.q.clone(), case.k.clone(), case.kv_cache.clone()
    rotate_(q, k, positions, rope.cos_cache, rope.sin_cache, head_dim)
    expected = backend.forward(q, k, case.v, cache, case.meta)
    q2, cache2 = case.q.clone(), case.kv_cache.clone()
    out = backend.forward(q2, case.k.clone(), case.v, cache2, case.meta, rope=step)
    assert torch.equal(cache2, cache)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_vocab_parallel_embedding_kernel_equals_the_torch_path(dtype):
    """A TP rank's lookup over its vocab rows (triton_ops.vocab_embedding): its rows copied, every
    other id (below, above, the padded tail's ids) zeros, as VocabParallelEmbedding's torch path."""
    from tokenmill.layers.triton_ops.vocab_embedding import vocab_embedding
    rows, d, start = 11, 40, 16  # d: not a power of two
    weight = torch.randn(rows, d, generator=torch.Generator().manual_seed(1)).to(dtype)
    ids = torch.tensor([0, 15, 16, 20, 26, 27, 100, 16])
    local = ids - start
    outside = (local < 0) | (local >= rows)
    expected = torch.nn.functional.embedding(local.masked_fill(outside, 0), weight).masked_fill_(outside[:, None], 0)
    assert torch.equal(vocab_embedding(ids, weight, start), expected)
    assert vocab_embedding(ids[:0], weight, start).shape == (0, d)


@pytest.mark.parametrize("dtype, cache_dtype, window", [(torch.float32, torch.float32, None),
                                                        (torch.float16, torch.float16, None),
                                                        (torch.float16, torch.float8_e4m3fn, None),
                                                        (torch.float32, torch.float32, 9)])
@pytest.mark.parametrize("splits", [4])
def test_rope_in_attention_equals_the_rotary_kernel(monkeypatch, dtype, cache_dtype, splits, window):
    """Single-token split decodes (PREWAIT): the attention kernel rotates q and this step's k and writes
    k, v into the cache itself (no rotary + KV write launch), bit for bit the cache and output of the
    rotary kernel's path (TOKENMILL_ATTN_ROPE=0). Contexts put this step's key first (0), last (31,
    63) and inside a 32-key tile, and on either side of a share; a zero-length row; padding rows; a
    sliding window (9 keys: the walk starts past the first tiles). Contexts of at most two 32-key
    tiles: 4 shares already give one tile a share and empty shares; 16 split them the same way (a
    reduce of one chunk either way) at four times the interpreter's time (65 s), so they were dropped."""
    from tests.layers.test_attention import make_case
    from tokenmill.layers.attention import triton_backend as tb
    from tokenmill.layers.attention import triton_rope_kv_write
    from tokenmill.layers.attention.triton_backend import TritonAttentionConfig
    num_heads, num_kv_heads, head_dim = 4, 2, 32
    case = make_case([9, 0, 31, 63, 40, 5], [1, 1, 1, 1, 0, 1], BLOCK, num_heads, num_kv_heads, torch.float32, "cpu",
                     pad_tokens=2, head_dim=head_dim)
    rope = RotaryEmbedding(head_dim, 128, RopeConfig(theta=10000.0))
    positions = torch.tensor([9, 0, 31, 63, 5, 0, 0])
    step = RotaryStep(positions, rope.cos_cache, rope.sin_cache, head_dim)
    tiles = tb.DecodeTiles(block_n=32, warps=8, stages=2, prewait=True)
    config = TritonAttentionConfig(kv_splits=splits, split_decode_tiles=tiles,
                                   fp8_split_decode_tiles=dataclasses.replace(tiles, fp8_convert_on_load=2))
    q, k, v = (x.to(dtype) * 4 for x in (case.q, case.k, case.v))
    scale = 1.0 if cache_dtype != torch.float8_e4m3fn else 0.05
    runs = []
    real = triton_rope_kv_write.rotate_and_write_kv
    launched = []
    monkeypatch.setattr(triton_rope_kv_write, "rotate_and_write_kv", lambda *a, **kw: launched.append(1) or real(*a, **kw))
    for inside in (False, True):
        launched.clear()
        backend = TritonAttentionBackend(num_heads, num_kv_heads, head_dim, head_dim ** -0.5, window,
                                         config=dataclasses.replace(config, rope_in_attention=inside))
        backend.k_scale = backend.v_scale = scale
        backend._sm_count = 1024  # (the CPU's 1: more programs than SMs, no PREWAIT launch)
        backend._rope_tested = True  # (its self-test launches the rotary kernel too: test_rope_in_attention_self_test)
        cache = case.kv_cache.to(cache_dtype, copy=True)
        out = backend.forward(q.clone(), k.clone(), v.clone(), cache, case.meta, rope=step)
        assert bool(launched) != inside, "the rotary kernel runs exactly where the attention does not rotate"
        runs.append((out, cache))
    (out, cache), (fused_out, fused_cache) = runs
    assert torch.equal(fused_cache.view(torch.uint8), cache.view(torch.uint8))
    assert not out.isnan().any() and torch.equal(fused_out, out)


def test_rope_in_attention_self_test(monkeypatch):
    """`rope_selftest.passed`: the kernel's rotary + KV write against the rotary kernel's, once per shape
    (True here); a planted fault (the step's slot moved in the fused launch) fails it, and the backend
    then runs the rotary kernel."""
    from tokenmill.layers.attention import rope_selftest, triton_paged_attention, triton_rope_kv_write
    from tokenmill.layers.attention.triton_backend import TritonAttentionConfig
    monkeypatch.setattr(rope_selftest, "_RESULTS", {})
    rope = RotaryEmbedding(32, 64, RopeConfig(theta=10000.0))
    step = RotaryStep(torch.tensor([0]), rope.cos_cache, rope.sin_cache, 32)
    backend = TritonAttentionBackend(4, 2, 32, 32 ** -0.5, config=TritonAttentionConfig())
    cache = torch.zeros(2, 6, BLOCK, 2, 32, dtype=torch.float16)
    assert rope_selftest.passed(backend, cache, torch.float16, step)
    assert len(rope_selftest._RESULTS) == 1
    real = triton_paged_attention.paged_attention

    def planted(*args, rope=None, **kwargs):
        if rope is not None:
            rope = (rope[0], rope[1], rope[2], rope[3] + 1)  # this step's key written one slot on
        return real(*args, rope=rope, **kwargs)
    monkeypatch.setattr(triton_paged_attention, "paged_attention", planted)
    monkeypatch.setattr(rope_selftest, "_RESULTS", {})
    assert not rope_selftest.passed(backend, cache, torch.float16, step)
    launched = []
    real_write = triton_rope_kv_write.rotate_and_write_kv
    monkeypatch.setattr(triton_rope_kv_write, "rotate_and_write_kv", lambda *a, **kw: launched.append(1) or real_write(*a, **kw))
    from tests.layers.test_attention import make_case
    case = make_case([9], [1], BLOCK, 4, 2, torch.float16, "cpu", head_dim=32)
    backend._sm_count = 1024
    backend.forward(case.q, case.k, case.v, case.kv_cache.clone(), case.meta,
                    rope=RotaryStep(torch.tensor([9]), rope.cos_cache, rope.sin_cache, 32))
    assert launched, "a failed self-test: the rotary kernel runs"
