"""A read-only probe for `gpu_int4_sweep.py`: how fast the one-row INT4 GEMV's weight stream can
be read at all, with the GEMV's grid and tiles but no arithmetic (each program sums its words).

If the probe reads no faster than the GEMV computes, the bound is the access pattern (panel
layout, grid, loads in flight), not the arithmetic; the GEMV's knobs that change the pattern
(STAGGER, SPLIT, PREFETCH / stages) are then the ones to sweep. A flat probe (each program one
contiguous share of the bytes, `tl.range` pipelined) gives the layout-free ceiling.
Checked against torch's sums of the same words (int32 wrap-around) before it is timed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.layers.quantization.triton_panels import grid_launch_dependents


@triton.jit
def _panel_probe_kernel(qp_ptr, out_ptr, K, PANEL: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                        STAGES: tl.constexpr, STAGGER: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    R: tl.constexpr = BLOCK_K // 8
    offs = tl.arange(0, R)[:, None] * PANEL + tl.arange(0, PANEL)[None, :]
    panel = qp_ptr + pid_n.to(tl.int64) * (K // 8) * PANEL
    steps = K // BLOCK_K // SPLIT
    t_lo = pid_k * steps
    rot = (pid_n * STAGGER) % steps
    acc = tl.zeros([R, PANEL], dtype=tl.int32)
    for i in tl.range(0, steps, num_stages=STAGES):
        t = t_lo + (i + rot) % steps
        acc += tl.load(panel + t * (R * PANEL) + offs)
    tl.store(out_ptr + pid_n * SPLIT + pid_k, tl.sum(tl.sum(acc, axis=1), axis=0))


@triton.jit
def _flat_probe_kernel(w_ptr, out_ptr, per_prog, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    base = w_ptr + pid.to(tl.int64) * per_prog
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in tl.range(0, per_prog // BLOCK, num_stages=STAGES):
        acc += tl.load(base + i * BLOCK + tl.arange(0, BLOCK))
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


def _wrap32(v: torch.Tensor) -> torch.Tensor:
    v = v % (1 << 32)
    return torch.where(v >= 1 << 31, v - (1 << 32), v)


def panel_probe(qpanels: torch.Tensor, block_k: int, split: int, stages: int, stagger: int, warps: int) -> torch.Tensor:
    """Per program (panel, K slice): the int32 sum of its words. qpanels [N / P, K / 8, P]."""
    tiles_n, k8, panel = qpanels.shape
    out = torch.empty(tiles_n * split, dtype=torch.int32, device=qpanels.device)
    _panel_probe_kernel[(tiles_n, split)](qpanels, out, k8 * 8, PANEL=panel, BLOCK_K=block_k, SPLIT=split,
                                          STAGES=stages, STAGGER=stagger, num_warps=warps)
    return out


def panel_probe_reference(qpanels: torch.Tensor, split: int) -> torch.Tensor:
    tiles_n, k8, panel = qpanels.shape
    return _wrap32(qpanels.long().view(tiles_n, split, -1).sum(-1)).view(-1).to(torch.int32)


def flat_probe(words: torch.Tensor, programs: int, block: int, stages: int, warps: int) -> torch.Tensor:
    """Per program: the int32 sum of its contiguous share of `words` (flat int32; the share a
    multiple of `block`: the host trims the tail)."""
    flat = words.reshape(-1)
    per = flat.numel() // programs // block * block
    out = torch.empty(programs, dtype=torch.int32, device=words.device)
    _flat_probe_kernel[(programs,)](flat, out, per, BLOCK=block, STAGES=stages, num_warps=warps)
    return out


def flat_probe_reference(words: torch.Tensor, programs: int, block: int) -> torch.Tensor:
    flat = words.reshape(-1)
    per = flat.numel() // programs // block * block
    return _wrap32(flat[:per * programs].long().view(programs, per).sum(-1)).to(torch.int32)


@triton.jit
def _copy_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr, TRIGGER: tl.constexpr):
    """y = x: the stand-in for the norm or activation kernel ahead of a GEMV. TRIGGER: it lets the
    next kernel (launched with PDL) start at once (`gdc_launch_dependents`), as a norm could."""
    if TRIGGER:
        grid_launch_dependents()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


def copy_ahead(x: torch.Tensor, trigger: bool) -> torch.Tensor:
    y = torch.empty_like(x)
    n = x.numel()
    _copy_kernel[(triton.cdiv(n, 1024),)](x, y, n, BLOCK=1024, TRIGGER=trigger and x.is_cuda, num_warps=4)
    return y
