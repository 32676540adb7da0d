"""The Triton kernel's unmasked walk over interior KV tiles (keys every row of a query tile sees whole),
under TRITON_INTERPRET=1 against the float64 reference, with windows wider than a KV tile so that the
interior starts after the window of a tile's LAST query, and contexts ending on tile boundaries.

Blocks wholly before a sequence's window are poisoned with NaN (tests/layers/test_attention_windows.py).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are defined: before the first import

import math

import pytest
import torch

from tests.helpers.triton_required import require_triton

require_triton()

from tests.layers.test_attention_windows import poisoned_case, run_backend
from tokenmill.layers.attention.triton_backend import DecodeTiles, TritonAttentionBackend, TritonAttentionConfig

# Chunks over cached context (query tiles of several tokens), decodes whose context ends on a KV
# tile boundary (63 + 1 = 64 keys) or just past it, a multi-token decode and a fresh prefill.
MIX = ([100, 63, 64, 130, 0, 47], [40, 1, 1, 5, 70, 17])


# Every window with each value of every other axis (16- and 32-key tiles, split or not, block-table
# lookup or not), and each launch with two windows: 9 of the 12 pairs of windows and launches.
@pytest.mark.parametrize("window,block_n,splits,lookup", [
    (40, 16, None, False), (23, 16, None, False), (None, 16, 3, True), (23, 16, 3, True),
    (None, 32, None, True), (40, 32, None, True), (None, 32, 2, False), (40, 32, 2, False), (23, 32, 2, False)])
def test_interior_tiles(window, block_n, splits, lookup):
    case, _ = poisoned_case(window, None, 8, heads=(4, 2), head_dim=16, mix=MIX)
    config = TritonAttentionConfig(block_n=block_n, kv_splits=splits, prefill_rows=32, lookup_blocks=lookup)
    backend = TritonAttentionBackend(4, 2, 16, 1 / math.sqrt(16), window, None, config=config)
    torch.testing.assert_close(run_backend(backend, case), case.expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("window,splits,min_rows,lookup", [(None, None, 16, False), (50, 3, 16, True),
                                                           (50, None, 64, False), (None, 2, 64, True)])
def test_decode_tiles_of_16_and_64_rows(window, splits, min_rows, lookup):
    """Decode launches with 16-key tiles (several unmasked ones per decode) and tiles of 16 or 64 query
    rows (the decode rows padded four times further), one-token decodes and verification-sized ones
    (3 and 6 tokens: several query rows of one sequence in a tile)."""
    decodes = ([100, 63, 62, 130, 44, 0], [1, 1, 3, 1, 6, 1])  # the 3- and 6-token ones cross a tile edge
    case, _ = poisoned_case(window, None, 8, heads=(4, 2), head_dim=16, mix=decodes)
    config = TritonAttentionConfig(block_n=16, decode_tiles=DecodeTiles(16, min_rows=min_rows), kv_splits=splits,
                                   prefill_rows=32, lookup_blocks=lookup)
    backend = TritonAttentionBackend(4, 2, 16, 1 / math.sqrt(16), window, None, config=config)
    torch.testing.assert_close(run_backend(backend, case), case.expected, atol=1e-4, rtol=1e-4)


def test_interior_walk_matches_masked_walk():
    """interior=False (every tile masked) is the same attention."""
    case, _ = poisoned_case(23, 0.8, 8, heads=(4, 2), head_dim=16, mix=MIX)
    outs = []
    for interior in (True, False):
        config = TritonAttentionConfig(block_n=16, interior=interior)
        backend = TritonAttentionBackend(4, 2, 16, 1 / math.sqrt(16), 23, 0.8, config=config)
        outs.append(run_backend(backend, case))  # (the K/V write is the same both times)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs[0], case.expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("splits", [48])  # one KV tile a share: 44 shares, two reduce chunks, empty shares
def test_many_splits_reduce_in_chunks(splits):
    """More shares than the reduce merges in one step (32): every chunk of partials counts."""
    mix = ([700, 90, 0], [1, 1, 1])  # 44 KV tiles of 16, a short row (many empty shares), a first token
    case, _ = poisoned_case(None, None, 16, heads=(4, 2), head_dim=16, mix=mix)
    backend = TritonAttentionBackend(4, 2, 16, 1 / math.sqrt(16),
                                     config=TritonAttentionConfig(block_n=16, kv_splits=splits))
    torch.testing.assert_close(run_backend(backend, case), case.expected, atol=1e-4, rtol=1e-4)


def test_sequence_search_over_several_steps(monkeypatch):
    """The kernel finds each tile's sequence reading query_start_loc SEARCH_CHUNK entries a step:
    with a chunk of 4, nine sequences take three steps."""
    from tokenmill.layers.attention import triton_paged_attention

    monkeypatch.setattr(triton_paged_attention, "SEARCH_CHUNK", 4)
    mix = ([30, 0, 5, 17, 40, 2, 0, 9, 33], [1, 6, 1, 2, 1, 1, 3, 1, 1])
    case, _ = poisoned_case(None, None, 8, heads=(4, 2), head_dim=16, mix=mix)
    backend = TritonAttentionBackend(4, 2, 16, 1 / math.sqrt(16), config=TritonAttentionConfig(block_n=16))
    torch.testing.assert_close(run_backend(backend, case), case.expected, atol=1e-4, rtol=1e-4)


def test_fp8_conversion_on_load_follows_the_dtype_into_multi_token_decode_tiles():
    """The fp8 decode tiles' conversion on load (2: values only) holds for multi-token decode tiles of
    an fp8 cache too (without it their V tile is read one byte per load), not for bf16 ones, and
    prefill tiles keep the config-wide setting."""
    from tokenmill.layers.attention.triton_backend import plan_launch

    config = TritonAttentionConfig(fp8_decode_tiles=DecodeTiles(128, 4, 2, fp8_convert_on_load=2),
                                   fp8_split_decode_tiles=DecodeTiles(128, 4, 4, fp8_convert_on_load=2))
    multi = plan_launch(config, 32, 8, 256 * 5, 256, 5, 4096, 132, kv_fp8=True)
    assert multi.block_q == 8 and multi.fp8_convert_on_load == 2
    assert not plan_launch(config, 32, 8, 256 * 5, 256, 5, 4096, 132).fp8_convert_on_load
    assert not plan_launch(config, 32, 8, 600, 4, 512, 4096, 132, kv_fp8=True).fp8_convert_on_load
    assert plan_launch(config, 32, 8, 256, 256, 1, 4096, 132, kv_fp8=True).fp8_convert_on_load == 2


def test_decode_launch_parameters_per_cache_dtype():
    """Single-token decode launches take their DecodeTiles by cache dtype and split (fp8 split -> fp8 ->
    split -> decode_tiles, the first set); multi-token decode tiles and prefill launches none of them."""
    from tokenmill.layers.attention.triton_backend import plan_launch

    config = TritonAttentionConfig(block_n=64, num_stages=2, decode_warps=4,
                                   decode_tiles=DecodeTiles(32, 4, 3), split_decode_tiles=DecodeTiles(16, 8, 1),
                                   fp8_decode_tiles=DecodeTiles(128, 2, 1),
                                   fp8_split_decode_tiles=DecodeTiles(128, 8, 4, min_rows=64))
    bf16 = plan_launch(config, 32, 8, 256, 256, 1, 4096, 132)
    bf16_split = plan_launch(config, 32, 8, 1, 1, 1, 4096, 132)
    fp8 = plan_launch(config, 32, 8, 256, 256, 1, 4096, 132, kv_fp8=True)
    fp8_split = plan_launch(config, 32, 8, 1, 1, 1, 4096, 132, kv_fp8=True)
    multi = plan_launch(config, 32, 8, 256 * 5, 256, 5, 4096, 132, kv_fp8=True)
    prefill = plan_launch(config, 32, 8, 600, 4, 512, 4096, 132, kv_fp8=True)
    assert (bf16.block_q, bf16.block_n, bf16.num_stages, bf16.num_warps, bf16.num_splits) == (4, 32, 3, 4, 1)
    assert (bf16_split.block_n, bf16_split.num_stages, bf16_split.num_warps) == (16, 1, 8)
    assert (fp8.block_q, fp8.block_n, fp8.num_stages, fp8.num_warps) == (4, 128, 1, 2)
    assert (fp8_split.block_q, fp8_split.block_n, fp8_split.num_stages, fp8_split.num_warps) == (16, 128, 4, 8)
    assert fp8_split.num_splits == 32  # 8 programs: 33 wanted (4096 // 64 = 64 by length), a power of two
    assert (multi.block_q, multi.block_n, multi.num_stages, multi.num_warps) == (8, 64, 2, 4)
    assert (prefill.block_n, prefill.num_stages) == (64, 2)
    unset = {"split_decode_tiles": None, "fp8_decode_tiles": None, "fp8_split_decode_tiles": None}
    plain = plan_launch(TritonAttentionConfig(decode_tiles=DecodeTiles(16, 4, 1), **unset), 32, 8, 1, 1, 1, 4096, 132,
                        kv_fp8=True)
    assert (plain.block_n, plain.num_stages, plain.num_warps, plain.num_splits) == (16, 1, 4, 32)
    # The round-trip options: per DecodeTiles (here the fp8 split launch's), or the config's for all.
    tiles = dict(config.__dict__, fp8_split_decode_tiles=DecodeTiles(128, 4, 4, early_v_load=True, table_prefetch=True,
                                                                      fp8_convert_on_load=True))
    on = plan_launch(TritonAttentionConfig(**tiles), 32, 8, 1, 1, 1, 4096, 132, kv_fp8=True)
    off = plan_launch(TritonAttentionConfig(**tiles), 32, 8, 256, 256, 1, 4096, 132, kv_fp8=True)
    assert (on.early_v_load, on.table_prefetch, on.fp8_convert_on_load) == (True, True, True)
    assert (off.early_v_load, off.table_prefetch, off.fp8_convert_on_load) == (False, False, False)
    everywhere = TritonAttentionConfig(early_v_load=True, table_prefetch=True, fp8_convert_on_load=True)
    pre = plan_launch(everywhere, 32, 8, 600, 4, 512, 4096, 132, kv_fp8=True)
    assert (pre.early_v_load, pre.table_prefetch, pre.fp8_convert_on_load) == (False, True, True)  # no early V in prefill
    dec = plan_launch(everywhere, 32, 8, 256, 256, 1, 4096, 132, kv_fp8=True)
    assert (dec.early_v_load, dec.table_prefetch, dec.fp8_convert_on_load) == (True, True, True)


@pytest.mark.parametrize("window,splits,early_v", [(None, None, False), (40, 3, True), (23, None, True), (None, 2, False)])
def test_table_prefetch_and_early_v(window, splits, early_v):
    """table_prefetch (each interior tile's block-table lookups issued one tile ahead; the lookahead
    past the last interior tile reads nothing) and early_v_load (V loaded with K, decode launches),
    over windows (blocks before them poisoned with NaN), splits and chunked prefills."""
    decodes = ([100, 63, 62, 130, 44, 0], [1, 1, 3, 1, 6, 1])
    for mix in (MIX, decodes):
        case, _ = poisoned_case(window, None, 8, heads=(4, 2), head_dim=16, mix=mix)
        config = TritonAttentionConfig(block_n=16, decode_tiles=DecodeTiles(16), kv_splits=splits, prefill_rows=32,
                                       table_prefetch=True, early_v_load=early_v)
        backend = TritonAttentionBackend(4, 2, 16, 1 / math.sqrt(16), window, None, config=config)
        torch.testing.assert_close(run_backend(backend, case), case.expected, atol=1e-4, rtol=1e-4)
