"""Multi-head latent attention over the paged latent cache (DeepSeek-V2/V3), absorbed form.

Cache, one tensor per layer: [1, num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]
(the leading and head axes keep the standard layout's block axes at 1 and 2): per token the
normalized latent c and the rotated rope key k_pe, shared by every head.

With the key up-projection absorbed into the query (q_lat = q_nope W_UK, per head) attention is
multi-query attention with one 'KV head': keys [c | k_pe], values c. The caller projects the
output back (o = o_lat W_UV). `TorchMLABackend` is the reference (CPU, tests): per sequence, the
context gathered from the cache and a masked softmax in float32. `TritonMLABackend` runs
`triton_mla`'s kernels (CUDA; capture-safe, no host syncs).
"""

from __future__ import annotations

import torch

from tokenmill.layers.attention.metadata import AttentionMetadata


def mla_cache_shape(num_blocks: int, block_size: int, latent_dim: int) -> tuple[int, ...]:
    return (1, num_blocks, block_size, 1, latent_dim)


class TorchMLABackend:
    def __init__(self, num_heads: int, kv_lora_rank: int, rope_dim: int, scale: float) -> None:
        self.num_heads, self.kv_lora_rank, self.rope_dim, self.scale = num_heads, kv_lora_rank, rope_dim, scale

    def forward(self, q_lat: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q_lat [T, H, L], q_pe [T, H, R], latent [T, L], k_pe [T, R] -> o_lat [T, H, L]; writes the
        new tokens' [latent | k_pe] at `meta.slot_mapping` first."""
        n = int(meta.query_start_loc_cpu[-1]) if meta.num_seqs else 0
        write_latent(kv_cache, latent[:n], k_pe[:n], meta.slot_mapping[:n])
        block_size = kv_cache.shape[2]
        blocks = kv_cache[0, :, :, 0]  # [num_blocks, block_size, L + R]
        q = torch.cat([q_lat, q_pe], dim=-1)
        out = torch.zeros(q_lat.shape, dtype=q_lat.dtype, device=q_lat.device)
        qsl = meta.query_start_loc_cpu.tolist()
        seq_lens = (meta.seq_lens_cpu if meta.seq_lens_exact else meta.seq_lens.cpu()).tolist()
        for i, seq_len in enumerate(seq_lens):
            start, end = qsl[i], qsl[i + 1]
            if end == start or seq_len <= 0:
                continue
            num_blocks = -(-seq_len // block_size)
            ctx = blocks[meta.block_table[i, :num_blocks].long()].reshape(-1, blocks.shape[-1])[:seq_len]
            scores = torch.einsum("qhd,kd->hqk", q[start:end].float(), ctx.float()) * self.scale
            q_pos = torch.arange(seq_len - (end - start), seq_len, device=q.device)
            mask = torch.arange(seq_len, device=q.device)[None, :] > q_pos[:, None]
            probs = scores.masked_fill(mask[None], float("-inf")).softmax(dim=-1)
            o = torch.einsum("hqk,kl->qhl", probs, ctx[:, :self.kv_lora_rank].float())
            out[start:end] = o.to(out.dtype)
        return out


def write_latent(kv_cache: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor, slots: torch.Tensor) -> None:
    """[latent | k_pe] of each token with a slot >= 0 into the flat cache (torch; syncs on CUDA)."""
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    valid = slots >= 0
    if not bool(valid.all()):
        latent, k_pe, slots = latent[valid], k_pe[valid], slots[valid]
    flat.index_copy_(0, slots, torch.cat([latent, k_pe], dim=-1).to(kv_cache.dtype))


class TritonMLABackend(TorchMLABackend):
    def forward(self, q_lat, q_pe, latent, k_pe, kv_cache, meta):
        from tokenmill.layers.attention.triton_mla import mla_attention, mla_write
        mla_write(kv_cache, latent, k_pe, meta.slot_mapping)
        return mla_attention(q_lat, q_pe, kv_cache, meta.query_start_loc, meta.seq_lens, meta.block_table,
                             self.scale, self.kv_lora_rank)


def mla_backend_class(attn_backend_cls: type) -> type[TorchMLABackend]:
    """The MLA counterpart of the engine's attention backend (Triton's on CUDA, else the reference)."""
    return TritonMLABackend if attn_backend_cls.__module__.endswith("triton_backend") else TorchMLABackend
