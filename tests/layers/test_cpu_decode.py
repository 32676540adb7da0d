"""The C decode-attention kernel against a float64 reference, at the head sizes it specializes."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.requirements import skip_or_fail
from tokenmill.layers.attention import cpu_decode
from tokenmill.layers.attention.backend import kv_cache_shape


@pytest.fixture(autouse=True)
def _kernel_built():
    if not cpu_decode.available():  # tokenmill then falls back to torch; see the warning it logged
        skip_or_fail("the C decode-attention kernel is unavailable (no C compiler, a build error, "
                     "or TOKENMILL_NO_C_KERNELS set)")


@pytest.mark.parametrize("head_dim", [64, 128, 24])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(9, 3), (4, 4)])
def test_matches_reference(head_dim: int, dtype: torch.dtype, heads: tuple[int, int]) -> None:
    g = torch.Generator().manual_seed(head_dim)
    num_heads, num_kv_heads = heads
    block_size, num_blocks = 16, 40
    seq_lens = [1, 17, 160, 33]
    cache = torch.randn(kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim), generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g)
    width = max(-(-s // block_size) for s in seq_lens) + 1
    table = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    used = 0
    for i, s in enumerate(seq_lens):
        n = -(-s // block_size)
        table[i, :n] = perm[used:used + n].int()
        used += n
    # q as a strided view, the way the model hands it over (q and k heads side by side).
    qk = torch.randn(len(seq_lens), num_heads + num_kv_heads, head_dim, generator=g).to(dtype)
    q = qk[:, :num_heads]
    scale = head_dim ** -0.5
    out = cpu_decode.decode_attention(q, cache, table, torch.tensor(seq_lens, dtype=torch.int32), scale)
    group = num_heads // num_kv_heads
    for i, s in enumerate(seq_lens):
        slots = torch.tensor([int(table[i, p // block_size]) * block_size + p % block_size for p in range(s)])
        k = cache[0].reshape(-1, num_kv_heads, head_dim)[slots].double()
        v = cache[1].reshape(-1, num_kv_heads, head_dim)[slots].double()
        for h in range(num_heads):
            p = torch.softmax(k[:, h // group] @ q[i, h].double() * scale, 0)
            expected = p @ v[:, h // group]
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(out[i, h].double(), expected, atol=tol, rtol=tol)


def test_loading_the_kernel_keeps_subnormals():
    """A kernel built with -ffast-math would switch on flush-to-zero for the whole process."""
    import numpy as np

    tiny = np.float32(1e-39)
    assert tiny * np.float32(1.0) != 0
