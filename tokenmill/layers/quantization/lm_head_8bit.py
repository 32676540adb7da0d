"""An 8-bit copy of the LM head for small batches (decode) of an fp8 or INT4 model on CUDA.

At batch 1 the LM head of a Llama-3.1-8B shape is 1 GB of bf16 read per token, a tenth of an
fp8 step (405 us of an H100's ~4 ms). An fp8 W8A8 model (`Fp8LinearMethod` linears) on a GPU
with fp8 conversions (compute capability 8.9+) also keeps the head's rows in 8 bits
(TOKENMILL_LM_HEAD_8BIT: int8, the default; fp8; off) with one float32 scale per vocab row, and
steps of up to `stream_tiles.FP8_STREAM_MAX_ROWS` rows take their float32 logits from the weight-streaming GEMV (`triton_fp8_stream`, which
converts int8 or e4m3 weights alike; bf16 activations: only the weight is rounded). Larger steps
(prefill, prompt logprobs, large decode batches) keep the bf16 head.
- int8: round to nearest of w / scale in [-127, 127], the scale the shrink of the row's amax / 127
  with the least squared error. Uniform steps: on SmolLM2 the head alone moves NLL by -0.05%,
  and with the W8A8 linears NLL is +0.31% (+0.39% with the bf16 head): within noise, so it is
  the default (vLLM keeps the head in bf16; TOKENMILL_LM_HEAD_8BIT=off does too).
- fp8 (e4m3, MSE-chosen scales as the online weights): +0.66% NLL on SmolLM2 alone, +1.05% with
  the W8A8 linears, over the issue's 1% (docs/results/cpu-fp8-nll-smollm2.md); never by default.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.layers.quantization import fp8_ops, stream_tiles

ENV_VAR = "TOKENMILL_LM_HEAD_8BIT"
KINDS = ("int8", "fp8")
FORCE: str | None = None  # a kind, or "off"; None: the environment decides (benchmarks set it before an engine)
INT8_SHRINKS = tuple(round(0.5 + 0.0125 * i, 4) for i in range(41))  # 0.5 .. 1.0


def wanted() -> str | None:
    """The kind of 8-bit head asked for, or None."""
    value = (FORCE if FORCE is not None else os.environ.get(ENV_VAR, "int8")).lower()
    if value in ("", "0", "off", "no", "false"):
        return None
    if value not in KINDS:
        raise ValueError(f"{ENV_VAR}={value!r}: not a kind of 8-bit LM head; supported: {', '.join(KINDS)} (or off)")
    return value


@dataclass
class Head8Bit:
    """The head's rows (this rank's vocab shard) in int8 or e4m3, their scales and split-K counters."""

    weight: torch.Tensor  # [V, H] int8 or float8_e4m3fn
    scale: torch.Tensor  # [V, 1] float32
    counters: stream_tiles.SplitCounters

    def takes(self, hidden: torch.Tensor) -> bool:
        rows = hidden.numel() // max(hidden.shape[-1], 1)
        return hidden.is_cuda and hidden.dtype in (torch.bfloat16, torch.float16) and \
            rows <= stream_tiles.FP8_STREAM_MAX_ROWS

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [rows, V] of this rank's vocab rows."""
        from tokenmill.layers.quantization.triton_fp8_stream import fp8_stream_gemm

        h = hidden.reshape(-1, hidden.shape[-1])
        out = fp8_stream_gemm(h, self.weight, self.scale, None, self.counters.tensor, out_dtype=torch.float32)
        return out.view(*hidden.shape[:-1], out.shape[-1])


def quantize_int8_rows(w: torch.Tensor, shrinks: tuple[float, ...] = INT8_SHRINKS,
                       rows_per_chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row int8 with MSE-chosen scales: (int8 [N, K] in [-127, 127], float32 scales [N, 1])."""
    qs, ss = [], []
    for chunk in w.split(rows_per_chunk):
        wf = chunk.float()
        amax = wf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12)
        best_scale, best_err = None, None
        for shrink in shrinks:
            scale = amax * (shrink / 127.0)
            err = ((wf / scale).round().clamp(-127, 127) * scale - wf).square().sum(dim=-1, keepdim=True)
            if best_err is None:
                best_scale, best_err = scale, err
            else:
                better = err < best_err
                best_scale, best_err = torch.where(better, scale, best_scale), torch.minimum(err, best_err)
        qs.append((wf / best_scale).round().clamp(-127, 127).to(torch.int8))
        ss.append(best_scale)
    return torch.cat(qs), torch.cat(ss)


def quantize_head(weight: torch.Tensor, kind: str = "int8") -> Head8Bit:
    q, scale = quantize_int8_rows(weight) if kind == "int8" else fp8_ops.quantize_weight_rows(weight)
    return Head8Bit(q.contiguous(), scale.contiguous(), stream_tiles.SplitCounters(q.shape[0], q.device))


def has_quantized_linears(model: nn.Module) -> bool:
    """Whether the model's linears are fp8 W8A8 or INT4 W4A16: weight-streaming models whose batch-1
    step the bf16 head would weigh on (an INT4 Llama-8B's head is a quarter of its bytes)."""
    from tokenmill.layers.linear import Linear
    from tokenmill.layers.quantization.fp8 import Fp8LinearMethod
    from tokenmill.layers.quantization.int4 import Int4LinearMethod

    return any(isinstance(m, Linear) and isinstance(m.quant_method, (Fp8LinearMethod, Int4LinearMethod))
               for m in model.modules())


def attach(model: nn.Module) -> bool:
    """Give an fp8 or INT4 model's LM head (`model.logits_head`) its 8-bit copy where asked for and possible.
    The copy is also registered as buffers of the module owning the head's weight, so the model's
    weight bytes (and the KV pool sized after them) count it. Returns whether it attached."""
    head = getattr(model, "logits_head", None)
    if head is None or not getattr(getattr(model, "layout", None), "is_last_stage", True):
        return False  # (a pipeline stage without the head; a first stage's tied embedding is no head)
    if not has_quantized_linears(model):
        return False
    kind = wanted()
    if kind is None:
        return False
    owner = getattr(model, "lm_head", None)
    if owner is None:
        owner = getattr(getattr(model, "model", None), "embed_tokens", None)
    weight = getattr(owner, "weight", None)
    if weight is None or not weight.is_cuda or torch.cuda.get_device_capability(weight.device) < (8, 9):
        return False
    with torch.no_grad():
        q = quantize_head(weight.data, kind)
    owner.register_buffer("head_8bit_weight", q.weight, persistent=False)
    owner.register_buffer("head_8bit_scale", q.scale, persistent=False)
    head.head_8bit = q
    return True
