"""Quantization kernels and packing: the Triton kernels under TRITON_INTERPRET=1 (float32, the fp8
values held in float32 where the interpreter cannot do fp8 math) against their torch references,
and each INT4 format's pack -> unpack round trip against a float64 reference written from its spec
(tests/helpers/quant_formats.py: GPTQ act-order, AWQ's interleaved order, compressed-tensors' own
library).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from tests.helpers import quant_formats as spec
from tests.helpers.requirements import require_module
from tokenmill.layers.quantization import fp8_ops
from tokenmill.layers.quantization import int4_packing as packing

require_module("triton")  # skipped on a machine without it; in CI, missing fails


def _int4_case(n=96, k=128, group=32, sym=False, act_order=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    perm = torch.randperm(k, generator=g) if act_order else None
    codes = packing.quantize_int4(w, group, sym, perm=perm)
    codes.scales = codes.scales.half().float()  # what a float16 checkpoint holds: every layout exact
    return w, codes, packing.from_codes(codes, torch.float32, act_order)


@pytest.mark.parametrize("m", [1, 5, 70])
@pytest.mark.parametrize("group,act_order", [(32, False), (-1, False), (32, True)])
def test_int4_gemm_matches_reference(m, group, act_order):
    from tokenmill.layers.quantization.triton_int4 import int4_gemm

    w, codes, wt = _int4_case(group=group, act_order=act_order)
    x = torch.randn(m, w.shape[1], generator=torch.Generator().manual_seed(1))
    ref = x.double() @ packing.dequantize(wt, group, torch.float64)
    # The spec-level dequantization agrees with the kernel layout's.
    torch.testing.assert_close(packing.dequantize(wt, group, torch.float64).t(),
                               packing.dequantize_codes(codes).double(), atol=1e-6, rtol=0)
    for split in (1, 2):
        for unpack_3d in (True, False):  # words unpacked by a reshape / loaded per nibble row
            out = int4_gemm(x, wt.qweight, wt.scales, wt.zeros, wt.g_idx, group, tiles=(16, 32, 32, split, 4),
                            unpack_3d=unpack_3d)
            torch.testing.assert_close(out.double(), ref, atol=1e-3, rtol=1e-4)
    assert (x.double() @ w.double().t() - ref).abs().max() > 1e-2  # the weight really is quantized


@pytest.mark.parametrize("group,act_order", [(32, False), (-1, False), (32, True)])
def test_int4_dequantize_kernel_matches_reference(group, act_order, monkeypatch):
    """The large-batch path: the Triton dequantization writes exactly the reference's W^T, and
    int4_matmul takes it from DEQUANT_MIN_ROWS rows."""
    from tokenmill.layers.quantization import triton_int4

    _, _, wt = _int4_case(n=136, k=96, group=group, act_order=act_order)
    got = triton_int4.dequantize_int4(wt.qweight, wt.scales, wt.zeros, wt.g_idx, group, torch.float32)
    torch.testing.assert_close(got, packing.dequantize(wt, group, torch.float32), atol=0, rtol=0)
    from tokenmill.layers.quantization import stream_tiles

    monkeypatch.setattr(triton_int4, "DEQUANT_MIN_ROWS", 4)
    monkeypatch.setattr(stream_tiles, "INT4_DEQUANT_MIN_ROWS", 4)
    monkeypatch.setattr(triton_int4, "int4_gemm", None)  # neither fused kernel may run
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(2))
    ref = x.double() @ packing.dequantize(wt, group, torch.float64)
    out = triton_int4.int4_matmul(x, wt.qweight, wt.scales, wt.zeros, wt.g_idx, group)
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("m", [1, 40])
def test_block_fp8_gemm_matches_reference(m):
    from tokenmill.layers.quantization.triton_fp8 import block_fp8_gemm

    g = torch.Generator().manual_seed(0)
    block = (32, 32)
    w = torch.randn(64, 96, generator=g)
    x = torch.randn(m, 96, generator=g) * 3
    wq, ws = fp8_ops.quantize_blocks(w, block)
    xq, xs = fp8_ops.quantize_row_groups(x, block[1])
    ref = fp8_ops.block_mm_reference(xq, xs, wq, ws, block, torch.float64)
    # The interpreter has no fp8 dot: the same fp8 values, held in float32.
    out = block_fp8_gemm(xq.float(), xs, wq.float(), ws, block, torch.float32)
    torch.testing.assert_close(out.double(), ref, atol=1e-3, rtol=1e-4)
    exact = x.double() @ w.double().t()
    assert 0 < (ref - exact).norm() / exact.norm() < 0.05  # near the float product


@pytest.mark.parametrize("group", [16, 96])
def test_quantize_row_groups_kernel(group):
    from tokenmill.layers.quantization.triton_fp8 import quantize_row_groups

    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(0)) * 10
    q, s = quantize_row_groups(x, group, out_dtype=torch.float32)  # unrounded codes (no fp8 in the interpreter)
    ref_q, ref_s = fp8_ops.quantize_row_groups(x, group)
    torch.testing.assert_close(s, ref_s)
    torch.testing.assert_close(q.to(torch.float8_e4m3fn).float(), ref_q.float())


@pytest.mark.parametrize("k", [512, 768, 2048 * 3])
def test_quantize_rows_kernel(k):
    """Per-token groups (the whole row) take the two-pass row kernel (K a multiple of 256)."""
    from tokenmill.layers.quantization import triton_fp8

    assert triton_fp8._row_chunk(k) >= 256
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(k)) * 10
    x[1, k - 3], x[2, 2] = 900.0, -900.0  # a row maximum in the last slice, one in the first
    q, s = triton_fp8.quantize_row_groups(x, k, out_dtype=torch.float32)
    ref_q, ref_s = fp8_ops.quantize_row_groups(x, k)
    torch.testing.assert_close(s, ref_s)
    torch.testing.assert_close(q.to(torch.float8_e4m3fn).float(), ref_q.float())


def _e4m3_reference(x: torch.Tensor) -> torch.Tensor:
    """e4m3fn from its definition, in float64: 3 mantissa bits, exponent >= -6 (subnormals below),
    round to nearest with ties to even, saturated at 448 (what the CPU emulation must match)."""
    x = x.double()
    exp = torch.floor(torch.log2(x.abs().clamp(min=1e-300))).clamp(min=-6)
    ulp = torch.pow(2.0, exp - 3)
    return (torch.sign(x) * (torch.round(x.abs() / ulp) * ulp)).clamp(-448, 448)


def test_fp8_rounding_and_scales_match_the_spec():
    g = torch.Generator().manual_seed(0)
    grid = _e4m3_reference(torch.linspace(-460, 460, 20001, dtype=torch.float64)).unique()
    ties = (grid[1:] + grid[:-1]) / 2  # exactly halfway: ties go to the even code
    x = torch.cat([grid, ties, torch.randn(5000, generator=g, dtype=torch.float64) * torch.exp(
        torch.randn(5000, generator=g, dtype=torch.float64) * 3), torch.tensor([2.0 ** -10, 600.0, -1e4])])
    x = x.float().double()  # values float32 holds exactly
    torch.testing.assert_close(fp8_ops.to_fp8(x.float()).double(), _e4m3_reference(x), atol=0, rtol=0)
    # Per-row scales: amax / 448 (the largest value lands on 448 exactly); a zero row stays finite.
    w = torch.randn(6, 300, generator=g) * 3
    w[2] = 0
    q, s = fp8_ops.quantize_rows(w)
    assert torch.equal(s[[0, 1, 3, 4, 5]].squeeze(1), w[[0, 1, 3, 4, 5]].abs().amax(dim=1) / 448)
    assert torch.equal(q[[0, 1, 3, 4, 5]].float().abs().amax(dim=1), torch.full((5,), 448.0))
    assert torch.isfinite(s).all() and not q[2].float().any()
    torch.testing.assert_close(fp8_ops.fake_quantize_rows(w).double(), _e4m3_reference(w.double() / s.double()) * s,
                               atol=1e-6, rtol=1e-6)


def test_fp8_online_weight_scales_minimise_the_rounding_error():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(8, 512, generator=g) * 0.05
    w[3, 7] = 2.0  # one outlier: clipping it a little buys resolution for the rest of the row
    q, s = fp8_ops.quantize_weight_rows(w, rows_per_chunk=3)  # chunks of rows give the same result
    assert q.dtype == torch.float8_e4m3fn and s.shape == (8, 1)
    assert torch.equal(q, fp8_ops.to_fp8(w / s))  # codes are the rounding of w at the chosen scale
    amax_q, amax_s = fp8_ops.quantize_rows(w)
    err = (q.float() * s - w).square().sum(dim=1)
    amax_err = (amax_q.float() * amax_s - w).square().sum(dim=1)
    assert (err <= amax_err * (1 + 1e-5)).all()  # amax / 448 is among the candidates: never worse
    assert err.sum() < amax_err.sum()  # and better somewhere
    shrink = (s * 448 / w.abs().amax(dim=1, keepdim=True)).squeeze(1)
    assert (shrink >= 0.8 - 1e-6).all() and (shrink <= 1 + 1e-6).all()
    # Each row's scale is the best of the grid (brute force over the same candidates).
    for r in range(8):
        errs = [((fp8_ops.to_fp8(w[r] / (w[r].abs().max() * f / 448)).float() * (w[r].abs().max() * f / 448) - w[r])
                 .square().sum()) for f in fp8_ops.WEIGHT_SHRINKS]
        assert err[r] <= min(errs) * (1 + 1e-5)


def test_fp8_weight_round_trips():
    w = torch.randn(40, 64) * 0.05
    q, s = fp8_ops.quantize_rows(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (40, 1)
    torch.testing.assert_close(spec.ref_fp8({"weight": q, "weight_scale": s}).float(), q.float() * s)
    rel = ((q.float() * s - w).abs().amax(dim=1) / w.abs().amax(dim=1)).max()
    assert 0 < rel < 1 / 16  # e4m3 keeps 3 mantissa bits
    qb, sb = fp8_ops.quantize_blocks(w, (16, 32))
    assert sb.shape == (3, 2)  # a partial last block of rows
    torch.testing.assert_close(spec.ref_fp8({"weight": qb, "weight_scale_inv": sb}, (16, 32)).float(),
                               fp8_ops.dequantize_blocks(qb, sb, (16, 32)))


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_packing_round_trip(sym, act_order):
    w, codes, _ = _int4_case(group=32, sym=sym, act_order=act_order)
    tensors = packing.to_gptq(codes, zero_offset=1)
    ref = spec.ref_gptq(tensors)
    torch.testing.assert_close(ref, packing.dequantize_codes(codes).double(), atol=1e-6, rtol=0)
    wt = packing.from_gptq(tensors["qweight"], tensors["qzeros"], tensors["scales"].float(), 1, torch.float32,
                           tensors["g_idx"] if act_order else None)
    torch.testing.assert_close(packing.dequantize(wt, 32, torch.float64).t(), ref, atol=1e-3, rtol=0)
    assert (ref - w.double()).abs().max() < 0.35  # within half a step of the largest group's scale


def test_awq_packing_round_trip():
    w, codes, _ = _int4_case(group=32, sym=False)
    tensors = packing.to_awq(codes)
    ref = spec.ref_awq(tensors, 32)
    torch.testing.assert_close(ref, packing.dequantize_codes(codes).double(), atol=1e-3, rtol=0)
    wt = packing.from_awq(tensors["qweight"], tensors["qzeros"], tensors["scales"].float(), torch.float32)
    torch.testing.assert_close(packing.dequantize(wt, 32, torch.float64).t(), ref, atol=1e-3, rtol=0)


@pytest.mark.parametrize("sym", [True, False])
def test_compressed_tensors_packing_round_trip(sym):
    require_module("compressed_tensors")
    w, codes, _ = _int4_case(group=32, sym=sym)
    ours = packing.to_compressed_tensors(codes, torch.float32, sym=sym)
    theirs = spec._ct_int4(w, 32, sym, torch.float32)  # packed by the library
    assert torch.equal(ours["weight_packed"], theirs["weight_packed"])
    if not sym:
        assert torch.equal(ours["weight_zero_point"], theirs["weight_zero_point"])
    ref = spec.ref_ct_int4(theirs, 32, sym)
    wt = packing.from_compressed_tensors(theirs["weight_packed"], theirs["weight_scale"], torch.float32,
                                         theirs.get("weight_zero_point"))
    torch.testing.assert_close(packing.dequantize(wt, 32, torch.float64).t(), ref, atol=1e-6, rtol=0)
