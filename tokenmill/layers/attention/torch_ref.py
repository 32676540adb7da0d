"""Pure-torch paged attention: the reference backend (CPU, tests, GPU fallback).

Decodes (query length 1) are batched into one scaled_dot_product_attention call
over K/V gathered through the block table and padded to the longest decode
context. Prefill chunks (query length > 1) get one call each, over their own
context, with a causal mask offset by the context already in the cache.

GQA never copies K/V per query head: the query heads sharing a KV head are
folded into the query-length axis, so each KV head is attended to once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.layers.attention.backend import AttentionBackend
from tokenmill.layers.attention.metadata import AttentionMetadata


class TorchRefAttentionBackend(AttentionBackend):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        self.group = num_heads // num_kv_heads

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        m = meta.slot_mapping.shape[0]  # num_tokens, or more when padded with -1 slots
        write_kv(kv_cache, k[:m], v[:m], meta.slot_mapping)
        # Rows past the last sequence (padding for a fixed batch shape) stay zero.
        out = torch.zeros_like(q)
        qsl = meta.query_start_loc_cpu.tolist()
        seq_lens = meta.seq_lens_cpu.tolist()
        decodes = [i for i in range(meta.num_seqs) if qsl[i + 1] - qsl[i] == 1]
        if decodes:
            self._decode(q, kv_cache, meta, out, decodes, qsl, seq_lens)
        for i in range(meta.num_seqs):
            start, end = qsl[i], qsl[i + 1]
            if end - start > 1:
                out[start:end] = self._prefill(q[start:end], kv_cache, meta.block_table[i], seq_lens[i])
        return out

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor,
                decodes: list[int], qsl: list[int], seq_lens: list[int]) -> None:
        block_size = kv_cache.shape[2]
        device = q.device
        seq_ids = torch.tensor(decodes, device=device)
        rows = torch.tensor([qsl[i] for i in decodes], device=device)
        max_len = max(seq_lens[i] for i in decodes)
        num_blocks = -(-max_len // block_size)
        # [2, S, nb, bs, Hkv, D] -> [2, S, Hkv, L, D]
        kv = kv_cache[:, meta.block_table[seq_ids, :num_blocks].long()]
        kv = kv.flatten(2, 3).transpose(2, 3)
        keys = torch.arange(kv.shape[3], device=device)
        mask = keys[None, :] < meta.seq_lens[seq_ids, None]  # [S, L]
        cdt = _compute_dtype(q)
        qd = q[rows].view(len(decodes), self.num_kv_heads, self.group, self.head_dim)
        o = F.scaled_dot_product_attention(qd.to(cdt), kv[0].to(cdt), kv[1].to(cdt),
                                           attn_mask=mask[:, None, None, :], scale=self.scale)
        out[rows] = o.reshape(len(decodes), self.num_heads, self.head_dim).to(out.dtype)

    def _prefill(self, q: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor,
                 seq_len: int) -> torch.Tensor:
        block_size = kv_cache.shape[2]
        q_len = q.shape[0]
        num_blocks = -(-seq_len // block_size)
        # [2, nb, bs, Hkv, D] -> [2, Hkv, seq_len, D]
        kv = kv_cache[:, block_ids[:num_blocks].long()].flatten(1, 2)[:, :seq_len].transpose(1, 2)
        # Query j sits at position seq_len - q_len + j and sees keys at positions <= its own.
        mask = torch.ones(q_len, seq_len, dtype=torch.bool, device=q.device).tril(seq_len - q_len)
        # [q_len, H, D] -> [Hkv, G * q_len, D], row g * q_len + j
        qh = q.view(q_len, self.num_kv_heads, self.group, self.head_dim).permute(1, 2, 0, 3)
        qh = qh.reshape(self.num_kv_heads, self.group * q_len, self.head_dim)
        cdt = _compute_dtype(q)
        o = F.scaled_dot_product_attention(qh.to(cdt), kv[0].to(cdt), kv[1].to(cdt),
                                           attn_mask=mask.repeat(self.group, 1), scale=self.scale)
        o = o.view(self.num_kv_heads, self.group, q_len, self.head_dim).permute(2, 0, 1, 3)
        return o.reshape(q_len, self.num_heads, self.head_dim).to(q.dtype)


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store k, v ([T, Hkv, D]) at flat cache slots; slots equal to -1 are skipped."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    flat = kv_cache.view(2, -1, kv_cache.shape[3], kv_cache.shape[4])
    flat[0, slots] = k[valid].to(kv_cache.dtype)
    flat[1, slots] = v[valid].to(kv_cache.dtype)


def _compute_dtype(q: torch.Tensor) -> torch.dtype:
    # CUDA kernels already accumulate half precision in float32; on CPU, upcast.
    if q.device.type == "cpu" and q.dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    return q.dtype
