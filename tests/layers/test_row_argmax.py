"""`row_argmax` (numpy's argmax for host float32 rows) gives torch's argmax: the first maximum of
each row on ties, the first NaN where a row has one, int64, keepdim; other dtypes go to torch.
Planted defect seen failing: the last maximum on ties (numpy's argmax of the reversed row)."""

from __future__ import annotations

import pytest
import torch

from tokenmill.layers.sampling.row_argmax import row_argmax


@pytest.mark.parametrize("rows, vocab", [(1, 49152), (64, 1000), (3, 1)])
def test_row_argmax_is_torch_argmax(rows: int, vocab: int) -> None:
    gen = torch.Generator().manual_seed(rows + vocab)
    x = torch.randint(-3, 4, (rows, vocab), generator=gen).float()  # many ties
    if rows > 2 and vocab > 10:
        x[1, 5] = float("nan")
        x[1, 9] = float("nan")
        x[2] = 7.0
    with torch.inference_mode():
        got, kept = row_argmax(x), row_argmax(x, keepdim=True)
    assert got.dtype == torch.int64 and torch.equal(got, x.argmax(dim=-1))
    assert torch.equal(kept, x.argmax(dim=-1, keepdim=True))


def test_other_dtypes_and_layouts_take_torch() -> None:
    x = torch.randn(4, 33)
    assert torch.equal(row_argmax(x.bfloat16()), x.bfloat16().argmax(dim=-1))
    assert torch.equal(row_argmax(x.t()), x.t().argmax(dim=-1))  # not contiguous
