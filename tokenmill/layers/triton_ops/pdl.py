"""Programmatic dependent launch (PDL, compute capability 9.0+) for the decode chain's Triton kernels.

A kernel launched with PDL may start while the kernel before it in the stream is still running.
Its programs first do only what reads constant data (an fp8 GEMV's first weight tile), then
`wait` for the previous kernel to finish with its writes visible, and only then read or write
anything another kernel produces or consumes. Each such kernel also calls `launch_dependents`
early, so the next kernel's programs may be scheduled as soon as every program of this one has
started. Inside a CUDA graph the launches become programmatic edges: the launch latency and the
ramp of the next grid overlap the tail of the previous one (batch 1 runs ~10 kernels per layer,
each a few microseconds).

Invariant: before its `wait`, a PDL kernel touches no memory that any other kernel writes or
reads-then-frees. `wait` waits for the whole previous grid, which itself waited for its own
predecessor, so ordering is transitive along the stream. A kernel without PDL after one with it
is serialized as usual.

TOKENMILL_PDL=0 turns it off; `FORCE` lets a benchmark compare both in one process (engines
capture their graphs at start, so it must be set before an engine is built).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

ENV_VAR = "TOKENMILL_PDL"
FORCE: bool | None = None  # None: the environment decides


@functools.cache
def _env_on() -> bool:
    return os.environ.get(ENV_VAR, "1").lower() not in ("0", "false", "no")


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def enabled(device: torch.device) -> bool:
    """Whether kernels on this device launch with PDL (CUDA 9.0+, not turned off)."""
    if device.type != "cuda":
        return False
    on = _env_on() if FORCE is None else FORCE
    return on and _capable(device.index if device.index is not None else torch.cuda.current_device())


def launch_kwargs(device: torch.device) -> dict:
    """The launch keywords and the kernel's USE_PDL constexpr for this device."""
    on = enabled(device)
    return {"USE_PDL": on, "launch_pdl": True} if on else {"USE_PDL": False}


@triton.jit
def wait(USE_PDL: tl.constexpr):
    """Wait for the previous kernel in the stream (its writes visible); a no-op without PDL."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def launch_dependents(USE_PDL: tl.constexpr):
    """Let the next kernel launch once every program of this one has called this (a hint)."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
