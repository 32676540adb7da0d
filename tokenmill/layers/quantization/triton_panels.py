"""Shared `@triton.jit` pieces of the one-row INT4 kernels that read the panel layout of
`int4_packing.to_panels` (int32 [N / P, K / 8, P]): the prologue that places a program on its
panel, and the wait on the kernels ahead under programmatic dependent launch (PDL).

PDL (`launch_pdl=True` at launch, Hopper and later): the kernel may start while the one ahead of
it in the stream is still finishing; it must call `grid_dependency_wait` before it reads what that
kernel wrote (the activations) or writes anything. The weights, scales and zeros are the model's,
unchanged during a forward, so their first loads may be issued before the wait: the weight stream
starts while the previous kernel drains. Without PDL the wait returns at once.
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl

try:  # Triton >= 3.4
    from triton.language.extra.cuda import gdc_launch_dependents as _gdc_launch
    from triton.language.extra.cuda import gdc_wait as _gdc_wait
except ImportError:  # pragma: no cover - older Triton
    _gdc_wait = _gdc_launch = None


@triton.jit
def _gdc_wait_asm():
    tl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _gdc_launch_asm():
    tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=tl.int32, is_pure=False,
                              pack=1)


# grid_dependency_wait: see above. grid_launch_dependents: lets the next kernel (if launched with
# PDL) start before this one ends; a hint, safe without PDL.
grid_dependency_wait = _gdc_wait if _gdc_wait is not None else _gdc_wait_asm
grid_launch_dependents = _gdc_launch if _gdc_launch is not None else _gdc_launch_asm


@triton.jit
def panel_prologue(qp_ptr, pid_n, K, PANEL: tl.constexpr, BLOCK_K: tl.constexpr):
    """(offs_r [BLOCK_K / 8] word rows of a K tile, offs_c [PANEL] columns in the panel, offs_n
    [PANEL] output channels, the panel's first word) for the program of panel `pid_n`."""
    offs_r = tl.arange(0, BLOCK_K // 8)
    offs_c = tl.arange(0, PANEL)
    offs_n = pid_n * PANEL + offs_c
    panel = qp_ptr + pid_n.to(tl.int64) * (K // 8) * PANEL
    return offs_r, offs_c, offs_n, panel


def pdl_supported(device) -> bool:
    """PDL launches need an sm_90+ GPU and a Triton that passes `launch_pdl` to the driver."""
    return device.type == "cuda" and _pdl_supported(device.index if device.index is not None else 0)


@functools.cache
def _pdl_supported(index: int) -> bool:
    import torch

    if torch.cuda.get_device_capability(index)[0] < 9:
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:  # pragma: no cover
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


@triton.jit
def prefetch_l1(ptrs):
    """`prefetch.global.L1` of each pointer's line (no register, no wait: ptxas cannot hold it back
    to its use, as it does with a register-prefetch load). CUDA only (inline PTX)."""
    tl.inline_asm_elementwise("prefetch.global.L1 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def prefetch_tile_l1(panel, t, x_ptr, R: tl.constexpr, PANEL: tl.constexpr, BLOCK_K: tl.constexpr):
    """L1 prefetch of K tile t of a panel (its [R, PANEL] words, one pointer per 128-byte line) and
    of x's BLOCK_K values there."""
    LINES: tl.constexpr = PANEL // 32 if PANEL >= 32 else 1
    line = tl.arange(0, R)[:, None] * PANEL + (tl.arange(0, LINES) * 32)[None, :]
    prefetch_l1(panel + t * (R * PANEL) + line)
    prefetch_l1(x_ptr + t * BLOCK_K + tl.arange(0, 1))
