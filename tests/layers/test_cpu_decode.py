"""The C decode-attention kernel against a float64 reference: at the head sizes it specializes, and
on every instruction path the CPU runs (`cpu_isa`), over odd lengths, block and tile boundaries,
sliding windows, soft-capping, sinks, GQA ratios (the in-register value path for 1..6 query heads
per KV head, the generic one above), and contexts split over threads."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.requirements import skip_or_fail
from tokenmill.layers import cpu_isa
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


def _paged(seq_lens: list[int], block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
           g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A cache with each sequence's blocks at shuffled places, and its block table (int32)."""
    nbs = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(nbs) + 3
    cache = torch.randn(kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim), generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.zeros(len(seq_lens), max(nbs) + 1, dtype=torch.int32)
    used = 0
    for i, n in enumerate(nbs):
        table[i, :n] = perm[used:used + n].int()
        used += n
    return cache, table


def _reference(q, cache, table, seq_lens, scale, window, cap, sinks) -> torch.Tensor:
    """float64 attention of each q over its (windowed) context, soft-capped, with sink logits."""
    _, _, bs, hkv, d = cache.shape
    s_, h, _ = q.shape
    group = h // hkv
    out = torch.zeros(s_, h, d, dtype=torch.float64)
    for i, n in enumerate(seq_lens):
        if n <= 0:
            continue
        first = n - window if window and n > window else 0
        slots = torch.tensor([int(table[i, p // bs]) * bs + p % bs for p in range(first, n)])
        k = cache[0].reshape(-1, hkv, d)[slots].double()
        v = cache[1].reshape(-1, hkv, d)[slots].double()
        for hh in range(h):
            scores = k[:, hh // group] @ q[i, hh].double() * scale
            if cap:
                scores = cap * torch.tanh(scores / cap)
            if sinks is not None:
                scores = torch.cat([scores, sinks[hh:hh + 1].double()])
            p = torch.softmax(scores, 0)[:len(slots)]
            out[i, hh] = p @ v[:, hh // group]
    return out


_RUNNABLE = [p for p in cpu_isa.PATHS if cpu_isa.can_run(p)]
# (heads, kv heads): GQA ratios 1..8 (7 and 8 take the generic value path)
_HEADS = [(4, 4), (9, 3), (12, 2), (6, 1), (7, 1), (16, 2)]


@pytest.mark.parametrize("path", _RUNNABLE, ids=lambda p: p.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", _HEADS, ids=lambda h: f"{h[0]}x{h[1]}")
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (128, 32), (80, 8), (24, 16)])
def test_every_path_matches_reference(path, dtype, heads, head_dim, block_size) -> None:
    lib = cpu_decode.library(path)
    if lib is None:
        skip_or_fail(f"the C decode kernel for path {path.name} did not build")
    g = torch.Generator().manual_seed(head_dim * 31 + heads[0])
    num_heads, num_kv_heads = heads
    # odd lengths, exactly one / two blocks and a tile, one past them, a padding row (0)
    seq_lens = [1, 15, 16, 17, 0, 33, 130, 47]
    cache, table = _paged(seq_lens, block_size, num_kv_heads, head_dim, dtype, g)
    q = torch.randn(len(seq_lens), num_heads + 1, head_dim, generator=g).to(dtype)[:, :num_heads]
    scale = head_dim ** -0.5 * 2  # sharper softmaxes: the online max rescale matters
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out = cpu_decode.decode_attention(q, cache, table, lens, scale, lib=lib)
    expected = _reference(q, cache, table, seq_lens, scale, None, None, None)
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("path", _RUNNABLE, ids=lambda p: p.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window,cap,sinks", [(7, None, False), (40, 0.8, False), (None, 1.5, True),
                                              (20, None, True)], ids=["window", "window-cap", "cap-sinks",
                                                                      "window-sinks"])
def test_windows_softcap_sinks(path, dtype, window, cap, sinks) -> None:
    lib = cpu_decode.library(path)
    if lib is None:
        skip_or_fail(f"the C decode kernel for path {path.name} did not build")
    g = torch.Generator().manual_seed(7)
    num_heads, num_kv_heads, head_dim, block_size = 6, 2, 64, 16
    seq_lens = [1, 7, 8, 19, 40, 41, 100]
    cache, table = _paged(seq_lens, block_size, num_kv_heads, head_dim, dtype, g)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=g).to(dtype)
    sink_t = torch.tensor([0.7, -1.5, 2.5, 0.0, 1.0, -0.3]) if sinks else None
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out = cpu_decode.decode_attention(q, cache, table, lens, 0.3, window, cap, sink_t, lib=lib)
    expected = _reference(q, cache, table, seq_lens, 0.3, window, cap, sink_t)
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_long_context_split_over_threads(threads, dtype) -> None:
    """Few sequences with long contexts: each context is split into parts merged at the end
    (with sinks and a window cutting the first part's range), the same as one part."""
    g = torch.Generator().manual_seed(threads)
    num_heads, num_kv_heads, head_dim, block_size = 8, 2, 64, 16
    seq_lens = [2500, 300]  # 22k (key, head) pairs: enough work to go parallel
    cache, table = _paged(seq_lens, block_size, num_kv_heads, head_dim, dtype, g)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=g).to(dtype)
    sinks = torch.linspace(-1, 2, num_heads)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for window in (None, 2100):
            out = cpu_decode.decode_attention(q, cache, table, lens, 0.25, window, None, sinks)
            expected = _reference(q, cache, table, seq_lens, 0.25, window, None, sinks)
            tol = 2e-5 if dtype == torch.float32 else 1e-2
            torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("path", _RUNNABLE, ids=lambda p: p.name)
@pytest.mark.parametrize("heads,head_dim", [((9, 3), 64), ((8, 2), 128), ((8, 1), 128), ((4, 2), 32)],
                         ids=["9x3-64", "8x2-128", "8x1-128", "4x2-32"])
@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_is_the_rounded_exact_answer(path, heads, head_dim, threads) -> None:
    """bf16 cache and q: the output is float64 attention over the same bf16 inputs, rounded once to
    bf16 (float32 scores, weights and sums lose nothing that shows), bar a few elements a bf16 ulp
    off. Rounding anything on the way (the weights to bf16, say) fails this; the reference test's
    1e-2 does not see it. Enough sequences that an item takes every KV head (the bf16 fast path's
    whole-sequence walk; 8x1 and head size 32 take the per-head walk), and one thread or two."""
    lib = cpu_decode.library(path)
    if lib is None:
        skip_or_fail(f"the C decode kernel for path {path.name} did not build")
    g = torch.Generator().manual_seed(5 + head_dim)
    num_heads, num_kv_heads = heads
    seq_lens = [200, 150, 64, 31, 180, 97, 120, 160, 1, 16, 17, 77]
    cache, table = _paged(seq_lens, 16, num_kv_heads, head_dim, torch.bfloat16, g)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=g).to(torch.bfloat16)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = cpu_decode.decode_attention(q, cache, table, torch.tensor(seq_lens, dtype=torch.int32), 0.25, lib=lib)
    finally:
        torch.set_num_threads(before)
    expected = _reference(q, cache, table, seq_lens, 0.25, None, None, None)
    rounded = expected.to(torch.bfloat16)
    off = out != rounded
    assert off.float().mean() < 0.005, f"{int(off.sum())} of {off.numel()} outputs are not the rounded answer"
    # the others: a bf16 ulp away (8 significant bits), or float32 sums' error near 0 (values ~1)
    near = (out.double() - rounded.double()).abs() <= torch.maximum(out.double().abs(), rounded.double().abs()) * 2.0 ** -7 + 1e-6
    assert near[off].all()
