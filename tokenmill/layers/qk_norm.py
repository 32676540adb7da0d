"""Per-head q/k RMSNorm and rotary for half-precision models, from the float32 qkv accumulator.

Families with q/k norms (Qwen3, Qwen3-MoE, Gemma 3) normalize each q and k head, then rotate it.
HF rounds q and k to bf16 five or six times on that way: the projection's output, `x * rstd`,
the weight's product, then each of the rotary's products and its sum (cos/sin rounded too).
Here the projection's result stays float32 (cuBLAS with a float32 output on CUDA, the packed GEMM's
float32 epilogue on CPU: the same bf16 products, summed in float32, just not rounded), and norm,
weight and rotary (float32 cos/sin) run in float32 with one rounding at the end, where q and k
enter attention (and v is rounded once, as the projection would have).

Why: these roundings are the largest source of bf16 noise that is not a matmul input. On the
tiny Qwen3-MoE configs of the deviation check they move the routers' inputs enough that
tokenmill's bf16 deviation reached 2.1x HF's on some seeds (a routing weight that a slightly
noisier input moves, at a few positions); with them gone, 1.2x at worst over seeds 3-10 and
about 0.9x typical (docs/bf16-numerics.md).

`qkv_float32` returns None where it cannot (float32 models, LoRA or quantized qkv, no float32
epilogue) and, for now, on CPU (`ON_CPU`): the caller keeps the plain path. On CUDA with the fused kernels the norm and rotary are
one Triton launch (`triton_ops.qk_norm_rope`); elsewhere torch ops (`norm_rope_reference`).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from tokenmill.layers import triton_ops, wide_linear
from tokenmill.layers.rotary import RotaryStep


# On CPU the same path lowers the pooled deviation of tiny Qwen3-MoE over seeds 3-16 (tokenmill /
# HF mean 0.895 -> 0.85 prefill, 0.907 -> 0.837 decode), but the CPU test's single seed then
# misses its max bound in decode (1.55x -> 1.74x HF's, one position whose error is set by the
# direction of the router input's noise, not its size). Off on CPU until that check's tail
# statistic is sturdier; tests turn it on to check the CPU wiring.
ON_CPU = False


@functools.cache
def _cuda_mm_f32_works() -> bool:
    """Whether this torch has cuBLAS's bf16 x bf16 -> float32 matmul (`torch.mm(..., out_dtype=)`)."""
    try:
        a = torch.ones((2, 8), dtype=torch.bfloat16, device="cuda")
        return torch.mm(a, a.t(), out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError):
        return False


def qkv_float32(layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """float32 [T, N] `x @ W.T + b` of a plain (unquantized, no LoRA) half-precision `Linear`, from
    the same products as its bf16 result, unrounded; None where that is not available."""
    from tokenmill.layers.linear import UNQUANTIZED
    from tokenmill.layers.lora.lora_layer import has_lora
    weight = getattr(layer, "weight", None)
    if (x.dtype == torch.float32 or weight is None or x.dim() != 2 or weight.dtype != x.dtype
            or getattr(layer, "quant_method", UNQUANTIZED) is not UNQUANTIZED or has_lora(layer)):
        return None
    bias = layer.bias
    if x.is_cuda:
        if not _cuda_mm_f32_works():
            return None
        out = torch.mm(x, weight.t(), out_dtype=torch.float32)
        return out if bias is None else out.add_(bias.float())
    if not ON_CPU or not wide_linear.supports(x, weight):
        return None
    cache = getattr(layer, "_qkv_f32_packed", None)
    if cache is None:
        from tokenmill.layers import cpu_bf16_gemm
        cache = layer._qkv_f32_packed = cpu_bf16_gemm.PackedBf16()
    return wide_linear.linear_f32(x, weight, bias, layer._packed, cache)


def norm_weight_f32(norm: nn.Module) -> torch.Tensor:
    """The float32 per-dim factor of a q/k norm: `weight` (RMSNorm) or `1 + weight` (Gemma's)."""
    from tokenmill.layers.norm import GemmaRMSNorm
    w = norm.weight.float()
    return 1.0 + w if isinstance(norm, GemmaRMSNorm) else w


def norm_rope_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                        sin: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """x float32 [T, H, D] -> out_dtype: `rotate(x * rsqrt(mean(x^2) + eps) * weight)`, neox rotary of
    the first cos.shape[-1] dims with float32 cos/sin [T, 1, rotary_dim], rounded once."""
    y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * weight
    rotary_dim = cos.shape[-1]
    half = rotary_dim // 2
    c, s = cos[..., :half], sin[..., :half]
    y1, y2 = y[..., :half], y[..., half:rotary_dim]
    parts = [y1 * c - y2 * s, y2 * c + y1 * s]
    if rotary_dim < y.shape[-1]:
        parts.append(y[..., rotary_dim:])
    return torch.cat(parts, dim=-1).to(out_dtype)


def norm_rope(qkv: torch.Tensor, q_size: int, kv_size: int, head_dim: int, q_norm: nn.Module,
              k_norm: nn.Module, rope: RotaryStep, out_dtype: torch.dtype
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [T, Hq, D], k [T, Hk, D], v [T, Hk, D]) in `out_dtype` from float32 qkv [T, q | k | v]."""
    t = qkv.shape[0]
    q = qkv[:, :q_size].view(t, q_size // head_dim, head_dim)
    k = qkv[:, q_size:q_size + kv_size].view(t, kv_size // head_dim, head_dim)
    v = qkv[:, q_size + kv_size:].to(out_dtype).view(t, kv_size // head_dim, head_dim)
    wq, wk = norm_weight_f32(q_norm), norm_weight_f32(k_norm)
    if triton_ops.enabled(qkv):
        from tokenmill.layers.triton_ops.qk_norm_rope import qk_norm_rope
        q, k = qk_norm_rope(q, k, wq, wk, q_norm.eps, k_norm.eps, rope.positions, rope.cos_cache,
                            rope.sin_cache, rope.rotary_dim, out_dtype)
        return q, k, v
    # The caches hold both halves of each row's angles (float32), as the torch rotary reads them.
    cos = rope.cos_cache.index_select(0, rope.positions)[:, None, :rope.rotary_dim].float()
    sin = rope.sin_cache.index_select(0, rope.positions)[:, None, :rope.rotary_dim].float()
    return (norm_rope_reference(q, wq, q_norm.eps, cos, sin, out_dtype),
            norm_rope_reference(k, wk, k_norm.eps, cos, sin, out_dtype), v)

