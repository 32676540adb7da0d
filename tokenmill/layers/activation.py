"""Gated activations over a fused [gate | up] projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers import triton_ops


class SiluAndMul(nn.Module):
    """[..., 2 * d] -> [..., d]: silu(gate) * up, with gate the first half (one fused kernel on CUDA)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if triton_ops.enabled(x):
            from tokenmill.layers.triton_ops.silu_and_mul import silu_and_mul
            return silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)


class GeluTanhAndMul(nn.Module):
    """[..., 2 * d] -> [..., d]: gelu_tanh(gate) * up (GeGLU, HF's `gelu_pytorch_tanh`: Gemma)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh").mul_(up)
