"""TritonAttentionBackend under Triton's CPU interpreter, against the float64 naive reference and
the torch reference backend (small shapes: the interpreter is slow).

Cache slots that no sequence owns are poisoned with NaN, so a kernel that reads past a
sequence's keys (or through a table entry it should have masked) shows up as NaN.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are defined: before the first import

import dataclasses
import math
import subprocess
import sys

import pytest
import torch

from tests.helpers.triton_required import require_triton

require_triton()  # before the kernels' module imports triton

from tests.layers.test_attention import make_case
from tokenmill.layers.attention.torch_ref import TorchRefAttentionBackend
from tokenmill.layers.attention.triton_backend import (
    MAX_KV_SPLITS,
    TritonAttentionBackend,
    TritonAttentionConfig,
    choose_kv_splits,
    plan_launch,
)

TOL = {torch.float32: 1e-4, torch.float16: 2e-3}

# (contexts, query lengths): fresh prefills, chunked prefills over cached context, single decodes,
# multi-token decodes (3, 5) and a zero-length row, interleaved.
MIXED = ([0, 40, 70, 12, 130, 25, 9, 0], [20, 24, 1, 0, 1, 3, 5, 9])
# max_query_len <= 8: decode tiles, split-KV. The last row's queries straddle a KV tile boundary
# (keys 0..66 in tiles of 64): its first queries see nothing of the last share.
DECODES = ([150, 0, 40, 12, 97, 63, 62], [1, 1, 3, 0, 5, 1, 5])
LONG_PREFILL = ([0, 30], [70, 66])  # >= 64 query tokens per sequence on average: wide tiles


def run_case(contexts, q_lens, *, block_size, heads, dtype, head_dim=64, pad_tokens=3, config=None,
             meta_bounds=None, sm_count=None, seed=0):
    num_heads, num_kv_heads = heads
    case = make_case(contexts, q_lens, block_size, num_heads, num_kv_heads, dtype, "cpu",
                     pad_tokens=pad_tokens, seed=seed, head_dim=head_dim)
    scale = 1.0 / math.sqrt(head_dim)
    meta = case.meta if meta_bounds is None else dataclasses.replace(case.meta, **meta_bounds)

    ref_cache = case.kv_cache.clone()
    ref_out = TorchRefAttentionBackend(num_heads, num_kv_heads, head_dim, scale).forward(
        case.q, case.k, case.v, ref_cache, case.meta)

    flat = case.kv_cache.view(2, -1, num_kv_heads, head_dim)
    flat[:, ~case.written] = float("nan")  # slots no sequence owns: must be neither read nor written
    before = case.kv_cache.clone()
    backend = TritonAttentionBackend(num_heads, num_kv_heads, head_dim, scale, config=config)
    if sm_count is not None:
        backend._sm_count = sm_count
    out = backend.forward(case.q, case.k, case.v, case.kv_cache, meta)

    n = case.meta.num_tokens
    tol = TOL[dtype]
    assert out.shape == case.q.shape and out.dtype == dtype
    assert not out.isnan().any()
    torch.testing.assert_close(out[:n].double(), case.expected, atol=tol, rtol=tol)
    torch.testing.assert_close(out[:n], ref_out[:n], atol=tol, rtol=tol)
    assert not out[n:].any(), "padding rows must come out as zeros"

    # This step's K/V are in their slots; every other slot (context, unowned, padding) is untouched.
    slots = case.meta.slot_mapping
    real = slots >= 0
    assert torch.equal(flat[0, slots[real]], case.k[real]) and torch.equal(flat[1, slots[real]], case.v[real])
    new = torch.zeros(flat.shape[1], dtype=torch.bool)
    new[slots[real]] = True
    flat_before = before.view(2, -1, num_kv_heads, head_dim)
    torch.testing.assert_close(flat[:, ~new], flat_before[:, ~new], rtol=0, atol=0, equal_nan=True)
    return out


@pytest.mark.parametrize("dtype, head_dim, heads, block_size", [
    (torch.float32, 64, (4, 4), 16),
    (torch.float32, 64, (4, 2), 32),
    (torch.float16, 64, (8, 2), 16),
    (torch.float32, 64, (6, 2), 16),  # a group of 3 (SmolLM2), padded to 4 in the tile
    (torch.float16, 128, (4, 1), 32),
    (torch.float32, 80, (4, 2), 128),  # head_dim padded to 128 in the tile; a KV tile inside one page
])
def test_mixed_batch(dtype, head_dim, heads, block_size) -> None:
    run_case(*MIXED, block_size=block_size, heads=heads, dtype=dtype, head_dim=head_dim)


def test_long_prefill_wide_tiles() -> None:
    run_case(*LONG_PREFILL, block_size=16, heads=(8, 2), dtype=torch.float16)


@pytest.mark.parametrize("dtype, heads, splits", [
    (torch.float32, (4, 1), 1),
    (torch.float32, (4, 2), 4),  # 1..3 KV tiles per row over 4 shares: some shares are empty
    (torch.float16, (8, 2), 3),
])
def test_decode_batch_split_kv(dtype, heads, splits) -> None:
    run_case(*DECODES, block_size=16, heads=heads, dtype=dtype, config=TritonAttentionConfig(kv_splits=splits))


def test_graph_capture_bounds() -> None:
    """A decode graph is captured with max_query_len=1 and max_seq_len=max_model_len: the automatic
    split count then follows the bound (many shares, mostly empty), and results must not change."""
    contexts, q_lens = [150, 7, 60], [1, 1, 1]
    config = TritonAttentionConfig()
    plan = plan_launch(config, 4, 2, 3, 3, 1, 4096, sm_count=64)
    assert plan.num_splits == 16
    run_case(contexts, q_lens, block_size=16, heads=(4, 2), dtype=torch.float32, pad_tokens=2,
             meta_bounds={"max_query_len": 1, "max_seq_len": 4096}, sm_count=64)


def test_only_padding_rows() -> None:
    """Every row is padding (a graph replayed with no real sequence but a padded one): zeros, no writes."""
    out = run_case([5], [0], block_size=16, heads=(4, 2), dtype=torch.float32, pad_tokens=4)
    assert out.shape[0] == 4


@pytest.mark.parametrize("splits", [1, 4])
def test_padding_sequence_of_one_row_and_no_context(splits) -> None:
    """Another padding convention: a padded sequence with one row, slot -1 and seq_len 0 gives zeros."""
    case = make_case([30, 5], [1, 1], 16, 4, 2, torch.float32, "cpu", pad_tokens=1, head_dim=64)
    m = case.meta
    qsl = torch.cat([m.query_start_loc, m.query_start_loc[-1:] + 1])
    lens = torch.cat([m.seq_lens, torch.zeros(1, dtype=torch.int32)])
    table = torch.cat([m.block_table, torch.zeros_like(m.block_table[:1])])
    meta = dataclasses.replace(m, query_start_loc=qsl, seq_lens=lens, block_table=table,
                               query_start_loc_cpu=qsl, seq_lens_cpu=lens)
    before = case.kv_cache.clone()
    backend = TritonAttentionBackend(4, 2, 64, 0.125, config=TritonAttentionConfig(kv_splits=splits))
    out = backend.forward(case.q, case.k, case.v, case.kv_cache, meta)
    torch.testing.assert_close(out[:2].double(), case.expected, atol=1e-4, rtol=1e-4)
    assert not out[2].any()
    assert torch.equal(case.kv_cache.view(2, -1, 2, 64)[:, ~case.written], before.view(2, -1, 2, 64)[:, ~case.written])


def test_split_rule_uses_static_numbers_only() -> None:
    config = TritonAttentionConfig()
    # Enough programs without splitting: none.
    assert choose_kv_splits(config, 256, 8, 8192, 132) == 1
    # Batch 1: split up to the cap, but never into shares shorter than min_keys_per_split.
    assert choose_kv_splits(config, 1, 8, 8192, 132) == 32  # 33 wanted (2 waves), a power of two
    # 8 KV heads x 33 shares fill 2 waves of 132 SMs: rounded down to a power of two.
    assert choose_kv_splits(config, 1, 8, 65536, 132) == 32
    assert choose_kv_splits(config, 3, 8, 65536, 132) == 8  # 11 wanted
    assert choose_kv_splits(config, 1, 8, 512, 132) == 8  # 512 keys / 64 per share
    assert choose_kv_splits(config, 1, 8, 100, 132) == 1
    assert choose_kv_splits(dataclasses.replace(config, min_keys_per_split=256), 1, 8, 512, 132) == 2
    assert choose_kv_splits(TritonAttentionConfig(kv_splits=999), 1, 8, 100, 132) == MAX_KV_SPLITS
    # Prefill-shaped launches never split; decode tiles hold a whole multi-token decode.
    assert plan_launch(config, 32, 8, 600, 4, 512, 8192, 132).num_splits == 1
    assert plan_launch(config, 32, 8, 40, 8, 5, 8192, 132).block_q == 8
    assert plan_launch(config, 32, 8, 8, 8, 1, 8192, 132).block_q == 4  # 4 tokens x 4 heads = 16 rows


def test_config_override_from_the_environment(monkeypatch) -> None:
    """TOKENMILL_ATTN_CONFIG (A/B runs): a DecodeTiles field replaces that field of the named tiles only,
    other keys the config's fields; an unknown field is refused by name; a config given explicitly wins."""
    from tokenmill.layers.attention.triton_backend import CONFIG_ENV

    monkeypatch.setenv(CONFIG_ENV, '{"fp8_decode_tiles": {"block_n": 64, "stages": 3}, "wide_rows": 64}')
    config = TritonAttentionBackend(32, 8, 128, 0.1).config
    default = TritonAttentionConfig()
    assert config.fp8_decode_tiles == dataclasses.replace(default.fp8_decode_tiles, block_n=64, stages=3)
    assert config.wide_rows == 64 and config.decode_tiles == default.decode_tiles
    assert TritonAttentionBackend(32, 8, 128, 0.1, config=default).config == default
    monkeypatch.setenv(CONFIG_ENV, '{"no_such_field": 1}')
    with pytest.raises(ValueError, match="no_such_field"):
        TritonAttentionBackend(32, 8, 128, 0.1)


def test_import_without_triton() -> None:
    """CPU-only installs without triton still import tokenmill and the backend module."""
    code = ("import sys; sys.modules['triton'] = None\n"
            "import tokenmill\n"
            "from tokenmill.layers.attention.triton_backend import TritonAttentionBackend\n"
            "with __import__('torch').device('meta'):\n"
            "    TritonAttentionBackend(4, 2, 64, 0.125)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


def test_min_keys_per_split_switch(monkeypatch) -> None:
    """TOKENMILL_ATTN_MIN_KEYS_PER_SPLIT (A/B timing): the default config's split rule takes it
    (batch 1, 8 KV heads, 768 keys, 132 SMs: 8 shares by default, 2 at 256 keys a share); a config
    passed in is kept as it is."""
    from tokenmill.layers.attention import triton_backend as tb

    assert tb.choose_kv_splits(TritonAttentionBackend(8, 8, 64, 0.125).config, 1, 8, 768, 132) == 8
    monkeypatch.setenv(tb.MIN_KEYS_ENV, "256")
    backend = TritonAttentionBackend(8, 8, 64, 0.125)
    assert backend.config.min_keys_per_split == 256
    assert tb.choose_kv_splits(backend.config, 1, 8, 768, 132) == 2
    given = TritonAttentionConfig()
    assert TritonAttentionBackend(8, 8, 64, 0.125, config=given).config is given


@pytest.mark.parametrize("dtype, heads, splits", [(torch.float32, (4, 2), 4), (torch.float16, (8, 2), 16)])
def test_prewait_split_decodes(monkeypatch, dtype, heads, splits) -> None:
    """Split decode launches read the step's inputs and their first tile's cached K/V before the PDL
    wait (PREWAIT), then this step's keys of that tile: the references' values (run_case), and
    those of the launch without it; TOKENMILL_ATTN_PREWAIT=0 turns it off; unsplit and prefill
    launches never take it."""
    from tokenmill.layers.attention import triton_backend as tb

    config = TritonAttentionConfig(kv_splits=splits)
    plan = plan_launch(config, 32, 8, 1, 1, 1, 784, 132)
    assert plan.prewait and plan.num_warps == 8 and config.prewait_rope
    assert not plan_launch(TritonAttentionConfig(kv_splits=1), 32, 8, 1, 1, 1, 784, 132).prewait
    assert not plan_launch(config, 32, 8, 600, 4, 512, 8192, 132).prewait
    # more programs than SMs (one prewait program a SM): the launch without it
    assert not plan_launch(config, 32, 8, 32, 32, 1, 784, 132).prewait
    assert plan_launch(config, 32, 8, 32, 32, 1, 784, 132).num_warps == 4
    off_config = tb.without_prewait(config)
    off_plan = plan_launch(off_config, 32, 8, 1, 1, 1, 784, 132)
    assert not off_plan.prewait and off_plan.num_warps == 4 and not off_config.prewait_rope  # main's launch
    # (sm_count: the CPU's 1 would take more programs than SMs: the launch without it)
    on = run_case(*DECODES, block_size=16, heads=heads, dtype=dtype, config=config, sm_count=1024)
    off = run_case(*DECODES, block_size=16, heads=heads, dtype=dtype, config=off_config, sm_count=1024)
    torch.testing.assert_close(on, off, atol=TOL[dtype] / 10, rtol=TOL[dtype] / 10)
    monkeypatch.setenv(tb.PREWAIT_ENV, "0")
    assert TritonAttentionBackend(8, 2, 64, 0.125).config == tb.without_prewait(TritonAttentionConfig())
    monkeypatch.setenv(tb.PREWAIT_ENV, "64")
    narrow = TritonAttentionBackend(8, 2, 64, 0.125).config
    plan = plan_launch(narrow, 32, 8, 1, 1, 1, 784, 132)
    assert plan.prewait and (plan.block_n, plan.num_warps, plan.num_splits) == (64, 4, 16)
