"""The tensor-core INT4 GEMV (`triton_int4_mma`) under TRITON_INTERPRET=1 against a float64 torch
reference: its weight layout (`int4_packing.to_mma` / `from_mma`, checked nibble by nibble against
the documented map), 1..8 rows, split-K (counters come back zeroed), groups of 64 and 128,
float32 and float16 activations; the dequantization of the layout; `mma_matmul` for more rows;
the launches it refuses. The inline PTX itself runs on a GPU only (scripts/gpu_int4_sweep.py
checks it against the same reference).
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
    codes.scales = codes.scales.half().float()
    return packing.from_codes(codes, torch.float32, act_order=False)


def test_mma_layout_round_trip_and_map():
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (128, 32), generator=g)
    words = packing.pack_along(codes, 0)
    qm = packing.to_mma(words)
    assert qm.shape == (2, 2, 32, 4) and qm.dtype == torch.int32
    assert torch.equal(packing.from_mma(qm), words)
    for cb in range(2):  # the map the kernel's fragments assume (module docstring)
        for s in range(2):
            for lane in range(32):
                for m in range(4):
                    word = qm[cb, s, lane, m].item()
                    for nib in range(8):
                        ch = cb * 16 + lane // 4 + 8 * (nib % 2)
                        k = 64 * s + 16 * (lane % 4) + 4 * m + 2 * ((nib % 4) // 2) + nib // 4
                        assert (word >> (4 * nib)) & 0xF == codes[k, ch].item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,group,warps,split", [(1, 64, 1, 1), (1, 64, 2, 4), (3, 128, 4, 2), (8, 64, 1, 2),
                                                 (5, 128, 2, 1)])
def test_mma_gemv_matches_reference(m, group, warps, split, dtype):
    from tokenmill.layers.quantization.triton_int4_mma import MmaGemv, mma_gemv

    wt = _case(group=group)
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(1)).to(dtype)
    ref = x.double() @ packing.dequantize(wt, group, torch.float64)
    qm = packing.to_mma(wt.qweight)
    counters = torch.zeros(8, dtype=torch.int32)
    for _ in range(2):  # a second call reuses the counters
        out = mma_gemv(x, qm, wt.scales.to(dtype), wt.zeros.to(dtype), group, MmaGemv(warps, split), counters)
        assert out.dtype == dtype and out.shape == (m, 64)
        tol = 1e-5 if dtype == torch.float32 else 2e-3
        assert (out.double() - ref).abs().max().item() < tol * ref.abs().max().item()
        assert not counters.any(), "split-K counters must be reset for the next call"


def test_mma_dequantize_and_matmul_match_reference():
    from tokenmill.layers.quantization import triton_int4_mma as mma

    wt = _case(n=32, k=128, group=64)
    qm = packing.to_mma(wt.qweight)
    ref_w = packing.dequantize(wt, 64, torch.float32)
    assert torch.equal(mma.mma_dequantize(qm, wt.scales, wt.zeros, 64, torch.float32), ref_w)
    counters = torch.zeros(4, dtype=torch.int32)
    for m in (12, 40):  # looped 8-row GEMVs; dequantize + matmul
        x = torch.randn(m, 128, generator=torch.Generator().manual_seed(m))
        out = mma.mma_matmul(x, qm, wt.scales, wt.zeros, 64, counters)
        assert out.shape == (m, 32) and torch.allclose(out, x @ ref_w, rtol=1e-4, atol=1e-4)


def test_mma_gemv_refuses_what_does_not_fit():
    from tokenmill.layers.quantization.triton_int4_mma import MmaGemv, mma_gemv

    wt = _case()
    qm = packing.to_mma(wt.qweight)
    with pytest.raises(ValueError, match="at most 8 rows"):
        mma_gemv(torch.randn(9, 256), qm, wt.scales, wt.zeros, 64, MmaGemv(1, 1))
    with pytest.raises(ValueError, match="SPLIT"):
        mma_gemv(torch.randn(1, 256), qm, wt.scales, wt.zeros, 64, MmaGemv(1, 3))
    with pytest.raises(ValueError, match="counters"):
        mma_gemv(torch.randn(1, 256), qm, wt.scales, wt.zeros, 64, MmaGemv(1, 2))
    with pytest.raises(ValueError, match="multiple of 64"):
        packing.to_mma(packing.pack_along(torch.zeros(96, 16, dtype=torch.int64), 0))


def test_int4_matmul_sends_the_mma_layout_to_mma_matmul(monkeypatch):
    """A 4-D weight (the mma layout `int4.for_device` makes on CUDA) goes to `mma_matmul` at
    every row count; the result matches the reference."""
    from tokenmill.layers.quantization import triton_int4
    from tokenmill.layers.quantization import triton_int4_mma as mma

    wt = _case(n=32, k=128)
    qm = packing.to_mma(wt.qweight)
    calls = []
    real = mma.mma_matmul
    monkeypatch.setattr(mma, "mma_matmul", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    for m in (1, 5):
        x = torch.randn(m, 128, generator=torch.Generator().manual_seed(m))
        out = triton_int4.int4_matmul(x, qm, wt.scales, wt.zeros, None, 64, torch.zeros(8, dtype=torch.int32))
        torch.testing.assert_close(out, x @ packing.dequantize(wt, 64, torch.float32), rtol=1e-4, atol=1e-4)
    assert calls == [1, 5]
