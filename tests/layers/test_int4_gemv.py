"""The INT4 panel GEMV (`triton_int4_gemv`) and the panel layout under TRITON_INTERPRET=1 against
torch references: each arithmetic mode, panel width, K step and split-K (the counters come back
zeroed), float32 and float16 activations, large activations (the fp16x2 mode scales x by a power of
two per row of 8); the panels read by the streaming and dequantize kernels; `int4_matmul` sends
one row of panel weights to the GEMV; the bad shapes it refuses.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from tests.helpers.requirements import require_module
from tokenmill.layers.quantization import int4_packing as packing
from tokenmill.layers.quantization.stream_tiles import GemvConfig, Tiles

require_module("triton")  # skipped on a machine without it; in CI, missing fails


def _case(n=128, k=256, group=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    codes = packing.quantize_int4(torch.randn(n, k, generator=g), group, sym=False)
    codes.scales = codes.scales.half().float()
    return packing.from_codes(codes, torch.float32, act_order=False)


def test_panels_round_trip():
    wt = _case()
    for panel in (32, 64, 128):
        qp = packing.to_panels(wt.qweight, panel)
        assert qp.shape == (128 // panel, 256 // 8, panel)
        assert torch.equal(qp[-1, 3], wt.qweight[3, 128 - panel:])  # the last panel, word row 3
        assert torch.equal(packing.from_panels(qp), wt.qweight)
    with pytest.raises(ValueError, match="panel width 96"):
        packing.to_panels(wt.qweight, 96)


# (mode, panel, block_k, split, stages); mode 2 is the fp16x2 arithmetic (~1e-3 relative)
CASES = [(0, 32, 64, 1, 1), (0, 64, 32, 3, 2), (1, 32, 64, 2, 3), (1, 128, 64, 1, 1), (2, 32, 64, 1, 2),
         (2, 64, 32, 4, 3), (2, 128, 64, 2, 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("mode,panel,block_k,split,stages", CASES)
def test_int4_gemv_matches_reference(mode, panel, block_k, split, stages, dtype):
    from tokenmill.layers.quantization.triton_int4_gemv import int4_gemv

    wt = _case()
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(1)).to(dtype)
    ref = x.double() @ packing.dequantize(wt, 64, torch.float64)
    counters = torch.zeros(8, dtype=torch.int32)
    out = int4_gemv(x, packing.to_panels(wt.qweight, panel), wt.scales.to(dtype), wt.zeros.to(dtype), 64,
                    block_k=block_k, split=split, stages=stages, mode=mode, counters=counters)
    assert out.dtype == dtype and out.shape == (1, 128)
    tol = {0: 1e-4, 1: 5e-4, 2: 5e-3}[mode] if dtype == torch.float32 else 2e-2
    scale = ref.abs().max().item()
    assert (out.double() - ref).abs().max().item() < tol * scale
    assert not counters.any(), "split-K counters must be reset for the next call"


def test_int4_gemv_half_mode_survives_large_activations():
    """fp16 overflows at 65504: mode 2 scales each row of 8 x values by a power of two first."""
    from tokenmill.layers.quantization.triton_int4_gemv import int4_gemv

    wt = _case()
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(2)) * 1e3
    x[0, 5] = 3e5  # one outlier channel, far past fp16's range
    ref = x.double() @ packing.dequantize(wt, 64, torch.float64)
    out = int4_gemv(x, packing.to_panels(wt.qweight, 64), wt.scales, wt.zeros, 64, mode=2)
    assert torch.isfinite(out).all()
    assert (out.double() - ref).abs().max().item() < 5e-3 * ref.abs().max().item()


def test_int4_gemv_refuses_bad_shapes():
    from tokenmill.layers.quantization.triton_int4_gemv import int4_gemv

    wt = _case()
    qp = packing.to_panels(wt.qweight, 64)
    with pytest.raises(ValueError, match="one row"):
        int4_gemv(torch.randn(2, 256), qp, wt.scales, wt.zeros, 64)
    with pytest.raises(ValueError, match="BLOCK_K 128"):
        int4_gemv(torch.randn(1, 256), qp, wt.scales, wt.zeros, 64, block_k=128)  # would straddle two groups


@pytest.mark.parametrize("m", [3, 20])
def test_panels_in_the_stream_and_dequantize_kernels(m):
    from tokenmill.layers.quantization import triton_int4
    from tokenmill.layers.quantization.triton_int4_stream import int4_stream_gemm

    wt = _case()
    qp = packing.to_panels(wt.qweight, 32)
    w_ref = packing.dequantize(wt, 64, torch.float32)
    assert torch.equal(triton_int4.dequantize_int4(qp, wt.scales, wt.zeros, None, 64, torch.float32), w_ref)
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(3))
    ref = x.double() @ w_ref.double()
    counters = torch.zeros(64, dtype=torch.int32)
    for t in (Tiles(16, 64, 64, 2), Tiles(32, 32, 64, 1, nibble_dots=False), Tiles(64, 64, 32)):
        out = int4_stream_gemm(x, qp, wt.scales, wt.zeros, 64, counters, tiles=t)
        torch.testing.assert_close(out.double(), ref, atol=1e-3, rtol=1e-3, msg=t.label)


def test_int4_matmul_sends_one_row_of_panels_to_the_gemv(monkeypatch):
    from tokenmill.layers.quantization import stream_tiles, triton_int4

    wt = _case()
    qp = packing.to_panels(wt.qweight, 64)
    monkeypatch.setattr(stream_tiles, "GEMV_TABLE", {(128, 256): GemvConfig(64, mode=0, block_k=32, split=2)})
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(4))
    ref = x.double() @ packing.dequantize(wt, 64, torch.float64)
    counters = torch.zeros(16, dtype=torch.int32)
    from tokenmill.layers.quantization import triton_int4_gemv

    seen = []
    real = triton_int4_gemv.int4_gemv
    monkeypatch.setattr(triton_int4_gemv, "int4_gemv", lambda *a: seen.append(a[5:]) or real(*a))
    out = triton_int4.int4_matmul(x, qp, wt.scales, wt.zeros, None, 64, counters)
    assert seen == [(32, 2, 4, 3, 0, counters)]
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)
    # more rows: the streaming kernel reads the same panels
    x3 = torch.randn(3, 256, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(triton_int4.int4_matmul(x3, qp, wt.scales, wt.zeros, None, 64, counters).double(),
                               x3.double() @ packing.dequantize(wt, 64, torch.float64), atol=1e-3, rtol=1e-3)


def test_gemv_config_defaults():
    from tokenmill.layers.quantization import stream_tiles as st

    c = st.gemv_config(4096, 4096, 128, 132)
    assert c.panel == 128 and c.block_k == 64 and 128 // 1 * c.split >= 132 // 4
    assert st.gemv_config(96, 256, 32, 132).panel == 32 and st.gemv_config(96, 256, 32, 132).block_k == 32
    assert st.gemv_config(24, 256, 64, 132).panel == 0  # no panel width divides 24


def test_int4_matmul_one_row_may_take_the_stream_kernel_on_panels(monkeypatch):
    """GemvConfig.mode STREAM: one row runs the streaming kernel's one-row tiles over the panels."""
    from tokenmill.layers.quantization import stream_tiles, triton_int4, triton_int4_gemv

    wt = _case()
    qp = packing.to_panels(wt.qweight, 64)
    monkeypatch.setattr(stream_tiles, "GEMV_TABLE", {(128, 256): GemvConfig(64, mode=stream_tiles.STREAM)})
    monkeypatch.setattr(triton_int4_gemv, "int4_gemv", lambda *a: pytest.fail("the GEMV ran"))
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(6))
    out = triton_int4.int4_matmul(x, qp, wt.scales, wt.zeros, None, 64, torch.zeros(16, dtype=torch.int32))
    torch.testing.assert_close(out.double(), x.double() @ packing.dequantize(wt, 64, torch.float64),
                               atol=1e-3, rtol=1e-3)
