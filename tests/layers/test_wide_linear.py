"""bf16 linears with a float32 result (`layers/wide_linear.py`) against a float64 reference.

Both branches: the C kernel (up to FEW_ROWS rows) and the two oneDNN passes (hi + lo) beyond.
The bound, 2e-5 of the largest output, sits between the two-pass error (~2^-18 relative,
measured ~5e-6) and a bf16-rounded result's (~2e-3): a result rounded to bf16 anywhere fails it.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tokenmill.layers import cpu_logits, wide_linear
from tokenmill.layers.linear import PackedWeight
from tokenmill.layers.parallel_linear import RowParallelLinear

_ONE_RANK = SimpleNamespace(layout=SimpleNamespace(tp_rank=0), all_reduce=lambda t: t)  # no TP
pytestmark = pytest.mark.skipif(not cpu_logits.available(), reason="no C compiler for the bf16 -> f32 kernel")


@pytest.mark.parametrize("rows", [1, 5, wide_linear.FEW_ROWS, wide_linear.FEW_ROWS + 1, 100])
def test_float32_result_of_bf16_inputs(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    w = (torch.randn(96, 160, generator=gen) * 0.05).bfloat16()
    bias = torch.randn(96, generator=gen).bfloat16()
    x = (torch.randn(rows, 160, generator=gen) * 3).bfloat16()
    ref = x.double() @ w.double().t() + bias.double()
    with torch.inference_mode():
        out = wide_linear.linear_f32(x, w, bias, PackedWeight())
    assert out.dtype == torch.float32 and out.shape == (rows, 96)
    assert float((out.double() - ref).abs().max() / ref.abs().max()) < 2e-5


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
