"""The INT4 GEMM on the tensor-core GEMV's layout (`triton_int4_mma_gemm`) under TRITON_INTERPRET=1
against a float64 torch reference (`int4_packing.dequantize` then a matmul): both ways of
unpacking the words (FLAT gather, reshape), row counts that fill and that do not fill a row tile,
split-K (counters come back zeroed), several weight tiles per row sweep (GROUP_N), groups of 64
and 128, float32 and float16 activations; the K order it reads x in; the dispatch in
`mma_matmul` (its table, and dequantize + cuBLAS where the table says none). On a GPU
scripts/gpu_int4_gemm.py checks every timed launch against the same reference.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from tests.helpers.requirements import require_module
from tokenmill.layers.quantization import int4_packing as packing

require_module("triton")  # skipped on a machine without it; in CI, missing fails


def _case(n=64, k=256, group=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    codes = packing.quantize_int4(torch.randn(n, k, generator=g), group, sym=False)
    codes.scales = codes.scales.half().float()  # exact in fp16 too
    return packing.from_codes(codes, torch.float32, act_order=False)


def test_perm_inputs_is_the_layouts_fragment_order():
    """A's column p holds the code of input _perm_inputs(p) of word m = p // 16, lane j = (p // 2) % 4,
    nibble 2 ((p // 8) % 2) + 4 (p % 2) (+1 for channel g + 8): the map `to_mma` documents."""
    from tokenmill.layers.quantization.triton_int4_mma_gemm import _perm_inputs

    p = torch.arange(64)
    inputs = _perm_inputs.fn(p)  # the jitted function's Python body on torch tensors
    assert sorted(inputs.tolist()) == list(range(64))  # a permutation of the step's inputs
    for pi, k in zip(p.tolist(), inputs.tolist()):
        m, j, a, b = pi // 16, (pi // 2) % 4, (pi // 8) % 2, pi % 2
        nib = 2 * a + 4 * b
        assert k == 16 * j + 4 * m + 2 * ((nib % 4) // 2) + nib // 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,group,tiles", [
    (16, 64, dict(block_n=32, block_m=16)),
    (21, 128, dict(block_n=16, block_m=16, flat=False)),
    (40, 64, dict(block_n=32, block_m=16, split=3)),
    (33, 128, dict(block_n=16, block_m=32, group_n=2, flat=False, split=2)),
    (24, 64, dict(block_n=32, block_m=16, xperm=True)),
    (30, 128, dict(block_n=32, block_m=16, flat=False, xperm=True, psz=True, split=2)),
])
def test_mma_gemm_matches_reference(m, group, tiles, dtype):
    from tokenmill.layers.quantization.triton_int4_mma_gemm import GemmTiles, mma_gemm

    wt = _case(group=group)
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m)).to(dtype)
    ref = x.double() @ packing.dequantize(wt, group, torch.float64)
    qm = packing.to_mma(wt.qweight)
    counters = torch.zeros(32, dtype=torch.int32)
    t = GemmTiles(warps=4, stages=1, **tiles)
    for _ in range(2):  # a second call reuses the counters
        out = mma_gemm(x, qm, wt.scales.to(dtype), wt.zeros.to(dtype), group, t, counters)
        assert out.dtype == dtype and out.shape == (m, 64)
        tol = 1e-5 if dtype == torch.float32 else 2e-3
        assert (out.double() - ref).abs().max().item() < tol * ref.abs().max().item()
        assert not counters.any(), "split-K counters must be reset for the next call"


def test_mma_gemm_refuses_what_does_not_fit():
    from tokenmill.layers.quantization.triton_int4_mma_gemm import GemmTiles, gemm_tiles, mma_gemm

    wt = _case(n=48)
    qm = packing.to_mma(wt.qweight)
    with pytest.raises(ValueError, match="BLOCK_N 32"):
        mma_gemm(torch.randn(16, 256), qm, wt.scales, wt.zeros, 64, GemmTiles(32, 16, 4, 1))
    assert gemm_tiles(2048, 4096, 4096, 128) is None  # above the last bucket: dequantize + cuBLAS


def test_mma_matmul_takes_the_gemm_where_its_table_says(monkeypatch):
    from tokenmill.layers.quantization import triton_int4_mma as mma
    from tokenmill.layers.quantization import triton_int4_mma_gemm as gemm

    wt = _case(n=32, k=128)
    qm = packing.to_mma(wt.qweight)
    ref_w = packing.dequantize(wt, 64, torch.float32)
    calls = []
    real = gemm.mma_gemm
    monkeypatch.setattr(gemm, "mma_gemm", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    monkeypatch.setattr(gemm, "TABLE", {(64, 32, 128): gemm.GemmTiles(16, 16, 4, 1, split=2), (128, 32, 128): None})
    monkeypatch.setattr(gemm, "ROWS_TABLE", {128: gemm.GemmTiles(32, 32, 4, 1)})
    counters = torch.zeros(16, dtype=torch.int32)
    for m in (40, 100):  # 40: the table's GEMM; 100: the table's None (dequantize + matmul), not ROWS_TABLE
        x = torch.randn(m, 128, generator=torch.Generator().manual_seed(m))
        out = mma.mma_matmul(x, qm, wt.scales, wt.zeros, 64, counters)
        torch.testing.assert_close(out, x @ ref_w, rtol=1e-4, atol=1e-4)
    assert calls == [40]
    monkeypatch.setattr(gemm, "TABLE", {})
    mma.mma_matmul(torch.randn(100, 128), qm, wt.scales, wt.zeros, 64, counters)  # ROWS_TABLE's tiles
    assert calls == [40, 100]


def test_gemm_selftest_passes_and_switches_the_gemm_off(monkeypatch, caplog):
    """`int4.gemm_selftest` (once per device, when the engine takes the mma layout) runs every launch
    the tables list against the reference; a wrong or failing GEMM is switched off, with a warning,
    and `gemm_tiles` then sends every row count to the other paths."""
    from tokenmill.layers.quantization import int4
    from tokenmill.layers.quantization import triton_int4_mma_gemm as gemm

    monkeypatch.setattr(gemm, "TABLE", {(16, 256, 512): gemm.GemmTiles(64, 16, 4, 1, split=2)})
    monkeypatch.setattr(gemm, "ROWS_TABLE", {16: gemm.GemmTiles(64, 16, 4, 1)})
    monkeypatch.setattr(gemm, "ENABLED", True)
    from tokenmill.layers.quantization import int4_ws_route as ws
    monkeypatch.setattr(ws, "ENABLED", True)  # (a failure below switches it off too: restored after)
    monkeypatch.setattr(int4, "_GEMM_SELFTEST", {})
    assert int4.gemm_selftest(torch.device("cpu"), torch.float16) and gemm.ENABLED
    assert gemm.gemm_tiles(16, 256, 512, 128) == gemm.GemmTiles(64, 16, 4, 1, split=2)
    real = gemm.mma_gemm
    for broken in (lambda *a, **kw: real(*a, **kw) * 1.05,
                   lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("CompilationError"))):
        monkeypatch.setattr(int4, "_GEMM_SELFTEST", {})
        monkeypatch.setattr(gemm, "ENABLED", True)
        monkeypatch.setattr(gemm, "mma_gemm", broken)
        with caplog.at_level("WARNING"):
            assert not int4.gemm_selftest(torch.device("cpu"), torch.float16)
        assert "self-test" in caplog.text and not gemm.ENABLED
        assert gemm.gemm_tiles(16, 256, 512, 128) is None
