"""bfloat16 linears with a float32 result on CPU: for the sublayer outputs that join the float32
residual stream (o_proj, down_proj), so they are not rounded to bf16 on the way in.

Why: on SmolLM2 the first token's down_proj writes ~22,000 into one channel of the stream, where a
bf16 step is 128; rounding that output puts an error of up to 64 into the stream that every later
layer's norm reads (the channel dominates the row's RMS). HF rounds it too (and the stream after
it); keeping it float32 is what makes tokenmill's bf16 as least as close to float32 as HF's on such
tokens (docs/bf16-numerics.md).

How, with bf16 inputs and weights (each product exact in float32, sums in float32), and the
residual stream's add (`add`) in the kernel's epilogue where the caller passes it:
- on AMX machines from `cpu_amx_gemm.F32_MIN_ROWS` rows (1): the AMX tile GEMM of `cpu_amx_gemm`
  (~5x the vdpbf16ps GEMM's speed at prefill sizes there, ~1.7x the two-matmul split below);
- on AVX512-BF16 machines (and AMX ones below that row count): the packed GEMM of `cpu_bf16_gemm` (the same
  packed weight; about oneDNN's bf16 time on AVX512-BF16, where the split below cost ~2.2x);
- elsewhere, up to `FEW_ROWS` rows (decode, speculative verification): the LM head's C kernel
  (`cpu_logits.linear_f32`), which reads the weight once for all rows;
- more rows (prefill): oneDNN's bf16 matmul twice, the second one's epilogue subtracting the first
  result inside the float32 accumulator: y = hi + lo with hi = bf16(W x) and lo = bf16(W x - hi),
  so the error is bf16's on `lo` (~2^-9 of 2^-9 of y), float32-like at AMX / AVX512-BF16 speed
  (without oneDNN: a float32 matmul of the widened inputs).
"""

from __future__ import annotations

import torch

from tokenmill.layers import cpu_amx_gemm, cpu_bf16_gemm, cpu_logits
from tokenmill.layers.linear import PackedWeight, _use_packed, linear, linear_add

FEW_ROWS = 32


def supports(x: torch.Tensor, weight: torch.Tensor | None) -> bool:
    return weight is not None and x.dim() == 2 and cpu_logits.supports(x, weight)


def supports_dtype(x: torch.Tensor, weight: torch.Tensor | None) -> bool:
    """`supports` for an input like `x` of the weight's width (a layer deciding ahead)."""
    return weight is not None and x.dim() == 2 and weight.dim() == 2 and \
        cpu_logits.supports(x.new_empty((0, weight.shape[1])), weight)


def takes_weight(weight: torch.Tensor | None) -> bool:
    """`supports_dtype`'s checks on the weight alone (a layer binding its forward once): bf16, 2-D,
    contiguous, on CPU, with the C kernel built. Per call the input must still be bf16, 2-D, CPU."""
    return (weight is not None and weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
            and weight.dim() == 2 and weight.is_contiguous() and cpu_logits.available())


def linear_f32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               cache: PackedWeight, gemm_cache: cpu_bf16_gemm.PackedBf16 | None = None,
               add: torch.Tensor | None = None) -> torch.Tensor:
    """float32 `add + x @ weight.T + bias` of bf16 x [M, K] and weight [N, K] (inputs `supports`
    accepts; `add` float32 [M, N] or None)."""
    if bias is not None and add is not None:  # bias first, as the unfused add would
        return linear_f32(x, weight, bias, cache, gemm_cache).add_(add)
    if gemm_cache is not None and cpu_amx_gemm.takes_f32(x.shape[0]):
        out = cpu_amx_gemm.gemm(x, weight, gemm_cache, add=add)
        add = None
    elif gemm_cache is not None and cpu_bf16_gemm.available():
        out = cpu_bf16_gemm.gemm_f32(x, weight, gemm_cache, add)
        add = None
    elif x.shape[0] <= FEW_ROWS:
        out = cpu_logits.linear_f32(x, weight, add=add)
        add = None
    elif not _use_packed(x, weight, cache):  # no oneDNN epilogue: plain float32 (slow, exact products)
        out = torch.nn.functional.linear(x.float(), weight.float())
    else:
        hi = linear(x, weight, None, cache)
        lo = linear_add(x, weight, None, hi.neg(), cache)
        out = hi.float().add_(lo.float())
    if add is not None:
        out = add + out
    return out if bias is None else out.add_(bias.float())
