"""Batched LoRA kernels (Triton, under the CPU interpreter in float32) and the CPU path, against
the per-token torch reference, on small shapes with mixed slots (and tokens without an adapter)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are defined: before the first import

import pytest
import torch

from tests.helpers.triton_required import require_triton

require_triton()

from tokenmill.layers.lora.lora_layer import LoRABatch, LoRASlots  # noqa: E402
from tokenmill.layers.lora.torch_lora import lora_add_grouped, lora_reference  # noqa: E402
from tokenmill.layers.lora.triton_lora import lora_expand, lora_shrink  # noqa: E402

PARTS = {"qkv": [64, 32, 32], "gate_up": [48, 48], "single": [80]}


def _case(num_tokens: int, parts: list[int], slots: int = 3, rank: int = 16, k: int = 40, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, k, generator=g)
    a = torch.randn(slots, len(parts) * rank, k, generator=g) * 0.3
    b = torch.randn(slots, sum(parts), rank, generator=g) * 0.3
    token_slots = torch.randint(-1, slots, (num_tokens,), generator=g)
    y = torch.randn(num_tokens, sum(parts), generator=g)
    starts = tuple(int(v) for v in torch.tensor([0] + parts).cumsum(0))
    return x, a, b, token_slots, y, starts


@pytest.mark.parametrize("num_tokens,k", [(1, 40), (7, 40), (40, 40), (5, 300)])  # K = 300: split over programs
@pytest.mark.parametrize("shape", sorted(PARTS))
def test_triton_shrink_expand_match_reference(num_tokens, k, shape):
    x, a, b, token_slots, y, starts = _case(num_tokens, PARTS[shape], k=k)
    expected = y + lora_reference(x, a, b, starts, token_slots)
    sorted_slots, order = torch.sort(token_slots.to(torch.int32), stable=True)
    shrunk = lora_shrink(x, a, order.to(torch.int32), sorted_slots)
    assert (shrunk.shape[0] > 1) == (k > 64)  # K = 300 is split: the expand adds the planes
    out = lora_expand(shrunk, b, order.to(torch.int32), sorted_slots, y.clone(), starts)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    no_adapter = token_slots < 0
    assert torch.equal(out[no_adapter], y[no_adapter])  # rows without an adapter are untouched


@pytest.mark.parametrize("shape", sorted(PARTS))
def test_cpu_grouped_path_matches_reference(shape):
    x, a, b, token_slots, y, starts = _case(33, PARTS[shape], seed=1)
    batch = LoRABatch(torch.device("cpu"))
    batch.prepare(token_slots, token_slots.numpy())
    out = lora_add_grouped(x, y.clone(), a, b, starts, batch.groups)
    torch.testing.assert_close(out, y + lora_reference(x, a, b, starts, token_slots), atol=1e-5, rtol=1e-5)


def test_reference_is_plain_lora():
    """The reference itself: one token, one slot, against (x A^T) B^T written out per part."""
    x, a, b, _, _, starts = _case(1, PARTS["qkv"], slots=2, seed=2)
    slots = torch.tensor([1])
    delta = lora_reference(x, a, b, starts, slots)
    for i, (lo, hi) in enumerate(zip(starts[:-1], starts[1:])):
        part_a = a[1, i * 16:(i + 1) * 16]
        torch.testing.assert_close(delta[0, lo:hi], (x[0] @ part_a.T) @ b[1, lo:hi].T, atol=1e-5, rtol=1e-5)


def test_slots_pad_lower_ranks_with_zeros():
    batch = LoRABatch(torch.device("cpu"))
    slots = LoRASlots(batch, 2, 16, 8, [16, 16], torch.float32, torch.device("cpu"))
    a, b = torch.randn(4, 8), torch.randn(16, 4)
    slots.set_slot(1, 1, a, b)
    x = torch.randn(3, 8)
    batch.prepare(torch.tensor([1, -1, 1]), torch.tensor([1, -1, 1]).numpy())
    y = slots.apply(x, torch.zeros(3, 32))
    torch.testing.assert_close(y[0, 16:], (x[0] @ a.T) @ b.T)
    assert not y[:, :16].any() and not y[1].any()
