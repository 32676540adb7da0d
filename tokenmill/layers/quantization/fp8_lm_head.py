"""An fp8 copy of the LM head for small batches (decode) of an fp8 model on CUDA (opt-in).

At batch 1 the LM head of a Llama-3.1-8B shape is 1 GB of bf16 read per token, about a tenth
of an fp8 step. With TOKENMILL_FP8_LM_HEAD=1, an fp8 W8A8 model (`Fp8LinearMethod` linears) on
a GPU with fp8 conversions (compute capability 8.9+) also keeps the head's rows in e4m3 with one
float32 scale per vocab row (MSE-chosen, as the online weights), and steps of up to
`stream_tiles.FP8_STREAM_MAX_ROWS` rows take their float32 logits from the weight-streaming
GEMV (`triton_fp8_stream`, bf16 activations: only the weight is rounded). Larger steps
(prefill, prompt logprobs, large decode batches) keep the bf16 head. Off by default: vLLM and
the FP8 checkpoints keep the head in bf16, and on the real SmolLM2 the rounded head alone costs
+0.66% NLL, +1.05% with the W8A8 linears (over the issue's 1%; docs/results/cpu-fp8-nll-smollm2.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.layers.quantization import fp8_ops, stream_tiles

ENV_VAR = "TOKENMILL_FP8_LM_HEAD"
FORCE: bool | None = None  # None: the environment decides (a benchmark sets it before building an engine)


def wanted() -> bool:
    if FORCE is not None:
        return FORCE
    return os.environ.get(ENV_VAR, "0").lower() in ("1", "true", "yes")


@dataclass
class Fp8Head:
    """The head's rows (this rank's vocab shard) in e4m3, their scales and split-K counters."""

    weight: torch.Tensor  # [V, H] float8_e4m3fn
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


def quantize_head(weight: torch.Tensor) -> Fp8Head:
    q, scale = fp8_ops.quantize_weight_rows(weight)
    return Fp8Head(q.contiguous(), scale.contiguous(), stream_tiles.SplitCounters(q.shape[0], q.device))


def attach(model: nn.Module) -> bool:
    """Give an fp8 model's LM head (`model.logits_head`) its fp8 copy where wanted and possible.
    The copy is also registered as buffers of the module owning the head's weight, so the model's
    weight bytes (and the KV pool sized after them) count it. Returns whether it attached."""
    from tokenmill.layers.linear import Linear
    from tokenmill.layers.quantization.fp8 import Fp8LinearMethod

    head = getattr(model, "logits_head", None) if wanted() else None
    if head is None:
        return False
    if not any(isinstance(m, Linear) and isinstance(m.quant_method, Fp8LinearMethod) for m in model.modules()):
        return False
    owner = getattr(model, "lm_head", None)
    if owner is None:
        owner = getattr(getattr(model, "model", None), "embed_tokens", None)
    weight = getattr(owner, "weight", None)
    if weight is None or not weight.is_cuda or torch.cuda.get_device_capability(weight.device) < (8, 9):
        return False
    with torch.no_grad():
        fp8 = quantize_head(weight.data)
    owner.register_buffer("fp8_head_weight", fp8.weight, persistent=False)
    owner.register_buffer("fp8_head_scale", fp8.scale, persistent=False)
    head.fp8 = fp8
    return True
