"""Triton kernel: each row's greedy token and whether the row is finite, in one launch.

Why: the greedy step-end graph (`worker.greedy_tail`) ran `~isfinite(logits.sum(-1))` and
`logits.argmax(-1)` as two torch reductions: at batch 1 over a 128k vocabulary they add ~42 us to
a ~2.3 ms INT4 decode step on an H200 (a one-row reduction keeps few SMs busy). Here one program
per row walks the row once (BLOCK columns a pass, 16 warps), keeping each lane's maximum, its first
column and a non-finite flag, then reduces them: ~a few us (the logits were just written: in L2).

Values: the first column holding the row's maximum, as `torch.argmax` (ties to the lowest index);
`bad` where any value is NaN or infinite (the sum-based screen also flagged a finite row whose sum
overflows float32: never for real logits). A bad row's id is unspecified (the caller replaces it).

Requires triton at import.
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

logger = logging.getLogger(__name__)

BLOCK = 2048  # columns a pass (16 warps: 4 a thread)


@triton.jit
def _greedy_kernel(x_ptr, ids_ptr, bad_ptr, V, s_row, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    at = tl.full([BLOCK], 2147483647, dtype=tl.int32)
    bad = tl.zeros([BLOCK], dtype=tl.int32)
    for c0 in range(0, V, BLOCK):
        c = c0 + cols
        x = tl.load(x_ptr + row * s_row + c, mask=c < V, other=float("-inf")).to(tl.float32)
        bad |= ((tl.abs(x) < float("inf")) == 0).to(tl.int32) & (c < V).to(tl.int32)  # NaN, +-inf (read columns)
        take = x > best  # strictly larger: a lane keeps its first column of a tie (passes go up in columns)
        best = tl.where(take, x, best)
        at = tl.where(take, c, at)
    top = tl.max(best, axis=0)
    first = tl.min(tl.where(best == top, at, 2147483647), axis=0)  # the lowest column holding the maximum
    tl.store(ids_ptr + row, first.to(tl.int64))
    tl.store(bad_ptr + row, tl.max(bad, axis=0) != 0)


def greedy_argmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int64 [rows] first argmax, bool [rows] row not finite) of 2-D logits (last axis contiguous)."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"greedy_argmax: 2-D logits with contiguous rows, got {tuple(logits.shape)} "
                         f"{tuple(logits.stride())}")
    rows, vocab = logits.shape
    ids = torch.empty(rows, dtype=torch.int64, device=logits.device)
    bad = torch.empty(rows, dtype=torch.bool, device=logits.device)
    if rows:
        _greedy_kernel[(rows,)](logits, ids, bad, vocab, logits.stride(0), BLOCK=BLOCK, num_warps=16)
    return ids, bad


_SELFTEST: dict[str, bool] = {}


def selftest(device: torch.device) -> bool:
    """Once per device: the kernel against torch on rows with a tie, a NaN and an infinity. False
    (logged): callers keep torch's reductions. First asked inside a CUDA graph capture: False for
    that capture (a test cannot run there), asked again later."""
    key = str(device)
    if key in _SELFTEST:
        return _SELFTEST[key]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return False
    _SELFTEST[key] = _run_selftest(device)
    return _SELFTEST[key]


def _run_selftest(device: torch.device) -> bool:
    try:
        g = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(4, 5000, device=device, generator=g)
        x[1, 7] = x[1, 4000] = 9.0
        x[2, 100] = float("nan")
        x[3, 4999] = float("inf")
        ids, bad = greedy_argmax(x)
        ok = (torch.equal(bad, ~torch.isfinite(x.sum(-1))) and torch.equal(ids[~bad], x.argmax(-1)[~bad])
              and ids[1].item() == 7)
        why = "wrong answer"
    except Exception as e:  # noqa: BLE001 - a compile or launch failure: fall back, loudly
        ok, why = False, f"{type(e).__name__}: {str(e)[:300]}"
    if not ok:
        logger.warning("greedy_argmax failed its self-test on %s (%s): torch's argmax runs", device, why)
    return ok
