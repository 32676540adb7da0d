"""Sliding windows and logit soft-capping in every attention backend (torch reference, the CPU
decode kernel, Triton under its CPU interpreter), against the float64 naive reference.

The blocks wholly before a sequence's window are poisoned with NaN: a backend that reads them
(even to mask them out: 0 * NaN is NaN) fails, so "blocks outside the window are not read" is
checked, not just the result.
"""

from __future__ import annotations

import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are defined: before the first import

import pytest
import torch

from tests.layers.test_attention import make_case
from tokenmill.layers.attention import cpu_decode
from tokenmill.layers.attention.torch_ref import TorchRefAttentionBackend

# (contexts, query lengths): decodes far past the window, chunks straddling it, fresh prefills
# longer than it, a short sequence inside it.
MIX = ([40, 0, 33, 5, 70, 0], [1, 30, 6, 1, 1, 9])


def poisoned_case(window: int | None, softcap: float | None, block_size: int, dtype=torch.float32,
                  heads=(4, 2), head_dim=16, mix=MIX):
    case = make_case(*mix, block_size, *heads, dtype, "cpu", pad_tokens=2, head_dim=head_dim, window=window,
                     softcap=softcap)
    num_dead = 0
    if window is not None:
        flat = case.kv_cache.view(2, -1, heads[1], head_dim)
        for i, ctx in enumerate(mix[0]):
            first_key = max(ctx - window + 1, 0)  # the first key this sequence's first query sees
            for b in range(first_key // block_size):  # blocks wholly before it
                block = int(case.meta.block_table[i, b])
                flat[:, block * block_size:(block + 1) * block_size] = float("nan")
                num_dead += 1
    return case, num_dead


def run_backend(backend, case):
    out = backend.forward(case.q, case.k, case.v, case.kv_cache, case.meta)
    n = case.meta.num_tokens
    assert not out[:n].isnan().any(), "a block before the window was read"
    return out[:n].double()


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("window,softcap", [(7, None), (16, None), (None, 0.8), (9, 0.8)])
@pytest.mark.parametrize("c_kernel", [True, False])
def test_torch_reference(block_size, window, softcap, c_kernel, monkeypatch):
    if not c_kernel:
        monkeypatch.setattr(cpu_decode, "available", lambda: False)
    elif not cpu_decode.available():
        pytest.skip("no C compiler")
    case, num_dead = poisoned_case(window, softcap, block_size)
    assert window is None or num_dead > 0, "the case must have blocks before a window"
    backend = TorchRefAttentionBackend(4, 2, 16, 1 / math.sqrt(16), window, softcap)
    torch.testing.assert_close(run_backend(backend, case), case.expected, atol=1e-4, rtol=1e-4)


def test_one_block_too_far_fails():
    """A backend whose window reaches one block further than HF's reads the poisoned block (or
    attends to keys it must not): the check above catches it."""
    case, _ = poisoned_case(8, None, 4)
    backend = TorchRefAttentionBackend(4, 2, 16, 1 / math.sqrt(16), 8 + 4, None)
    out = backend.forward(case.q, case.k, case.v, case.kv_cache, case.meta)[:case.meta.num_tokens].double()
    assert out.isnan().any() or not torch.allclose(out, case.expected, atol=1e-4, rtol=1e-4)


# Decode tiles (max_query_len <= 8, split KV allowed): single and multi-token decodes past the window.
DECODES = ([40, 5, 70, 61], [1, 1, 3, 5])


@pytest.mark.parametrize("window,softcap,splits", [(7, None, 1), (9, 0.8, 1), (9, 0.8, 3), (None, 0.8, 2)])
@pytest.mark.parametrize("mix", [MIX, DECODES], ids=["mixed", "decodes"])
def test_triton(window, softcap, splits, mix):
    from tests.helpers.triton_required import require_triton
    require_triton()
    from tokenmill.layers.attention.triton_backend import TritonAttentionBackend, TritonAttentionConfig

    case, _ = poisoned_case(window, softcap, 4, mix=mix)
    backend = TritonAttentionBackend(4, 2, 16, 1 / math.sqrt(16), window, softcap,
                                     config=TritonAttentionConfig(kv_splits=splits))
    torch.testing.assert_close(run_backend(backend, case), case.expected, atol=1e-4, rtol=1e-4)


def test_triton_wide_heads():
    """Gemma's head_dim 256 (half-size tiles), with a window and soft-capping."""
    from tests.helpers.triton_required import require_triton
    require_triton()
    from tokenmill.layers.attention.triton_backend import TritonAttentionBackend

    case, _ = poisoned_case(9, 0.8, 4, heads=(4, 2), head_dim=256, mix=([40, 0, 7], [1, 20, 3]))
    backend = TritonAttentionBackend(4, 2, 256, 1 / math.sqrt(256), 9, 0.8)
    assert backend.config.block_n == 32
    torch.testing.assert_close(run_backend(backend, case), case.expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("window,softcap,splits", [(7, None, 4), (9, 0.8, 3), (None, 0.8, 2)])
def test_triton_prewait(window, softcap, splits):
    """Split decode launches that read before their PDL wait (PREWAIT: the SM count set so that they
    fit one wave): the first tile a program preloads starts at its window, never in a dead block."""
    from tests.helpers.triton_required import require_triton
    require_triton()
    from tokenmill.layers.attention.triton_backend import TritonAttentionBackend, TritonAttentionConfig, plan_launch

    case, num_dead = poisoned_case(window, softcap, 4, mix=DECODES)
    assert window is None or num_dead > 0
    config = TritonAttentionConfig(kv_splits=splits)
    backend = TritonAttentionBackend(4, 2, 16, 1 / math.sqrt(16), window, softcap, config=config)
    backend._sm_count = 1024
    assert plan_launch(backend.config, 4, 2, case.q.shape[0], 4, 5, 80, 1024).prewait
    torch.testing.assert_close(run_backend(backend, case), case.expected, atol=1e-4, rtol=1e-4)
