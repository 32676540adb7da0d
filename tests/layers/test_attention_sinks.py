"""Attention sinks (gpt-oss: a learned per-head logit in the softmax's denominator, no value) in
every attention backend: the torch reference (SDPA-free eager path), the CPU C decode kernel, and
the Triton kernels under the CPU interpreter (fp32 / fp16; prefill, chunk and decode tiles, split
KV merged by the reduce kernel), against the float64 naive reference with sinks. Each backend
run with its sinks dropped must miss the same reference (the sinks are large enough to matter).
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

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
# Sinks both above and below the typical scores (one far above: most of the mass goes to it).
SINKS = torch.tensor([0.7, -1.5, 2.5, 0.0])
# (contexts, query lengths): decodes, a chunk over cached context, fresh prefills, a short one.
MIX = ([40, 0, 33, 5, 70, 0], [1, 30, 6, 1, 1, 9])
DECODES = ([40, 5, 70, 61], [1, 1, 3, 5])
TOL = {torch.float32: 1e-4, torch.float16: 3e-3}


def _case(window, softcap, dtype=torch.float32, mix=MIX, block_size=4):
    return make_case(*mix, block_size, HEADS, KV_HEADS, dtype, "cpu", pad_tokens=2, head_dim=HEAD_DIM,
                     window=window, softcap=softcap, sinks=SINKS)


def _run(backend, case, sinks):
    backend.sinks = None if sinks is None else sinks.to(case.q.dtype)
    out = backend.forward(case.q, case.k, case.v, case.kv_cache.clone(), case.meta)
    n = case.meta.num_tokens
    assert not out[:n].isnan().any()
    return out[:n].double()


def _check(make_backend, case, tol):
    torch.testing.assert_close(_run(make_backend(), case, SINKS), case.expected, atol=tol, rtol=tol)
    dropped = _run(make_backend(), case, None)
    assert not torch.allclose(dropped, case.expected, atol=tol * 10, rtol=tol * 10), \
        "the sinks make no difference: the check could not fail"


@pytest.mark.parametrize("window,softcap", [(None, None), (7, None), (9, 0.8)])
@pytest.mark.parametrize("c_kernel", [True, False])
def test_torch_reference(window, softcap, c_kernel, monkeypatch):
    if not c_kernel:
        monkeypatch.setattr(cpu_decode, "available", lambda: False)
    elif not cpu_decode.available():
        pytest.skip("no C compiler")
    case = _case(window, softcap)
    _check(lambda: TorchRefAttentionBackend(HEADS, KV_HEADS, HEAD_DIM, 1 / math.sqrt(HEAD_DIM), window, softcap),
           case, 1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_c_decode_kernel(dtype):
    """The C kernel alone, on decodes only (float32 and bf16 caches)."""
    if not cpu_decode.available():
        pytest.skip("no C compiler")
    case = _case(7, None, dtype, mix=([40, 5, 70, 12], [1, 1, 1, 1]))
    table, lens = case.meta.block_table.contiguous(), case.meta.seq_lens
    cache = case.kv_cache.clone()
    flat = cache.view(2, -1, KV_HEADS, HEAD_DIM)
    flat[0, case.meta.slot_mapping[:4]] = case.k[:4]
    flat[1, case.meta.slot_mapping[:4]] = case.v[:4]
    tol = 1e-4 if dtype == torch.float32 else 2e-2

    def run(sinks):
        return cpu_decode.decode_attention(case.q[:4], cache, table, lens, 1 / math.sqrt(HEAD_DIM), 7,
                                           None, sinks).double()
    torch.testing.assert_close(run(SINKS), case.expected, atol=tol, rtol=tol)
    assert not torch.allclose(run(None), case.expected, atol=tol * 10, rtol=tol * 10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window,softcap,splits", [(None, None, 1), (9, 0.8, 1), (None, None, 3), (7, None, 2)])
@pytest.mark.parametrize("mix", [MIX, DECODES], ids=["mixed", "decodes"])
def test_triton(dtype, window, softcap, splits, mix):
    from tests.helpers.triton_required import require_triton
    require_triton()
    from tokenmill.layers.attention.triton_backend import TritonAttentionBackend, TritonAttentionConfig

    case = _case(window, softcap, dtype, mix=mix)
    config = TritonAttentionConfig(kv_splits=splits)
    _check(lambda: TritonAttentionBackend(HEADS, KV_HEADS, HEAD_DIM, 1 / math.sqrt(HEAD_DIM), window, softcap,
                                          config=config), case, TOL[dtype])
