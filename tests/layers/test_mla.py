"""The MLA Triton kernels (latent write, absorbed attention over the paged latent cache) against
the torch reference, in Triton's interpreter: a chunk after cached context, a decode, a padding row."""

from __future__ import annotations

import pytest
import torch

from tokenmill.layers.attention.metadata import AttentionMetadata
from tokenmill.layers.attention.mla import TorchMLABackend, mla_cache_shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_mla_matches_the_reference(dtype):
    pytest.importorskip("triton")
    from tokenmill.layers.attention.triton_mla import mla_attention, mla_write
    gen = torch.Generator().manual_seed(0)
    heads, lora, rope, block_size = 4, 32, 16, 4
    cache = torch.randn(mla_cache_shape(8, block_size, lora + rope), generator=gen).to(dtype)
    qsl = torch.tensor([0, 3, 4], dtype=torch.int32)  # a 3-token chunk after 5 cached, a decode; 1 pad row
    seq_lens = torch.tensor([8, 7], dtype=torch.int32)
    table = torch.tensor([[0, 3, 5, 0], [1, 2, 0, 0]], dtype=torch.int32)
    slots = torch.tensor([3 * block_size + 1, 3 * block_size + 2, 3 * block_size + 3, 2 * block_size + 2, -1])
    meta = AttentionMetadata(num_tokens=4, max_query_len=3, max_seq_len=8, query_start_loc=qsl, seq_lens=seq_lens,
                             block_table=table, slot_mapping=slots, query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens)
    q_lat, q_pe = (torch.randn(5, heads, d, generator=gen).to(dtype) for d in (lora, rope))
    latent, k_pe = (torch.randn(5, d, generator=gen).to(dtype) for d in (lora, rope))
    ref_cache = cache.clone()
    ref = TorchMLABackend(heads, lora, rope, 0.2).forward(q_lat, q_pe, latent, k_pe, ref_cache, meta)
    mla_write(cache, latent, k_pe, slots)
    out = mla_attention(q_lat, q_pe, cache, qsl, seq_lens, table, 0.2, lora)
    assert torch.equal(cache, ref_cache), "the kernel writes what the reference writes, and skips slot -1"
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    assert not out[4].any(), "padding rows are zero"
