"""Gated activations over a fused [gate | up] projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers import triton_ops


class SiluAndMul(nn.Module):
    """[..., 2 * d] -> [..., d]: silu(gate) * up, with gate the first half (one fused kernel on CUDA)."""

    # Set by `quantization.fp8.mark_fused_producers` where an FP8 W8A8 linear reads the output:
    # the kernel also writes its per-token fp8 codes (`triton_fp8_fused.silu_and_mul_quant`).
    fp8_out = False
    # Set by `quantization.fp8.mark_fused_producers` where the fp8 weight-streaming GEMV reads the
    # output (small batches): the product is left to that GEMV's loads (`fp8.defer_silu`).
    fp8_defer = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8_defer:
            from tokenmill.layers.quantization.fp8 import defer_silu
            deferred = defer_silu(self, x)
            if deferred is not None:
                return deferred
        if self.fp8_out and triton_ops.enabled(x):
            from tokenmill.layers.quantization.fp8 import fused_codes_wanted
            if fused_codes_wanted(self, x, x.dtype):
                from tokenmill.layers.quantization.fp8 import codes_only
                from tokenmill.layers.quantization.triton_fp8_fused import silu_and_mul_quant
                return silu_and_mul_quant(x, write_out=not codes_only(self))
        if triton_ops.enabled(x):
            from tokenmill.layers.triton_ops.silu_and_mul import silu_and_mul
            if self.int4_kperm(x):  # written in the INT4 swapped GEMM's K order, marked
                from tokenmill.layers.quantization import int4_kperm
                return int4_kperm.mark(silu_and_mul(x, kperm=True), True)
            return silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)

    def int4_kperm(self, x: torch.Tensor) -> bool:
        """Whether this call (x [rows, 2 d]) writes its product in the INT4 swapped GEMM's K order
        (`quantization.int4_kperm`: linked to down_proj, which takes these rows with that GEMM)."""
        if "_int4_kperm_reader" not in self.__dict__ or x.dim() != 2:
            return False
        from tokenmill.layers.quantization import int4_kperm
        return int4_kperm.wanted(self, x, x.shape[0], x.shape[1] // 2, x.dtype)


class GeluTanhAndMul(nn.Module):
    """[..., 2 * d] -> [..., d]: gelu_tanh(gate) * up (GeGLU, HF's `gelu_pytorch_tanh`: Gemma)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh").mul_(up)
