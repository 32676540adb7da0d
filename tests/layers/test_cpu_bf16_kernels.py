"""The packed AVX512-BF16 GEMM's bf16 epilogues and the CPU RMSNorm kernel, against torch references.

- `cpu_bf16_gemm` OUT_BF16 (qkv and other bf16 linears on the avx512_bf16 path): the float32
  product rounded to nearest even, as oneDNN's bf16 linear; OUT_SILU_MUL (gate_up): gate and up
  rows interleaved at packing, `bf16(up * bf16(silu(gate)))` as oneDNN's swish and mul post-ops.
  Bound: every output within one bf16 step of the float64 reference's rounding and all but a
  few (float32 summation order at a rounding boundary) equal to it; a truncating rounding
  (planted: `to_bf16` chopping the low half) fails every case, and so does swapping gate and up.
- The decode split (one row block: each thread a contiguous run of 16-column vectors) gives
  the one-thread result bit for bit (each output's sum does not depend on the split).
- `cpu_norm`: `rms_norm_reference`'s roundings, with the residual add of a float32 or bf16
  sublayer output: equal but for a few outputs a step off (the mean's float32 summation order);
  a planted bf16 reciprocal (`rstd` rounded to bf16) fails it.
"""

from __future__ import annotations

import pytest
import torch

from tokenmill.layers import cpu_amx_gemm, cpu_bf16_gemm, cpu_isa, cpu_norm
from tokenmill.layers.linear import PackedWeight, linear, silu_mul_linear
from tokenmill.layers.norm import RMSNorm, rms_norm_reference

_GEMM = cpu_bf16_gemm.available()
needs_gemm = pytest.mark.skipif(not _GEMM, reason="no vdpbf16ps on this CPU (or no C compiler)")


def _bf16_close(got: torch.Tensor, ref64: torch.Tensor, max_off: int = 0) -> None:
    """got (bf16) is the bf16 rounding of ref64 up to one step, and off at most `max_off` places."""
    assert got.dtype == torch.bfloat16 and got.shape == ref64.shape
    want = ref64.to(torch.bfloat16)
    off = got != want
    step = want.float().abs() * 2 ** -7 + 1e-30
    assert bool(((got.float() - ref64).abs()[off] <= step[off]).all())
    assert int(off.sum()) <= max_off, f"{int(off.sum())} of {got.numel()} outputs off their rounding"


@needs_gemm
@pytest.mark.parametrize("m, k, n", [(1, 64, 16), (1, 576, 960), (3, 33, 70), (13, 96, 100), (64, 96, 520),
                                     (97, 40, 300)])
@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_epilogue(m: int, k: int, n: int, threads: int) -> None:
    gen = torch.Generator().manual_seed(m * k + n)
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = (torch.randn(n, k, generator=gen) * 0.1).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = cpu_bf16_gemm.gemm(x, w, cpu_bf16_gemm.PackedBf16(), bias=bias, mode=cpu_bf16_gemm.OUT_BF16)
    finally:
        torch.set_num_threads(before)
    _bf16_close(got, x.double() @ w.double().t() + bias.double(), max_off=max(2, got.numel() // 2000))


@needs_gemm
@pytest.mark.parametrize("m, k, inter", [(1, 64, 16), (1, 576, 1536), (5, 33, 40), (64, 96, 200), (50, 40, 24)])
@pytest.mark.parametrize("bias", [False, True])
def test_silu_mul_epilogue(m: int, k: int, inter: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(m + k + inter)
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = (torch.randn(2 * inter, k, generator=gen) * 0.2).bfloat16()
    b = torch.randn(2 * inter, generator=gen).bfloat16() if bias else None
    acc = x.double() @ w.double().t() + (0 if b is None else b.double())
    gate, up = acc.chunk(2, dim=-1)
    ref = up * torch.nn.functional.silu(gate).to(torch.bfloat16).double()
    got = cpu_bf16_gemm.gemm(x, w, cpu_bf16_gemm.PackedBf16(), bias=b, mode=cpu_bf16_gemm.OUT_SILU_MUL)
    assert got.shape == (m, inter)
    # Two roundings: the inner one may land on the other side of a boundary too (a step of it).
    want = ref.to(torch.bfloat16)
    off = got != want
    assert bool(((got.double() - ref).abs()[off] <= ref.abs()[off] * 2 ** -6 + 1e-30).all())
    assert int(off.sum()) <= max(2, got.numel() // 500)


@needs_gemm
def test_decode_split_is_the_one_thread_result() -> None:
    """One row, 2 threads: the vectors split in two runs (an odd count: 61 vectors, and pairs of
    the gate/up layout) equal the one-thread result bit for bit."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 160, generator=gen).bfloat16()
    w = torch.randn(61 * 16 - 5, 160, generator=gen).bfloat16()
    wg = torch.randn(2 * 37 * 16, 160, generator=gen).bfloat16()
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append((cpu_bf16_gemm.gemm(x, w, cpu_bf16_gemm.PackedBf16()),
                            cpu_bf16_gemm.gemm(x, wg, cpu_bf16_gemm.PackedBf16(), mode=cpu_bf16_gemm.OUT_SILU_MUL)))
    finally:
        torch.set_num_threads(before)
    for a, b in zip(*results):
        assert torch.equal(a, b)


@needs_gemm
def test_linears_take_the_gemm_on_the_avx512_bf16_path() -> None:
    """`linear` and `silu_mul_linear` in bf16 go through the packed GEMM where it replaces oneDNN
    (the avx512_bf16 path), with its results; elsewhere through oneDNN (no GEMM packing made) or,
    at decode sizes on the amx path, the AMX tile GEMM (`cpu_amx_gemm`, on the same packing)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 96, generator=gen).bfloat16()
    w = (torch.randn(64, 96, generator=gen) * 0.1).bfloat16()
    caches = (PackedWeight(), PackedWeight())
    with torch.inference_mode():
        out = linear(x, w, None, caches[0])
        act = silu_mul_linear(x, w, None, caches)
    used = cpu_bf16_gemm.replaces_onednn()
    assert used == (cpu_isa.kernel_path().name == "avx512_bf16")
    assert (caches[0].gemm is not None) == (used or cpu_amx_gemm.takes_bf16(x.shape[0], x.shape[1]))
    if used:
        assert torch.equal(out, cpu_bf16_gemm.gemm(x, w, cpu_bf16_gemm.PackedBf16(), mode=cpu_bf16_gemm.OUT_BF16))
        assert torch.equal(act, cpu_bf16_gemm.gemm(x, w, cpu_bf16_gemm.PackedBf16(),
                                                   mode=cpu_bf16_gemm.OUT_SILU_MUL))
    _bf16_close(out, x.double() @ w.double().t(), max_off=2)


@pytest.mark.skipif(not cpu_norm.available(), reason="no C compiler")
@pytest.mark.parametrize("rows, hidden", [(1, 576), (7, 100), (130, 64), (3, 13)])
@pytest.mark.parametrize("add", [None, torch.float32, torch.bfloat16])
def test_cpu_norm_equals_the_reference(rows: int, hidden: int, add: torch.dtype | None) -> None:
    gen = torch.Generator().manual_seed(rows + hidden)
    norm = RMSNorm(hidden, 1e-5).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=gen) * 0.5 + 1)
    stream = torch.randn(rows, hidden, generator=gen) * 30
    stream[:, hidden // 2] = 2.2e4  # a massive channel: the stream's precision matters
    with torch.inference_mode():
        assert cpu_norm.supports(stream, norm.weight, torch.bfloat16)
        if add is None:
            got, new = norm(stream, out_dtype=torch.bfloat16), stream
        else:
            x = torch.randn(rows, hidden, generator=gen).to(add) * 3
            got, new = norm.forward_with_residual(x, stream, torch.bfloat16)
            assert new.dtype == torch.float32 and torch.equal(new, stream + x)
    ref = rms_norm_reference(new, norm.weight, 1e-5, torch.bfloat16)
    off = got != ref  # (the mean's summation order can move a product across a rounding boundary)
    assert int(off.sum()) <= 2 + got.numel() // 1000
    assert bool(((got.float() - ref.float()).abs()[off] <= ref.float().abs()[off] * 2 ** -6).all())
