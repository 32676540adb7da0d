"""Fused Triton kernels for the per-layer elementwise work on CUDA (GPU fast path).

- `rms_norm`: RMSNorm, and RMSNorm fused with the residual add before it.
- `rotary`: neox rotary embedding of q and k heads in place, cos/sin read by position.
- `silu_and_mul`: silu(gate) * up over a [gate | up] projection.
- `token_bitmask`: grammar token masks (structured outputs) applied to logits in place.

Each replaces several torch kernels (and their round trips through memory) by one launch, which
matters most inside decode CUDA graphs, where a kernel's cost is its fixed time plus its traffic.
All are capture-safe: no host syncs, shapes fixed by the inputs, outputs from the caching allocator.
Numerics follow the torch code paths in `norm.py`, `rotary.py` and `activation.py` op for op
(same roundings to the activation dtype), so they agree to within one rounding.

Importing this package does not import triton; the kernel modules do, and the layers import them
lazily, only after `enabled` said yes. The CPU keeps the torch paths (tuned for CPU and oneDNN).
TOKENMILL_NO_FUSED_OPS=1 turns the kernels off (for A/B measurements).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

DISABLE_ENV_VAR = "TOKENMILL_NO_FUSED_OPS"


@functools.cache
def _usable() -> bool:
    """Read once per process: triton is installed and the kernels are not turned off."""
    if os.environ.get(DISABLE_ENV_VAR, "") in ("1", "true", "yes"):
        return False
    return importlib.util.find_spec("triton") is not None


def enabled(x: torch.Tensor) -> bool:
    """Whether the layers run their fused kernels on tensors like `x` (CUDA, triton installed)."""
    return x.is_cuda and _usable()
