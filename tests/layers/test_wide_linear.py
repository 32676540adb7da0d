"""bf16 linears with a float32 result (`layers/wide_linear.py`) against a float64 reference.

Every branch: the packed AVX512-BF16 GEMM (`cpu_bf16_gemm`, any row count, on every kernel path:
run where the CPU has vdpbf16ps, compile-checked elsewhere), and without it the dot-product C
kernel (up to FEW_ROWS rows) and the two oneDNN passes (hi + lo) beyond; the residual add in the
epilogue. The bound, 2e-5 of the largest output, sits between the two-pass error (~2^-18
relative, measured ~5e-6) and a bf16-rounded result's (~2e-3): a result rounded to bf16
anywhere fails it (planted: the GEMM's output rounded to bf16 fails every GEMM case here).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tokenmill.layers import cpu_bf16_gemm, cpu_isa, cpu_logits, wide_linear
from tokenmill.layers.linear import PackedWeight
from tokenmill.layers.parallel_linear import ParallelLMHead, RowParallelLinear

_ONE_RANK = SimpleNamespace(layout=SimpleNamespace(tp_rank=0), tp_size=1, all_reduce=lambda t: t)  # no TP
pytestmark = pytest.mark.skipif(not cpu_logits.available(), reason="no C compiler for the bf16 -> f32 kernel")


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert float((out.double() - ref).abs().max() / ref.abs().max()) < 2e-5


@pytest.mark.parametrize("gemm", [True, False], ids=["gemm", "no-gemm"])
@pytest.mark.parametrize("rows", [1, 5, wide_linear.FEW_ROWS, wide_linear.FEW_ROWS + 1, 100])
def test_float32_result_of_bf16_inputs(rows: int, gemm: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    w = (torch.randn(96, 160, generator=gen) * 0.05).bfloat16()
    bias = torch.randn(96, generator=gen).bfloat16()
    x = (torch.randn(rows, 160, generator=gen) * 3).bfloat16()
    stream = torch.randn(rows, 96, generator=gen) * 40
    ref = x.double() @ w.double().t() + bias.double()
    cache = cpu_bf16_gemm.PackedBf16() if gemm else None
    with torch.inference_mode():
        _close(wide_linear.linear_f32(x, w, bias, PackedWeight(), cache), ref)
        _close(wide_linear.linear_f32(x, w, None, PackedWeight(), cache, add=stream),
               ref - bias.double() + stream.double())
        _close(wide_linear.linear_f32(x, w, bias, PackedWeight(), cache, add=stream), ref + stream.double())


@pytest.mark.parametrize("path", cpu_isa.PATHS, ids=lambda p: p.name)
# Row blocks: one, two equal (64 rows), three uneven (97); the work taken by column tiles (more
# weight rows than x rows) and by row blocks (130 rows of x over 50 outputs).
@pytest.mark.parametrize("m, k, n", [(1, 64, 16), (7, 33, 17), (13, 576, 100), (64, 96, 520), (97, 64, 300),
                                     (100, 1536, 576), (130, 40, 50)])
def test_gemm_on_every_path(path: cpu_isa.KernelPath, m: int, k: int, n: int) -> None:
    """The packed GEMM against float64 (odd K, N not a multiple of 16, row tails of every size)."""
    gen = torch.Generator().manual_seed(m + k)
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = (torch.randn(n, k, generator=gen) * 0.1).bfloat16()
    add = torch.randn(m, n, generator=gen) * 10
    lib = cpu_bf16_gemm.library(path)
    if not path.has_dpbf16:
        assert lib is None  # wide_linear's other branches serve these paths (tested above)
        return
    if lib is None:
        pytest.fail(f"the {path.name} GEMM did not build")
    ref = x.double() @ w.double().t()
    if not cpu_isa.can_run(path):
        # Built (compile-checked) but not runnable here: its arithmetic is the reference's.
        torch.testing.assert_close(ref.float(), x.float() @ w.float().T, rtol=1e-5, atol=1e-5)
        return
    cache = cpu_bf16_gemm.PackedBf16()
    _close(cpu_bf16_gemm.gemm_f32(x, w, cache, lib=lib), ref)
    _close(cpu_bf16_gemm.gemm_f32(x, w, cache, add, lib=lib), ref + add.double())
    with torch.no_grad():
        w.mul_(2)  # the packed copy follows the weight
    _close(cpu_bf16_gemm.gemm_f32(x, w, cache, lib=lib), 2 * ref)


def test_forward_add_equals_forward_plus_stream() -> None:
    """RowParallelLinear.forward_add with a float32 stream: the add in the epilogue, bit for bit the
    unfused add (what LlamaDecoderLayer's fused CPU bf16 path relies on)."""
    layer = RowParallelLinear(160, 96, bias=False, parallel=_ONE_RANK).to(torch.bfloat16)
    layer.wide_output = True
    x = torch.randn(40, 160).bfloat16()
    stream = torch.randn(40, 96) * 30
    with torch.inference_mode():
        fused = layer.forward_add(x, stream)
        assert torch.equal(fused, stream + layer(x))


def test_row_parallel_linear_wide_output_only_where_set() -> None:
    layer = RowParallelLinear(160, 96, bias=False, parallel=_ONE_RANK).to(torch.bfloat16)
    x = torch.randn(7, 160).bfloat16()
    with torch.inference_mode():
        assert layer(x).dtype == torch.bfloat16
        layer.wide_output = True
        out = layer(x)
    assert out.dtype == torch.float32
    ref = x.double() @ layer.weight.detach().double().t()
    assert float((out.double() - ref).abs().max() / ref.abs().max()) < 2e-5


@pytest.mark.parametrize("rows", [1, 64])
def test_lm_head_logits_float32_of_bf16(rows: int) -> None:
    """ParallelLMHead on CPU in bf16: float32 logits within float32 summation error of the float64
    product (the packed GEMM where the CPU has vdpbf16ps, else the dot-product kernel); logits
    rounded to bf16 anywhere fail (planted: the GEMM's result rounded to bf16 fails both cases)."""
    gen = torch.Generator().manual_seed(rows)
    hidden = torch.randn(rows, 96, generator=gen).bfloat16()
    weight = (torch.randn(700, 96, generator=gen) * 0.1).bfloat16()
    head = ParallelLMHead(SimpleNamespace(tp_size=1, layout=SimpleNamespace(vocab_size=700)))
    with torch.inference_mode():
        logits = head.logits(hidden, weight)
        assert head.gemm_packed.packed is not None or not cpu_bf16_gemm.available()
        _close(logits, hidden.double() @ weight.double().t())
        with torch.no_grad():
            weight.mul_(-1)  # a changed weight is packed again
        _close(head.logits(hidden, weight), hidden.double() @ weight.double().t())
