"""The large-batch quantized GEMM variants under TRITON_INTERPRET=1 against torch references: the
Triton fp8 W8A8 GEMM (row-wise scales in the epilogue), the TMA-fed one, and the per-size choice of
the W8A8 GEMM (`stream_tiles.w8a8_path`).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from tests.helpers.requirements import require_module
from tokenmill.layers.quantization import fp8_ops

require_module("triton")  # skipped on a machine without it; in CI, missing fails


@pytest.mark.parametrize("m,tiles", [(37, (16, 32, 64, 2, 4, 2)), (5, (16, 16, 32, 1, 4, 1)),
                                     (64, (32, 64, 128, 8, 4, 3))])
def test_fp8_gemm_matches_scaled_mm_reference(m, tiles):
    from tokenmill.layers.quantization.triton_fp8_gemm import fp8_gemm

    g = torch.Generator().manual_seed(m)
    x, w = torch.randn(m, 256, generator=g) * 3, torch.randn(80, 256, generator=g) * 0.05
    xq, xs = fp8_ops.quantize_rows(x)
    wq, ws = fp8_ops.quantize_rows(w)
    ref = fp8_ops.scaled_mm_reference(xq, xs, wq, ws, torch.float32)
    out = fp8_gemm(xq.float(), xs, wq.float(), ws, torch.float32, *tiles)  # float32 holding the fp8 values
    torch.testing.assert_close(out, ref, atol=1e-4 * ref.abs().max().item(), rtol=1e-5)
    assert (out - x @ w.t()).abs().max() > 1e-3  # both operands really are quantized


@pytest.mark.parametrize("split", [2, 3])
def test_fp8_gemm_split_k_matches_reference_and_rezeroes_counters(split):
    """Split-K: the K slices (4 K steps: 2 + 2, or 2 + 2 + 0 for split 3) summed by the tile's
    last program, the counters back at zero for the next call (graph replays)."""
    from tokenmill.layers.quantization.triton_fp8_gemm import fp8_gemm

    g = torch.Generator().manual_seed(split)
    x, w = torch.randn(20, 256, generator=g) * 3, torch.randn(48, 256, generator=g) * 0.05
    xq, xs = fp8_ops.quantize_rows(x)
    wq, ws = fp8_ops.quantize_rows(w)
    ref = fp8_ops.scaled_mm_reference(xq, xs, wq, ws, torch.float32)
    counters = torch.zeros(16, dtype=torch.int32)
    for _ in range(2):
        out = fp8_gemm(xq.float(), xs, wq.float(), ws, torch.float32, 16, 16, 64, 2, 4, 1, split=split,
                       counters=counters)
        torch.testing.assert_close(out, ref, atol=1e-4 * ref.abs().max().item(), rtol=1e-5)
        assert not counters.any()


def test_fp8_gemm_refuses_a_ragged_k():
    from tokenmill.layers.quantization.triton_fp8_gemm import fp8_gemm

    with pytest.raises(ValueError, match="BLOCK_K 128"):
        fp8_gemm(torch.zeros(4, 192), torch.ones(4, 1), torch.zeros(32, 192), torch.ones(32, 1), torch.float32)


def test_w8a8_path_by_rows(monkeypatch):
    from tokenmill.layers.quantization import stream_tiles as st

    assert st.w8a8_path(300, 4096, 2048) == ("scaled_mm", None)  # the default for a shape never measured
    monkeypatch.setattr(st, "W8A8_PATHS", ((0, "scaled_mm"), (128, "tensorwise"), (512, (128, 128, 128, 8, 8, 4))))
    assert st.w8a8_path(64, 4096, 2048) == ("scaled_mm", None)
    assert st.w8a8_path(128, 4096, 2048) == ("tensorwise", None)
    assert st.w8a8_path(2048, 4096, 2048) == ("triton", (128, 128, 128, 8, 8, 4))
    assert st.w8a8_path(2048, 4096, 4000) == ("scaled_mm", None)  # K not a multiple of the Triton BLOCK_K


def test_w8a8_table_override_from_the_environment(monkeypatch):
    """TOKENMILL_W8A8_TABLE (A/B runs): "ROWS,N,K" keys, GEMM names as the table's, lists as Triton tiles;
    read where a path is chosen, so an engine started with it set takes it."""
    from tokenmill.layers.quantization import stream_tiles as st

    assert st.w8a8_path(256, 4096, 6144) == ("scaled_mm", None)
    monkeypatch.setenv(st.W8A8_TABLE_ENV, '{"256,4096,6144": [128, 64, 128, 8, 4, 4, 2]}')
    assert st.w8a8_path(200, 4096, 6144) == ("triton", (128, 64, 128, 8, 4, 4, 2))

    assert st.w8a8_override('{"256,4096,4096": "tma-m128n64k128g8w4st5s1-swap", "256,4096,14336": "scaled_mm", '
                            '"64,512,1024": [64, 64, 256, 1, 4, 3, 2]}') == {
        (256, 4096, 4096): "tma-m128n64k128g8w4st5s1-swap", (256, 4096, 14336): "scaled_mm",
        (64, 512, 1024): (64, 64, 256, 1, 4, 3, 2)}


def test_w8a8_measured_shapes_take_their_bucket_s_gemm(monkeypatch):
    """A measured (rows bucket, N, K) wins over the row-count defaults: 17..32 rows take the first
    bucket's tiles (with split-K), 200 rows the 256 bucket's, 9000 rows (past every bucket) the defaults."""
    from tokenmill.layers.quantization import stream_tiles as st

    monkeypatch.setattr(st, "W8A8_MEASURED", {(32, 512, 1024): (64, 64, 256, 1, 4, 3, 4), (256, 512, 1024): "tensorwise"})
    assert st.w8a8_path(17, 512, 1024) == ("triton", (64, 64, 256, 1, 4, 3, 4))
    assert st.w8a8_path(200, 512, 1024) == ("tensorwise", None)
    assert st.w8a8_path(200, 512, 2048) == ("scaled_mm", None)
    assert st.w8a8_path(300, 512, 1024) == ("scaled_mm", None)
    assert st.w8a8_path(20000, 512, 1024) == ("scaled_mm", None)


@pytest.mark.parametrize("swap,persistent,split,tstore", [
    (False, False, 1, 0), (True, False, 1, 0), (False, True, 3, 0), (True, True, 2, 0), (True, False, 3, 0),
    (False, True, 1, 1), (False, True, 1, 2), (True, True, 1, 2), (False, False, 3, 2)])
def test_fp8_tma_gemm_matches_scaled_mm_reference(swap, persistent, split, tstore):
    """The TMA-fed W8A8 GEMM (descriptors in the interpreter) against the float reference: plain
    and swapped operand tiles, one program per unit or persistent ones (3 programs for 15 units),
    split-K summed by each tile's last slice with the counters back at zero (twice: graph replays),
    the output tile stored by TMA whole or in two halves (37 rows: the last tile's are clipped;
    split-K tiles store plainly)."""
    from tokenmill.layers.quantization.triton_fp8_tma import TmaTiles, fp8_gemm_tma

    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(37, 256, generator=g) * 3, torch.randn(80, 256, generator=g) * 0.05
    xq, xs = fp8_ops.quantize_rows(x)
    wq, ws = fp8_ops.quantize_rows(w)
    ref = fp8_ops.scaled_mm_reference(xq, xs, wq, ws, torch.float32)
    tiles = TmaTiles(16, 32, 64, 2, 4, 2, split, swap=swap, persistent=persistent, tstore=tstore)
    assert TmaTiles.parse(tiles.label()) == tiles
    counters = torch.zeros(16, dtype=torch.int32)
    for _ in range(2):
        out = fp8_gemm_tma(xq.float(), xs, wq.float(), ws, torch.float32, tiles, counters=counters, sms=3)
        torch.testing.assert_close(out, ref, atol=1e-4 * ref.abs().max().item(), rtol=1e-5)
        assert not counters.any()
    assert (out - x @ w.t()).abs().max() > 1e-3  # both operands really are quantized


def test_fp8_tma_gemm_refuses_unaligned_rows():
    from tokenmill.layers.quantization.triton_fp8_tma import TmaTiles, fp8_gemm_tma, tma_refusal

    x = torch.zeros(8, 72)[:, :68]  # rows of 68 floats inside 72: K-contiguous, row stride 288 bytes ok ...
    assert tma_refusal(x, torch.zeros(16, 64)) is None
    bad = torch.zeros(8, 70)[:, :64]  # ... but 280-byte rows are not 16-byte aligned
    assert "activations" in tma_refusal(bad, torch.zeros(16, 64))
    with pytest.raises(ValueError, match="16-byte aligned"):
        fp8_gemm_tma(bad, torch.ones(8, 1), torch.zeros(16, 64), torch.ones(16, 1), torch.float32,
                     TmaTiles(16, 16, 32))


def test_w8a8_table_entry_takes_the_tma_gemm(monkeypatch):
    """A "tma-..." W8A8_MEASURED entry routes the engine's W8A8 call (`fp8._w8a8_mm`) to the TMA
    GEMM with those tiles (split-K with the layer's counters); the result equals the reference."""
    from types import SimpleNamespace

    from tokenmill.layers.quantization import stream_tiles as st
    from tokenmill.layers.quantization import triton_fp8_tma
    from tokenmill.layers.quantization.fp8 import _w8a8_mm

    label = triton_fp8_tma.TmaTiles(16, 32, 64, 2, 4, 2, split=2, swap=True).label()
    monkeypatch.setattr(st, "W8A8_MEASURED", {(64, 80, 256): label})
    assert st.w8a8_path(40, 80, 256) == ("tma", label)
    assert st.w8a8_path(40, 96, 256) == ("scaled_mm", None)
    seen = []
    real = triton_fp8_tma.fp8_gemm_tma
    monkeypatch.setattr(triton_fp8_tma, "fp8_gemm_tma", lambda *a, **kw: seen.append(a[5]) or real(*a, **kw))
    g = torch.Generator().manual_seed(3)
    xq, xs = fp8_ops.quantize_rows(torch.randn(40, 256, generator=g))
    wq, ws = fp8_ops.quantize_rows(torch.randn(80, 256, generator=g) * 0.05)
    counters = torch.zeros(32, dtype=torch.int32)
    layer = SimpleNamespace(weight=wq.float(), weight_scale=ws, stream_counters=SimpleNamespace(tensor=counters))
    out = _w8a8_mm(layer, xq.float(), xs, torch.float32)
    assert [t.label() for t in seen] == [label]
    ref = fp8_ops.scaled_mm_reference(xq, xs, wq, ws, torch.float32)
    torch.testing.assert_close(out, ref, atol=1e-4 * ref.abs().max().item(), rtol=1e-5)
    assert not counters.any()
