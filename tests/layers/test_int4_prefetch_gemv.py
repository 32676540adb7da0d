"""The register-prefetched INT4 GEMV (`triton_int4_prefetch_gemv`) under TRITON_INTERPRET=1 against
a float64 torch reference: each arithmetic mode, prefetch depth (and the cp.async variant), panel
width, K step and split-K (one-shot sum of the partials; counters come back zeroed), float32
and float16 activations, large activations; `int4_matmul` sends one row to it when the table
names the shape; the launches it refuses.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from tests.helpers.requirements import require_module
from tokenmill.layers.quantization import int4_packing as packing

require_module("triton")  # skipped on a machine without it; in CI, missing fails


def _case(n=128, k=512, group=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    codes = packing.quantize_int4(torch.randn(n, k, generator=g), group, sym=False)
    codes.scales = codes.scales.half().float()
    return packing.from_codes(codes, torch.float32, act_order=False)


# (mode, panel, block_k, split, prefetch); mode 4 is the fp16x2 arithmetic (~1e-3 relative)
CASES = [(0, 32, 64, 1, 1), (3, 64, 32, 4, 2), (3, 32, 64, 2, 0), (4, 128, 64, 2, 1), (4, 32, 32, 1, 2),
         (3, 128, 64, 8, 1), (0, 64, 64, 2, 2), (5, 64, 64, 4, 1), (6, 64, 32, 4, 1), (6, 32, 64, 2, 0),
         (6, 128, 64, 1, 2)]


# Each case in one dtype, every mode in both (the dtype changes the loads and the tolerance): 12 of the
# 22 pairs; every panel width, block_k, prefetch depth and split but 8 (one case) in both dtypes still.
F32, F16 = torch.float32, torch.float16
CASE_DTYPES = [F32, F32, F32, F32, F16, F16, F16, F32, F32, F16, F16]


@pytest.mark.parametrize("mode,panel,block_k,split,prefetch,dtype",
                         [(*case, dtype) for case, dtype in zip(CASES, CASE_DTYPES)] + [(*CASES[7], F16)])
def test_prefetch_gemv_matches_reference(mode, panel, block_k, split, prefetch, dtype):
    from tokenmill.layers.quantization.triton_int4_prefetch_gemv import PrefetchGemv, prefetch_gemv

    wt = _case()
    x = torch.randn(1, 512, generator=torch.Generator().manual_seed(1)).to(dtype)
    ref = x.double() @ packing.dequantize(wt, 64, torch.float64)
    counters = torch.zeros(8, dtype=torch.int32)
    c = PrefetchGemv(panel, mode, block_k, split, 4, prefetch, stages=2)
    for _ in range(2):  # a second call reuses the counters
        out = prefetch_gemv(x, packing.to_panels(wt.qweight, panel), wt.scales.to(dtype), wt.zeros.to(dtype), 64, c,
                            counters)
        assert out.dtype == dtype and out.shape == (1, 128)
        tol = {0: 1e-5, 3: 1e-4, 4: 5e-3, 5: 5e-3, 6: 1e-4}[mode] if dtype == torch.float32 else 2e-2
        assert (out.double() - ref).abs().max().item() < tol * ref.abs().max().item()
        assert not counters.any(), "split-K counters must be reset for the next call"


@pytest.mark.parametrize("prefetch,split,stagger", [(1, 2, 1), (2, 1, 3), (0, 2, 1), (1, 4, 5), (-2, 2, 1), (-4, 1, 0)])
def test_prefetch_gemv_staggered_slices_match_reference(prefetch, split, stagger):
    """STAGGER rotates each panel's K slice (panel i starts i * STAGGER tiles in, wrapping): every
    tile is still read once, with its own group's scales and zeros; the unrolled K loop (negative
    PREFETCH) likewise; PDL and L1 prefetches asked for on a CPU are ignored (plain launch)."""
    from tokenmill.layers.quantization.triton_int4_prefetch_gemv import PrefetchGemv, prefetch_gemv

    wt = _case(n=128, k=512, group=32)
    x = torch.randn(1, 512, generator=torch.Generator().manual_seed(3))
    ref = x.double() @ packing.dequantize(wt, 32, torch.float64)
    counters = torch.zeros(8, dtype=torch.int32)
    c = PrefetchGemv(32, 3, 32, split, 4, prefetch, stages=2, stagger=stagger, pdl=True, l1_ahead=3)
    out = prefetch_gemv(x, packing.to_panels(wt.qweight, 32), wt.scales, wt.zeros, 32, c, counters)
    assert (out.double() - ref).abs().max().item() < 1e-4 * ref.abs().max().item()
    assert not counters.any()


def test_prefetch_gemv_half_mode_survives_large_activations():
    """fp16 overflows at 65504: mode 4 scales each row of 8 x values by a power of two first."""
    from tokenmill.layers.quantization.triton_int4_prefetch_gemv import PrefetchGemv, prefetch_gemv

    wt = _case()
    x = torch.randn(1, 512, generator=torch.Generator().manual_seed(2)) * 1e3
    x[0, 5] = 3e5  # one outlier channel, far past fp16's range
    ref = x.double() @ packing.dequantize(wt, 64, torch.float64)
    for mode in (3, 4, 5):
        out = prefetch_gemv(x, packing.to_panels(wt.qweight, 64), wt.scales, wt.zeros, 64, PrefetchGemv(64, mode, 64))
        assert torch.isfinite(out).all()
        assert (out.double() - ref).abs().max().item() < 5e-3 * ref.abs().max().item(), mode


def test_prefetch_gemv_refuses_bad_launches():
    from tokenmill.layers.quantization.triton_int4_prefetch_gemv import PrefetchGemv, prefetch_gemv

    wt = _case()
    qp = packing.to_panels(wt.qweight, 64)
    x = torch.randn(1, 512)
    with pytest.raises(ValueError, match="one row"):
        prefetch_gemv(torch.randn(2, 512), qp, wt.scales, wt.zeros, 64, PrefetchGemv(64))
    with pytest.raises(ValueError, match="do not fit"):  # a K tile would straddle two groups
        prefetch_gemv(x, qp, wt.scales, wt.zeros, 64, PrefetchGemv(64, block_k=128))
    with pytest.raises(ValueError, match="do not fit"):  # 3 does not divide the 8 K tiles
        prefetch_gemv(x, qp, wt.scales, wt.zeros, 64, PrefetchGemv(64, block_k=64, split=3))
    with pytest.raises(ValueError, match="counters"):
        prefetch_gemv(x, qp, wt.scales, wt.zeros, 64, PrefetchGemv(64, block_k=64, split=2))
    with pytest.raises(ValueError, match="do not fit"):  # an unroll of 3 does not divide the 8 steps
        prefetch_gemv(x, qp, wt.scales, wt.zeros, 64, PrefetchGemv(64, block_k=64, prefetch=-3))


def test_int4_matmul_takes_the_prefetch_gemv_for_a_listed_shape(monkeypatch):
    from tokenmill.layers.quantization import triton_int4, triton_int4_gemv
    from tokenmill.layers.quantization import triton_int4_prefetch_gemv as pg

    wt = _case()
    c = pg.PrefetchGemv(32, mode=3, block_k=64, split=2, prefetch=2)
    monkeypatch.setattr(pg, "TABLE", {(128, 512): c})
    monkeypatch.setattr(triton_int4_gemv, "int4_gemv", lambda *a: pytest.fail("the older GEMV ran"))
    seen = []
    real = pg.prefetch_gemv
    monkeypatch.setattr(pg, "prefetch_gemv", lambda *a: seen.append(a[5]) or real(*a))
    qp = packing.to_panels(wt.qweight, 32)
    x = torch.randn(1, 512, generator=torch.Generator().manual_seed(4))
    out = triton_int4.int4_matmul(x, qp, wt.scales, wt.zeros, None, 64, torch.zeros(16, dtype=torch.int32))
    assert seen == [c]
    ref = x.double() @ packing.dequantize(wt, 64, torch.float64)
    assert (out.double() - ref).abs().max().item() < 1e-4 * ref.abs().max().item()


def test_panel_width_at_load_follows_the_table(monkeypatch):
    from tokenmill.layers.quantization import int4
    from tokenmill.layers.quantization import triton_int4_prefetch_gemv as pg

    monkeypatch.setattr(pg, "TABLE", {(128, 512): pg.PrefetchGemv(32, block_k=64)})
    assert int4.gemv_panel(128, 512, 64) == 32
    assert int4.gemv_panel(128, 512, 32) != 32  # K tiles of 64 would straddle groups of 32: the older GEMV's
