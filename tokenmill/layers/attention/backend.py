"""The interface every attention backend implements, and the backend chooser.

KV cache layout, one tensor per layer: [2, num_blocks, block_size, num_kv_heads, head_dim]
(index 0 holds keys, 1 values).

An FP8 cache (float8_e4m3fn / float8_e5m2, `kv_cache_dtype`) holds k / k_scale and v / v_scale,
saturated to the format's range; every backend reads the cache's dtype off the tensor, and the
per-layer scales (1.0, or the checkpoint's: `tokenmill.model.kv_scales`) off the backend.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from tokenmill.layers.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    """One layer's attention. `sliding_window` W (None: full): a query at position p sees keys
    p-W+1..p, as HF masks it, and no backend reads a KV block wholly before that (the KV manager
    may have handed such blocks to other requests). `logit_softcap` c (None: off): scores (after
    the scale) become c * tanh(scores / c) before the softmax. `sinks` (None: off): float [num_heads],
    one logit per query head that joins each softmax's denominator with no value (gpt-oss's
    attention sinks): out = sum_j exp(s_j) v_j / (exp(sink) + sum_j exp(s_j)). The attention
    module owns the parameter and sets it here before each forward."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, logit_softcap: float | None = None) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.k_scale = 1.0  # FP8 KV cache: the cache holds k / k_scale (and v / v_scale)
        self.v_scale = 1.0
        self.sliding_window = sliding_window
        self.logit_softcap = logit_softcap
        self.sinks: torch.Tensor | None = None

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim].

        Writes k and v into `kv_cache` at `meta.slot_mapping`, then returns causal
        attention over each sequence's whole context: [T, num_heads, head_dim].
        """

    def fuses_rope(self, rope, kv_cache: torch.Tensor) -> bool:
        """Whether `forward(..., rope=rope)` takes q and k unrotated and rotates them itself, in the
        kernel that writes the cache (`rope`: a `RotaryStep`)."""
        return False


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    return (2, num_blocks, block_size, num_kv_heads, head_dim)


FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype in FP8_KV_DTYPES


def check_v_transposable(kv_cache: torch.Tensor) -> None:
    """A cache whose values may be stored transposed per block: contiguous, so that a block's
    values are one run of block_size * num_kv_heads * head_dim elements."""
    if not kv_cache.is_contiguous():
        raise ValueError(f"a KV cache with transposed value blocks must be contiguous, got strides {kv_cache.stride()}")


def transpose_v_blocks(kv_cache: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """A copy of `kv_cache` (contiguous) with each block's values stored [num_kv_heads, head_dim,
    block_size] instead of [block_size, num_kv_heads, head_dim] (the Triton backend's
    `fp8_v_transposed` layout: slots contiguous, so the p @ v dot reads an fp8 tile without a
    transpose); the tensor's shape stays the same. `inverse`: back to the plain layout."""
    check_v_transposable(kv_cache)
    out = kv_cache.clone()
    _, nb, bs, h, d = kv_cache.shape
    if inverse:
        out[1] = kv_cache[1].reshape(nb, h, d, bs).permute(0, 3, 1, 2)
    else:
        out[1] = kv_cache[1].permute(0, 2, 3, 1).reshape(nb, bs, h, d)
    return out


def quantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x / scale rounded to the fp8 `dtype`, saturating at its largest finite value."""
    limit = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-limit, limit).to(dtype)
