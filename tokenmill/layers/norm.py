"""RMSNorm: HF Llama's numerics (statistics in float32), with few passes over the activations.

The mean square comes from one float32-accumulating `vector_norm` reduction; the
scale is applied in the activation dtype, then the weight, as HF does
(`weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)`). On CPU this is several
times faster than both the op-by-op float32 formula and `F.rms_norm`, above all
in bfloat16, where upcasting the whole activation costs more than the math.

On CUDA (`triton_ops.enabled`) one Triton kernel does it all, the residual add included,
with the same roundings (`triton_ops.rms_norm`).
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.layers import triton_ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if triton_ops.enabled(x):
            from tokenmill.layers.triton_ops.rms_norm import rms_norm
            return rms_norm(x, self.weight, self.eps)
        # ||x||^2 / n = mean(x^2), accumulated in float32 whatever x's dtype.
        rstd = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)
        rstd = rstd.square_().mul_(1.0 / x.shape[-1]).add_(self.eps).rsqrt_()
        return (x * rstd.to(x.dtype)).mul_(self.weight)

    def forward_with_residual(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Adds `x` into the residual stream, then normalizes it: returns (normed, new_residual).

        The add happens in the activation dtype, as HF's `residual + hidden_states` does. The fused
        kernel updates `residual` in place (and returns it); callers use the returned residual only.
        """
        if triton_ops.enabled(x):
            from tokenmill.layers.triton_ops.rms_norm import fused_add_rms_norm
            return fused_add_rms_norm(x, residual, self.weight, self.eps)
        residual = x + residual
        return self.forward(residual), residual


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the weight is stored as an offset from 1 (`x * (1 + weight)`), and, unlike
    Llama's, the whole computation runs in float32 and is cast to the activation dtype at the
    end, as HF's Gemma2/Gemma3RMSNorm do."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if triton_ops.enabled(x):
            from tokenmill.layers.triton_ops.rms_norm import rms_norm
            return rms_norm(x, self.weight, self.eps, gemma=True)
        xf = x.float()
        rstd = xf.square().mean(-1, keepdim=True).add_(self.eps).rsqrt_()
        return (xf * rstd).mul_(1.0 + self.weight.float()).to(x.dtype)

    def forward_with_residual(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """As `RMSNorm.forward_with_residual` (the fused kernel updates `residual` in place)."""
        if triton_ops.enabled(x):
            from tokenmill.layers.triton_ops.rms_norm import fused_add_rms_norm
            return fused_add_rms_norm(x, residual, self.weight, self.eps, gemma=True)
        residual = x + residual
        return self.forward(residual), residual
