"""The C few-row linear against a float64 reference, and its rows independent bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.requirements import skip_or_fail
from tokenmill.layers import cpu_gemm
from tokenmill.layers.linear import Linear


@pytest.fixture(autouse=True)
def _kernel_built():
    if not cpu_gemm.available():  # tokenmill then falls back to torch; see the warning it logged
        skip_or_fail("the C linear kernel is unavailable (no C compiler, a build error, or TOKENMILL_NO_C_KERNELS set)")


@pytest.mark.parametrize("rows", [1, 3, 5, 8])
@pytest.mark.parametrize("k", [576, 61])  # 61: a tail after the 8-wide loop
@pytest.mark.parametrize("bias", [False, True])
def test_matches_reference(rows: int, k: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows * k)
    w = torch.randn(200, k, generator=g)
    b = torch.randn(200, generator=g) if bias else None
    x = torch.randn(2, 16, k, generator=g)[:, :rows]  # strided rows, as a view hands them over
    out = cpu_gemm.linear(x[0], w, b)
    expected = F.linear(x[0].double(), w.double(), None if b is None else b.double())
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-5)


def test_each_row_independent_of_the_others() -> None:
    """A verification step's logits equal plain decoding's only if row r's result depends on
    row r alone: the same bits at any row count, and across thread counts."""
    g = torch.Generator().manual_seed(0)
    w, b, x = torch.randn(300, 576, generator=g), torch.randn(300, generator=g), torch.randn(8, 576, generator=g)
    together = cpu_gemm.linear(x, w, b)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for r in range(8):
                assert torch.equal(cpu_gemm.linear(x[r:r + 1], w, b)[0], together[r])
                assert torch.equal(cpu_gemm.linear(x[:r + 1], w, b)[r], together[r])
    finally:
        torch.set_num_threads(threads)


@torch.inference_mode()
def test_linear_layer_routes_few_float32_rows_to_it() -> None:
    layer = Linear(64, 32)
    assert cpu_gemm.supports(torch.zeros(5, 64), layer.weight, layer.bias)
    assert not cpu_gemm.supports(torch.zeros(9, 64), layer.weight, layer.bias)  # oneDNN's
    assert not cpu_gemm.supports(torch.zeros(5, 64, dtype=torch.bfloat16), layer.weight.bfloat16(), None)
    x = torch.randn(3, 64)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
