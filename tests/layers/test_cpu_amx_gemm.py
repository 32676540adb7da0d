"""`cpu_amx_gemm`, the AMX-BF16 tile GEMM, against a float64 reference of its math.

Every test runs the C-emulated build (tiles as arrays, `tdpbf16ps` in C: any CPU) and, on a CPU with
AMX-BF16, the real build too: odd shapes (row tails below 16, N tails, K not a multiple of 32),
one and two threads, each epilogue (float32 out with bias and the residual add, bf16 out, the
[gate | up] silu-mul). The routing tests check which kernel each linear takes on the amx path.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.requirements import skip_or_fail
from tokenmill.layers import cpu_amx_gemm, cpu_bf16_gemm, cpu_isa, wide_linear
from tokenmill.layers.linear import PackedWeight, linear, silu_mul_linear

_LIBS = [pytest.param("emulated", id="emulated"),
         pytest.param("native", id="native", marks=pytest.mark.skipif(
             cpu_amx_gemm.native_library() is None, reason="no AMX-BF16 on this CPU (or tiles refused)"))]
# (rows, K, N): row tails (1, 5, 17, 33), N tails (40, 33, 100), K tails (70, 130, 1100: not /32)
_SHAPES = [(1, 64, 48), (5, 70, 40), (17, 96, 33), (33, 130, 100), (130, 1100, 70)]


def _lib(name: str):
    lib = cpu_amx_gemm.emulated_library() if name == "emulated" else cpu_amx_gemm.native_library()
    if lib is None:  # (the emulated build runs anywhere a C compiler does: in CI its absence fails)
        skip_or_fail("no C compiler (or TOKENMILL_NO_C_KERNELS set)")
    return lib


def _data(m: int, k: int, n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g) * 0.1).to(torch.bfloat16)
    return x, w


def _sum_error(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A bound on float32 summation error of x @ w.T (any order)."""
    return (x.double().abs() @ w.double().abs().T) * 2.0 ** -22 + 1e-6


def _bf16_close(got: torch.Tensor, want64: torch.Tensor, err: torch.Tensor, steps: int = 1) -> None:
    """bf16 results of a float64 value computed with float32 sums (error up to `err`): the nearest
    bf16 of a value within `err`, so at most `steps` bf16 steps (of the value's size) plus `err`
    off the nearest bf16 of the exact value, and rarely off at all."""
    want = want64.float().bfloat16()
    step = want.float().abs() * 2.0 ** -7
    diff = (got.float() - want.float()).abs()
    assert (diff <= step * steps * 1.01 + err).all(), (diff - step * steps * 1.01 - err).max()
    assert (diff == 0).float().mean() >= 0.97


@pytest.mark.parametrize("which", _LIBS)
@pytest.mark.parametrize("m,k,n", _SHAPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_f32_epilogue_with_bias_and_add(which: str, m: int, k: int, n: int, threads: int) -> None:
    lib = _lib(which)
    x, w = _data(m, k, n)
    g = torch.Generator().manual_seed(13)
    bias, add = torch.randn(n, generator=g), torch.randn(m, n, generator=g)
    prod = x.double() @ w.double().T
    bound = _sum_error(x, w)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = cpu_amx_gemm.gemm(x, w, cpu_bf16_gemm.PackedBf16(), bias=bias, lib=lib)
        got_add = cpu_amx_gemm.gemm(x, w, cpu_bf16_gemm.PackedBf16(), add=add, lib=lib)
    finally:
        torch.set_num_threads(before)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    assert ((got.double() - (prod + bias.double())).abs() <= bound + 1e-6).all()
    assert ((got_add.double() - (prod + add.double())).abs() <= bound + 1e-6).all()


@pytest.mark.parametrize("which", _LIBS)
@pytest.mark.parametrize("m,k,n", _SHAPES)
def test_bf16_epilogue(which: str, m: int, k: int, n: int) -> None:
    lib = _lib(which)
    x, w = _data(m, k, n, seed=1)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(11))
    got = cpu_amx_gemm.gemm(x, w, cpu_bf16_gemm.PackedBf16(), bias=bias, mode=cpu_amx_gemm.OUT_BF16, lib=lib)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    _bf16_close(got, x.double() @ w.double().T + bias.double(), _sum_error(x, w))


@pytest.mark.parametrize("which", _LIBS)
@pytest.mark.parametrize("m,k,inter", [(1, 64, 48), (5, 70, 40), (17, 96, 33), (130, 1100, 70)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_silu_mul_epilogue(which: str, m: int, k: int, inter: int, with_bias: bool) -> None:
    lib = _lib(which)
    x, w = _data(m, k, 2 * inter, seed=2)
    bias = torch.randn(2 * inter, generator=torch.Generator().manual_seed(12)) if with_bias else None
    got = cpu_amx_gemm.gemm(x, w, cpu_bf16_gemm.PackedBf16(), bias=bias, mode=cpu_amx_gemm.OUT_SILU_MUL, lib=lib)
    assert got.dtype == torch.bfloat16 and got.shape == (m, inter)
    h = x.double() @ w.double().T + (0 if bias is None else bias.double())
    gate, up = h[:, :inter], h[:, inter:]
    s = torch.nn.functional.silu(gate).float().bfloat16().double()  # the activation is rounded to bf16 first
    e = _sum_error(x, w)  # float32 sums move gate and up by up to e (silu' < 1.1)
    err = (s.abs() + 1.1 * up.abs() + 1) * (e[:, :inter] + e[:, inter:])
    _bf16_close(got, up * s, err, steps=2)  # (two roundings: a gate near a bf16 midpoint may move both)


@pytest.mark.parametrize("which", _LIBS)
def test_panel_orders_agree(which: str) -> None:
    """Both panel orders (column panels outer where the weight is bigger; else row panels over
    groups of column panels, the last group short) cover every output once: a build whose L2
    budget makes groups of 2 column panels (3 of them) gives the default build's result exactly."""
    lib = _lib(which)
    small = cpu_amx_gemm.variant_library(which == "emulated", ("B_L2=16384",))
    if small is None:
        skip_or_fail("no C compiler (or TOKENMILL_NO_C_KERNELS set)")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for m, n in ((300, 80), (200, 300)):  # rows > columns: grouped rows-major; else columns outer
            x, w = _data(m, 96, n, seed=6)
            got = cpu_amx_gemm.gemm(x, w, cpu_bf16_gemm.PackedBf16(), lib=small)
            assert torch.equal(got, cpu_amx_gemm.gemm(x, w, cpu_bf16_gemm.PackedBf16(), lib=lib))
            assert ((got.double() - x.double() @ w.double().T).abs() <= _sum_error(x, w)).all()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("which", _LIBS)
def test_weight_prefetch_changes_nothing(which: str) -> None:
    """The weight prefetch of panels that stream it (column panels outer: decode, the LM head) only
    asks for memory: a build without it gives the same bits, every epilogue, one and two threads,
    row tails, N tails, K in two chunks and two row panels (only the first prefetches) included (and
    the results are right)."""
    lib = _lib(which)
    plain = cpu_amx_gemm.variant_library(which == "emulated", ("PF_AHEAD=0",))
    if plain is None:
        skip_or_fail("no C compiler (or TOKENMILL_NO_C_KERNELS set)")
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for m, k, n in ((3, 96, 600), (40, 1100, 330), (64, 576, 1000), (200, 64, 700)):  # rows < columns
                x, w = _data(m, k, n, seed=7)
                add = torch.randn(m, n, generator=torch.Generator().manual_seed(8))
                for mode in (cpu_amx_gemm.OUT_F32, cpu_amx_gemm.OUT_BF16, cpu_amx_gemm.OUT_SILU_MUL):
                    a = None if mode != cpu_amx_gemm.OUT_F32 else add
                    got = cpu_amx_gemm.gemm(x, w, cpu_bf16_gemm.PackedBf16(), add=a, mode=mode, lib=lib)
                    assert torch.equal(got, cpu_amx_gemm.gemm(x, w, cpu_bf16_gemm.PackedBf16(), add=a, mode=mode,
                                                              lib=plain)), (threads, m, k, n, mode)
                    if mode == cpu_amx_gemm.OUT_F32:
                        want = x.double() @ w.double().T + add.double()
                        assert ((got.double() - want).abs() <= _sum_error(x, w)).all()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("which", _LIBS)
def test_matches_the_vdpbf16ps_gemm(which: str) -> None:
    """Where `cpu_bf16_gemm` runs: the same packed weight, results within float32 summation order."""
    if not cpu_bf16_gemm.available():
        pytest.skip("no vdpbf16ps on this CPU")
    lib = _lib(which)
    x, w = _data(37, 576, 100, seed=3)
    cache = cpu_bf16_gemm.PackedBf16()
    a, b = cpu_amx_gemm.gemm(x, w, cache, lib=lib), cpu_bf16_gemm.gemm(x, w, cache)
    assert ((a.double() - b.double()).abs() <= 2 * _sum_error(x, w)).all()


def test_routing_on_the_amx_path() -> None:
    """On the amx path (where the real build loads) wide linears take the AMX GEMM at the row counts
    `cpu_amx_gemm.takes_f32` names, and bf16 / silu-mul linears where `takes_bf16` does; the results
    are the kernel's own."""
    if cpu_amx_gemm.library() is None:
        pytest.skip("not on the amx kernel path")
    x, w = _data(1000, 576, 576, seed=4)
    wg = _data(1, 576, 2 * 576, seed=5)[1]
    for rows in (1, 16, 64, 300, 1000):  # (1000 x 576 bf16 activations: oneDNN's, but for silu-mul)
        xr = x[:rows]
        out = wide_linear.linear_f32(xr, w, None, PackedWeight(), cpu_bf16_gemm.PackedBf16())
        amx = cpu_amx_gemm.gemm(xr, w, cpu_bf16_gemm.PackedBf16())
        assert torch.equal(out, amx) == cpu_amx_gemm.takes_f32(rows)
        # bf16 out: oneDNN's AMX kernels may sum in the tiles' order, so which one ran shows in
        # whether the GEMM packing was made (oneDNN's path makes none)
        cache, caches = PackedWeight(), (PackedWeight(), PackedWeight())
        bf = linear(xr, w, None, cache)
        act = silu_mul_linear(xr, wg, None, caches)
        assert (cache.gemm is not None) == cpu_amx_gemm.takes_bf16(rows, xr.shape[1])
        assert (caches[0].gemm is not None) == cpu_amx_gemm.takes_bf16(rows, xr.shape[1], silu_mul=True)
        if cache.gemm is not None:
            assert torch.equal(bf, cpu_amx_gemm.gemm(xr, w, cpu_bf16_gemm.PackedBf16(), mode=cpu_amx_gemm.OUT_BF16))
        if caches[0].gemm is not None:
            assert torch.equal(act, cpu_amx_gemm.gemm(xr, wg, cpu_bf16_gemm.PackedBf16(),
                                                      mode=cpu_amx_gemm.OUT_SILU_MUL))
    assert "AMX tile GEMM up to" in cpu_isa.describe()
