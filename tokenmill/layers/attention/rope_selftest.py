"""Device self-test of the rotary + KV write inside the attention kernel (`triton_paged_attention`'s
ROPE, the backend's `rope_in_attention`), once per device and shape: a batch-1 decode over a short
context, with the backend's heads, cache dtype, block size and scales, against the same launch with
the rotary + KV write kernel before it (`triton_rope_kv_write`). The cache and output must agree
(within a rounding: the compiler may contract the rotation's multiply-adds differently in the two
kernels); where they do not (or the launch fails) the backend runs the rotary kernel (logged).
Not run inside a CUDA graph capture: a launch captured before its test takes the rotary kernel.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

logger = logging.getLogger(__name__)

_RESULTS: dict[tuple, bool] = {}
CONTEXT = 37  # keys cached before the test's query: its key lands inside a KV tile, past a block


def passed(backend, kv_cache: torch.Tensor, q_dtype: torch.dtype, rope) -> bool:
    """Whether `backend` (a TritonAttentionBackend) may rotate and write inside its attention launches
    for this cache and query dtype; False (untested) during a CUDA graph capture."""
    device = kv_cache.device
    key = (str(device), q_dtype, kv_cache.dtype, backend.num_heads, backend.num_kv_heads, backend.head_dim,
           kv_cache.shape[2], backend.k_scale, backend.v_scale, rope.rotary_dim)
    if key in _RESULTS:
        return _RESULTS[key]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return False
    ok, why = False, ""
    try:
        ok, why = _run(backend, kv_cache, q_dtype, rope)
    except Exception as e:  # noqa: BLE001 - a compile or launch failure: the rotary kernel, loudly
        why = f"{type(e).__name__}: {str(e)[:300]}"
    if not ok:
        logger.warning("attention: the rotary + KV write inside the attention kernel failed its self-test on %s "
                       "(%s); the rotary kernel runs before it", device, why)
    _RESULTS[key] = ok
    return ok


def _run(backend, kv_cache: torch.Tensor, q_dtype: torch.dtype, rope) -> tuple[bool, str]:
    from tokenmill.layers.attention.metadata import AttentionMetadata
    from tokenmill.layers.attention.triton_backend import TritonAttentionBackend
    from tokenmill.layers.rotary import RotaryStep

    device, bs = kv_cache.device, kv_cache.shape[2]
    hq, hkv, d = backend.num_heads, backend.num_kv_heads, backend.head_dim
    g = torch.Generator(device="cpu").manual_seed(5)
    blocks = CONTEXT // bs + 1
    table = torch.randperm(blocks + 2, generator=g)[:blocks].to(torch.int32)
    slot = int(table[CONTEXT // bs]) * bs + CONTEXT % bs
    cache = torch.randn((2, blocks + 2, bs, hkv, d), generator=g).to(device=device, dtype=kv_cache.dtype)
    qkv = torch.randn((2, (hq + 2 * hkv) * d), generator=g).to(device=device, dtype=q_dtype)  # a row, a padding row
    qsl = torch.tensor([0, 1], dtype=torch.int32)
    lens = torch.tensor([CONTEXT + 1], dtype=torch.int32)
    meta = AttentionMetadata(num_tokens=1, max_query_len=1, max_seq_len=CONTEXT + 1, query_start_loc=qsl.to(device),
                             seq_lens=lens.to(device), block_table=table[None].to(device),
                             slot_mapping=torch.tensor([slot, -1], device=device), query_start_loc_cpu=qsl,
                             seq_lens_cpu=lens)
    step = RotaryStep(torch.tensor([CONTEXT, 0], device=device), rope.cos_cache, rope.sin_cache, rope.rotary_dim)
    runs = []
    for inside in (False, True):
        config = dataclasses.replace(backend.config, kv_splits=2, rope_in_attention=inside)
        b = TritonAttentionBackend(hq, hkv, d, backend.scale, backend.sliding_window, backend.logit_softcap,
                                   config=config)
        b.k_scale, b.v_scale, b.sinks, b._rope_tested = backend.k_scale, backend.v_scale, backend.sinks, True
        b._sm_count = max(backend._sm_count_of(device), 2 * hkv)  # (the test's two shares must take PREWAIT)
        c, x = cache.clone(), qkv.clone()
        q, k, v = x.view(2, -1, d).split([hq, hkv, hkv], dim=1)
        runs.append((b.forward(q, k, v, c, meta, rope=step)[:1].float(), c.float()))
    (out, c0), (fused_out, c1) = runs
    cache_err = ((c1 - c0).norm() / c0.norm()).item()
    out_err = ((fused_out - out).norm() / out.norm()).item()
    ok = cache_err < 1e-2 and out_err < 1e-2 and bool(torch.isfinite(fused_out).all())
    return ok, f"relative errors: cache {cache_err:.1e}, output {out_err:.1e}"
