"""RMSNorm with HF Llama's roundings, and the residual stream kept in float32.

Precision rules (shared by every model built on these layers):
- The residual stream is float32 whatever the activation dtype (`residual_stream`): each
  sublayer's output (bf16) is added to it without rounding. HF rounds the stream to the
  activation dtype at every add; tokenmill keeps more precision there, never less. Where it
  leaves the model (a pipeline stage's hand-over) it is rounded once, as HF would.
- RMSNorm follows HF op for op: mean of squares and `x * rsqrt(...)` in float32, that product
  rounded to the output dtype, then times the weight (rounded again):
  `weight * (x.float() * rsqrt(mean(x^2) + eps)).to(dtype)`. The float32 reciprocal is never
  rounded on its own (a bf16 rstd scales a whole row by up to 0.4% off).
- The output dtype is the activation dtype (`out_dtype`, default: x's), so a float32 stream
  comes out normalized in bf16, ready for the next bf16 matmul.
- On CPU the Llama family's o_proj / down_proj outputs reach the stream in float32 too
  (`wide_linear`): HF rounds them to bf16 before its add.

On CUDA (`triton_ops.enabled`) one Triton kernel does it all, the residual add included,
with the same roundings (`triton_ops.rms_norm`); on CPU, a float32 stream normalized into bf16
goes through one C pass (`cpu_norm`), likewise.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.distributed.parallel_state import PendingAllReduce, reduced
from tokenmill.layers import cpu_norm, triton_ops

RESIDUAL_DTYPE = torch.float32


def residual_stream(x: torch.Tensor) -> torch.Tensor:
    """The residual stream started from the embeddings `x` (a float32 copy; `x` itself where it is
    float32 already: a CPU layer that adds in its matmuls hands on the stream, no op per layer)."""
    return x if x.dtype == RESIDUAL_DTYPE else x.to(RESIDUAL_DTYPE)


def add_in_matmul(x: torch.Tensor, residual: torch.Tensor) -> bool:
    """Whether a layer adds its sublayer outputs to the stream inside the matmul before the norm
    (oneDNN's epilogue on CPU) rather than in the norm: only where activations and stream are
    both float32 and the fused norm kernels do not run."""
    return x.dtype == residual.dtype and not triton_ops.enabled(x)


def stage_handover(hidden: torch.Tensor, residual: torch.Tensor | None,
                   dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What a pipeline stage sends the next, in the activation dtype `dtype` (default hidden's; one
    tensor type on the wire): (hidden, residual) where the fused kernels keep them apart (CUDA),
    else the summed stream alone. The next stage widens the residual back to float32 (`residual_stream`)."""
    hidden = reduced(hidden)
    dtype = dtype or hidden.dtype
    if residual is None:
        return hidden.to(dtype), None
    if triton_ops.enabled(hidden):
        return hidden, residual.to(hidden.dtype)
    return (residual + hidden).to(dtype), None


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """HF's formula, op for op (what the fast paths must equal up to float32 summation order)."""
    dtype = out_dtype or x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight.to(dtype) * h.to(dtype)


class RMSNorm(nn.Module):
    # Set by `quantization.fp8.mark_fused_producers` where an FP8 W8A8 linear reads the output:
    # the kernel also writes its per-token fp8 codes (`triton_fp8_fused`).
    fp8_out = False

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """Normalized x in `out_dtype` (default x's dtype)."""
        out_dtype = out_dtype or x.dtype
        if self.fp8_out and _fp8_codes_wanted(self, x, out_dtype):
            from tokenmill.layers.quantization.fp8 import codes_only
            from tokenmill.layers.quantization.triton_fp8_fused import rms_norm_quant
            return rms_norm_quant(x, None, self.weight, self.eps, out_dtype, write_out=not codes_only(self))
        if triton_ops.enabled(x):
            from tokenmill.layers.triton_ops.rms_norm import rms_norm
            if _int4_kperm(self, x, out_dtype):  # written in the INT4 swapped GEMM's K order, marked
                from tokenmill.layers.quantization import int4_kperm
                return int4_kperm.mark(rms_norm(x, self.weight, self.eps, out_dtype, kperm=True), True)
            return rms_norm(x, self.weight, self.eps, out_dtype)
        weight = self.weight
        if out_dtype == torch.bfloat16 and cpu_norm.supports(x, weight, out_dtype):  # CPU bf16: one C pass
            return cpu_norm.add_rms_norm(x, weight, self.eps)[0]
        # ||x||^2 / n = mean(x^2), accumulated in float32 whatever x's dtype: one pass, no upcast copy.
        rstd = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)
        rstd = rstd.square_().mul_(1.0 / x.shape[-1]).add_(self.eps).rsqrt_()
        normed = torch.mul(x, rstd)  # float32 (rstd is), rounded once below
        if out_dtype != torch.float32:
            normed = normed.to(out_dtype)
        return normed.mul_(weight if weight.dtype == out_dtype else weight.to(out_dtype))

    def forward_with_residual(self, x: torch.Tensor | PendingAllReduce, residual: torch.Tensor,
                              out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Adds `x` into the residual stream, then normalizes it: returns (normed in `out_dtype`,
        default x's, new residual).

        `x` may be a TP partial sum still to be all-reduced (`PendingAllReduce`): the all-reduce,
        the add and the norm then run as one kernel where it takes them
        (`ParallelContext.all_reduce_add_norm`), else the all-reduce runs first.

        The add happens in the residual's dtype (float32: `residual_stream`), unrounded; `x` may be
        float32 too (a CPU bf16 model's o_proj / down_proj: `wide_linear`). The fused kernel updates
        `residual` in place (and returns it); callers use the returned residual only.
        """
        if isinstance(x, PendingAllReduce):
            if out_dtype in (None, x.partial.dtype):
                fused = x.parallel.all_reduce_add_norm(x.partial, residual, self.weight, self.eps)
                if fused is not None:
                    return fused
            x = x.result()
        if self.fp8_out and _fp8_codes_wanted(self, x, x.dtype) and residual.shape == x.shape \
                and residual.stride(-1) == 1:
            from tokenmill.layers.quantization.fp8 import codes_only
            from tokenmill.layers.quantization.triton_fp8_fused import rms_norm_quant
            return rms_norm_quant(x, residual, self.weight, self.eps, x.dtype,
                                  write_out=not codes_only(self)), residual
        if triton_ops.enabled(x):
            from tokenmill.layers.triton_ops.rms_norm import fused_add_rms_norm
            if _int4_kperm(self, x, x.dtype):  # written in the INT4 swapped GEMM's K order, marked
                from tokenmill.layers.quantization import int4_kperm
                normed, residual = fused_add_rms_norm(x, residual, self.weight, self.eps, kperm=True)
                return int4_kperm.mark(normed, True), residual
            return fused_add_rms_norm(x, residual, self.weight, self.eps)
        out_dtype = out_dtype or x.dtype
        if cpu_norm.supports(residual, self.weight, out_dtype, x):  # CPU bf16: the add and the norm in one pass
            return cpu_norm.add_rms_norm(residual, self.weight, self.eps, x)
        residual = residual + x
        return self.forward(residual, out_dtype=out_dtype), residual


def _int4_kperm(norm: nn.Module, x: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """Whether this call writes its output in the INT4 swapped GEMM's K order (`int4_kperm`: the
    norm is linked to its INT4 linear, which takes these rows with that GEMM)."""
    if "_int4_kperm_reader" not in norm.__dict__ or x.dim() != 2:
        return False
    from tokenmill.layers.quantization import int4_kperm
    return int4_kperm.wanted(norm, x, x.shape[0], x.shape[1], out_dtype)


def _fp8_codes_wanted(norm: nn.Module, x: torch.Tensor, out_dtype: torch.dtype) -> bool:
    from tokenmill.layers.quantization.fp8 import fused_codes_wanted
    return triton_ops.enabled(x) and fused_codes_wanted(norm, x, out_dtype)


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

    def forward_with_residual(self, x: torch.Tensor, residual: torch.Tensor,
                              out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """As `RMSNorm.forward_with_residual` (the fused kernel updates `residual` in place)."""
        x = reduced(x)  # (Gemma's layers never defer the all-reduce; a defensive no-op)
        if triton_ops.enabled(x):
            from tokenmill.layers.triton_ops.rms_norm import fused_add_rms_norm
            return fused_add_rms_norm(x, residual, self.weight, self.eps, gemma=True)
        residual = x + residual
        return self.forward(residual).to(out_dtype or x.dtype), residual
