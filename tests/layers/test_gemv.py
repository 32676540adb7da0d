"""The one-row GEMV kernel (`triton_ops.gemv`) under Triton's CPU interpreter against its float64
reference: float32 and float16, K a multiple of the tile or not, N not a multiple of BLOCK_N, with
and without bias, and every tile configuration the GPU sweep (scripts/gpu_gemv.py) tries."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are defined: before the first import

import pytest
import torch

from tests.helpers.triton_required import require_triton

require_triton()

from tokenmill.layers.triton_ops.gemv import GemvTiles, gemv, gemv_reference  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,k,bias", [(20, 64, False), (37, 96, True), (8, 200, False)])
@pytest.mark.parametrize("tiles", [GemvTiles(8, 32, 1, 1), GemvTiles(4, 64, 2, 2), GemvTiles(16, 16, 1, 1),
                                   GemvTiles(2, 64, 1, 1)])
def test_gemv_equals_the_reference(dtype, n, k, bias, tiles):
    g = torch.Generator().manual_seed(n * k)
    x = torch.randn(1, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    got = gemv(x, w, b, tiles)
    assert got.shape == (1, n) and got.dtype == dtype
    want = gemv_reference(x, w, b)
    torch.testing.assert_close(got.double(), want, rtol=TOL[dtype], atol=TOL[dtype] * k ** 0.5)


def test_gemv_takes_a_flat_row_and_refuses_strided_weights():
    x, w = torch.randn(48), torch.randn(10, 48)
    torch.testing.assert_close(gemv(x, w, tiles=GemvTiles(8, 16, 1, 1)).double(), gemv_reference(x, w),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="contiguous rows"):
        gemv(x, torch.randn(48, 10).t())
    with pytest.raises(ValueError, match="one row"):
        gemv(torch.randn(2, 48), w)


def test_which_one_row_linears_take_the_gemv(monkeypatch):
    from tokenmill.layers.triton_ops import gemv as module
    x, w = torch.zeros(1, 64, dtype=torch.float16), torch.zeros(32, 64, dtype=torch.float16)
    monkeypatch.setattr(module, "TABLE", {(32, 64): GemvTiles(8, 32, 1, 1)})
    assert module.applies(x, w, None)
    assert not module.applies(x, torch.zeros(16, 64, dtype=torch.float16), None)  # a shape not in the table
    assert not module.applies(x.float(), w.float(), None)  # 16-bit only
    assert not module.applies(x, torch.zeros(64, 32, dtype=torch.float16).t(), None)  # strided rows
    monkeypatch.setenv("TOKENMILL_GEMV", "0")
    assert not module.applies(x, w, None)
    monkeypatch.setenv("TOKENMILL_GEMV", "all")
    assert module.applies(x, torch.zeros(16, 64, dtype=torch.float16), None)


def test_every_table_entry_computes_the_product():
    """The tiles the table gives the engine's shapes, on a small K (masked tails) in float16."""
    from tokenmill.layers.triton_ops.gemv import TABLE
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 200, generator=g).half()
    w = torch.randn(40, 200, generator=g).half()
    for tiles in set(TABLE.values()):
        torch.testing.assert_close(gemv(x, w, tiles=tiles).double(), gemv_reference(x, w), rtol=2e-3, atol=2e-2)
