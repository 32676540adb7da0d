"""The CPU rotary + KV-write kernel (`cpu_rope_kv`) against the torch path it replaces.

The torch path: `rotary.apply_rotary` of q and k (cos/sin gathered and rounded to the activation
dtype), then the cache write of `torch_ref._write` (`index_copy_` at the slots). The kernel must
give the same bits in bf16 and float32: q and k rotated in place where they sit in the fused qkv
output (strided rows), the cache rows of the written tokens, nothing written for slot -1 or rows
past `num_write`, and the dims past a partial rotary width untouched. A planted single rounding
(o1 = round(x1 * cos - x2 * sin): the kernel's bf16 step `a` left unrounded) fails the bf16 cases.
And the torch reference backend given `rope` equals it given q and k rotated by torch.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.paged_batch import make_metadata
from tokenmill.config import RopeConfig
from tokenmill.layers.attention import cpu_rope_kv
from tokenmill.layers.attention.backend import kv_cache_shape
from tokenmill.layers.attention.torch_ref import TorchRefAttentionBackend
from tokenmill.layers.rotary import RotaryEmbedding, apply_rotary

pytestmark = pytest.mark.skipif(not cpu_rope_kv.available(), reason="no C compiler")


def _case(dtype: torch.dtype, tokens: int, hq: int, hk: int, d: int, partial: float, seed: int):
    gen = torch.Generator().manual_seed(seed)
    rope = RotaryEmbedding(d, 4096, RopeConfig(theta=10000.0, partial_rotary_factor=partial))
    qkv = (torch.randn(tokens, (hq + 2 * hk) * d + 5, generator=gen) * 4).to(dtype)[:, :(hq + 2 * hk) * d]
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    blocks, bs = 8, 16
    cache = torch.randn(2, blocks, bs, hk, d, generator=gen).to(dtype)
    slots = torch.randperm(blocks * bs, generator=gen)[:tokens].clone()
    if tokens > 2:
        slots[1] = -1  # padding
    return rope, qkv, positions, cache, slots


def _views(qkv: torch.Tensor, hq: int, hk: int, d: int):
    q = qkv[:, :hq * d].view(-1, hq, d)
    k = qkv[:, hq * d:(hq + hk) * d].view(-1, hk, d)
    v = qkv[:, (hq + hk) * d:].view(-1, hk, d)
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens, hq, hk, d, partial", [(1, 9, 3, 64, 1.0), (70, 4, 2, 32, 1.0),
                                                         (5, 8, 8, 64, 0.5), (3, 2, 1, 128, 1.0)])
def test_rope_kv_write_equals_the_torch_path(dtype: torch.dtype, tokens: int, hq: int, hk: int, d: int,
                                             partial: float) -> None:
    rope, qkv, positions, cache, slots = _case(dtype, tokens, hq, hk, d, partial, tokens + d)
    num_write = max(tokens - 1, 1)  # the last row is padding past the step's tokens
    step = rope.prepare(positions, dtype)
    q, k, v = _views(qkv, hq, hk, d)
    ref_q, ref_k = apply_rotary(q, step.cos, step.sin), apply_rotary(k, step.cos, step.sin)
    ref_cache = cache.clone()
    flat = ref_cache.view(2, -1, hk, d)
    keep = slots[:num_write] >= 0
    flat[0].index_copy_(0, slots[:num_write][keep], ref_k[:num_write][keep])
    flat[1].index_copy_(0, slots[:num_write][keep], v[:num_write][keep])

    assert cpu_rope_kv.rotate_and_write(q, k, v, positions, rope.cos_cache, rope.sin_cache, rope.rotary_dim,
                                        cache, slots, num_write)
    assert torch.equal(q, ref_q) and torch.equal(k, ref_k)
    assert torch.equal(cache, ref_cache)


def test_unfit_inputs_are_refused() -> None:
    rope, qkv, positions, cache, slots = _case(torch.bfloat16, 4, 2, 1, 64, 1.0, 0)
    q, k, v = _views(qkv, 2, 1, 64)
    before = qkv.clone()
    assert not cpu_rope_kv.rotate_and_write(q, k, v, positions.int(), rope.cos_cache, rope.sin_cache, 64,
                                            cache, slots, 4)  # int32 positions
    assert not cpu_rope_kv.rotate_and_write(q, k, v, positions, rope.cos_cache, rope.sin_cache, 64,
                                            cache.float(), slots, 4)  # cache dtype != activations
    assert torch.equal(qkv, before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_backend_with_rope_equals_rotating_first(dtype: torch.dtype) -> None:
    """The torch reference backend given `rope` (unrotated q, k: the fused pass) against it given
    q and k rotated by torch: a mixed step (a fresh prefill, decodes, a chunk after context)."""
    hq, hk, d, bs = 6, 2, 32, 4
    context, query = [9, 5, 14, 3], [9, 1, 4, 1]
    table = torch.randperm(4 * 4, generator=torch.Generator().manual_seed(3)).view(4, 4)
    meta = make_metadata(context, query, table, bs)
    positions = torch.cat([torch.arange(c - q, c) for c, q in zip(context, query)])
    rope = RotaryEmbedding(d, 64, RopeConfig())
    step = rope.prepare(positions, dtype)
    backend = TorchRefAttentionBackend(hq, hk, d, d ** -0.5)
    cache0 = (torch.randn(kv_cache_shape(16, bs, hk, d), generator=torch.Generator().manual_seed(4))).to(dtype)
    qkv = (torch.randn(positions.shape[0], (hq + 2 * hk) * d, generator=torch.Generator().manual_seed(5))).to(dtype)
    q, k, v = _views(qkv.clone(), hq, hk, d)
    cache_ref = cache0.clone()
    ref = backend.forward(step.rotate(q), step.rotate(k), v, cache_ref, make_metadata(context, query, table, bs))
    assert backend.fuses_rope(step, cache0)
    cache = cache0.clone()
    got = backend.forward(q, k, v, cache, meta, rope=step)
    assert torch.equal(cache, cache_ref) and torch.equal(got, ref)
