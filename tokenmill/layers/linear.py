"""Linear layers whose bfloat16 CPU weights are pre-packed for oneDNN.

`F.linear` on a bfloat16 CPU tensor re-lays the weight out for the AMX /
AVX512-BF16 kernels on every call; for decode-sized inputs that copy costs
about as much as the math. Here the weight is packed once (`mkldnn`'s
`_reorder_linear_weight`) and reused: decode linears run ~30% faster and the
LM head ~45%. oneDNN also fuses elementwise work into the matmul: SiLU-and-multiply
of the MLP (`silu_mul_linear`) and residual adds (`linear_add`). The packed copy is rebuilt whenever the parameter changes (its
storage or version), so loading or re-initializing weights needs no hook.
It costs one extra copy of the packed weights in memory.

float32 CPU inputs of 1 to 8 rows (decode, and speculative verification: 1 + k tokens per
step) go to a small C kernel (`cpu_gemm.py`) that reads the weight once for all rows, so
verifying k drafts costs about what decoding one token does, and each row's result is the same
bit for bit at any row count. 9 to 32 rows take the packed oneDNN path (MKL's float32 GEMM
at a few rows is several times slower than its one-row GEMV on the AMD CPUs measured,
docs/results/spec-decode.md); many rows stay on `F.linear`. Without the C kernel, 2 to 32 rows
go to oneDNN and one row to `F.linear`.

Anywhere else (GPUs, no oneDNN, or if packing ever fails) it is plain `F.linear`.

Every `Linear` computes through its `quant_method` (`tokenmill.layers.quantization.base`):
`UNQUANTIZED` (all of the above) unless a quantized format's method was attached after the
model was built; such a layer's `weight` is None and its own parameters replace it.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers import cpu_bf16_gemm, cpu_gemm
from tokenmill.layers.quantization.base import LinearMethod

logger = logging.getLogger(__name__)

_PACK_BATCH_HINT = 64
_PACKING_BUILT = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class PackedWeight:
    """The packed form of one weight tensor, kept in step with it. `usable` turns False for good
    once packing failed for this weight (an unsupported build or shape)."""

    __slots__ = ("key", "packed", "usable", "gemm")

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.packed: torch.Tensor | None = None
        self.usable = _PACKING_BUILT
        self.gemm: cpu_bf16_gemm.PackedBf16 | None = None  # the vdpbf16ps GEMM's packing (`_use_gemm`)

    def gemm_cache(self) -> cpu_bf16_gemm.PackedBf16:
        if self.gemm is None:
            self.gemm = cpu_bf16_gemm.PackedBf16()
        return self.gemm

    def disable(self, exc: RuntimeError) -> None:
        logger.warning("packed bfloat16 linear unavailable, using F.linear: %s", exc)
        self.usable = False

    def get(self, weight: torch.Tensor) -> torch.Tensor:
        key = (weight.data_ptr(), weight._version, tuple(weight.shape))
        if key != self.key:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_BATCH_HINT)
            self.key = key
        return self.packed


def _use_gemm(x: torch.Tensor, weight: torch.Tensor | None) -> bool:
    """bf16 on an AVX512-BF16 CPU without AMX: the packed vdpbf16ps GEMM of `cpu_bf16_gemm`
    (bf16 result, float32 accumulation: oneDNN's numerics) instead of oneDNN, whose bf16 GEMV
    there costs ~2x its CPU time at one row and ~1.05-1.1x at 64-512 rows (measured on Zen 4)."""
    return (weight is not None and x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16
            and x.device.type == "cpu" and weight.device.type == "cpu" and weight.dim() == 2
            and not (torch.is_grad_enabled() and weight.requires_grad) and cpu_bf16_gemm.replaces_onednn())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cache: PackedWeight) -> torch.Tensor:
    if x.is_cuda and x.numel() == x.shape[-1]:  # one row on a GPU: the Triton GEMV where it beats cuBLAS
        from tokenmill.layers.triton_ops import gemv
        if gemv.applies(x, weight, bias):
            return gemv.gemv(x, weight, bias)
    if cpu_gemm.supports(x, weight, bias):
        return cpu_gemm.linear(x, weight, bias)
    if _use_gemm(x, weight):
        out = cpu_bf16_gemm.gemm(x.reshape(-1, x.shape[-1]), weight, cache.gemm_cache(), bias=bias,
                                 mode=cpu_bf16_gemm.OUT_BF16)
        return out.view(*x.shape[:-1], weight.shape[0])
    if _use_packed(x, weight, cache):
        try:
            x2 = x.reshape(-1, x.shape[-1])
            out = torch.ops.mkldnn._linear_pointwise(x2, cache.get(weight), bias, "none", [], "")
            return out.view(*x.shape[:-1], weight.shape[0])
        except RuntimeError as exc:  # an unsupported build or shape: never try again
            cache.disable(exc)
    return F.linear(x, weight, bias)


_FEW_ROWS = (2, 32)  # float32 inputs with this many rows (inclusive) use the packed path


def _use_packed(x: torch.Tensor, weight: torch.Tensor, cache: PackedWeight) -> bool:
    if not (cache.usable and x.dtype == weight.dtype and x.device.type == "cpu" and weight.device.type == "cpu"
            and not (torch.is_grad_enabled() and weight.requires_grad)):
        return False
    if x.dtype == torch.bfloat16:
        return True
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if x.dtype != torch.float32 or not _FEW_ROWS[0] <= rows <= _FEW_ROWS[1]:
        return False
    return rows > cpu_gemm.MAX_ROWS or not cpu_gemm.available()  # fewer rows: cpu_gemm


def linear_add(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, other: torch.Tensor,
               cache: PackedWeight) -> torch.Tensor:
    """`F.linear(x, weight, bias) + other`; on the packed path the add runs inside the matmul."""
    if _use_packed(x, weight, cache) and other.dtype == x.dtype and x.dim() == 2 and other.is_contiguous():
        try:
            return torch.ops.mkldnn._linear_pointwise.binary(x, other, cache.get(weight), bias, "add")
        except RuntimeError as exc:
            cache.disable(exc)
    return linear(x, weight, bias, cache) + other


def silu_mul_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    caches: tuple[PackedWeight, PackedWeight]) -> torch.Tensor | None:
    """`silu(gate) * up` of `F.linear(x, weight, bias)` split in halves [gate | up], as two matmuls
    with the activation and the product done inside them; None where the packed path is off
    (or the layer is quantized: `weight` None). On AVX512-BF16 CPUs without AMX: one pass of the
    vdpbf16ps GEMM over the weight with gate and up rows interleaved, the same roundings."""
    if x.dim() == 2 and _use_gemm(x, weight):
        return cpu_bf16_gemm.gemm(x, weight, caches[0].gemm_cache(), bias=bias, mode=cpu_bf16_gemm.OUT_SILU_MUL)
    if weight is None or not (_use_packed(x, weight, caches[0]) and caches[1].usable and x.dim() == 2):
        return None
    half = weight.shape[0] // 2
    try:
        gate = torch.ops.mkldnn._linear_pointwise(
            x, caches[0].get(weight[:half]), None if bias is None else bias[:half], "swish", [], "")
        return torch.ops.mkldnn._linear_pointwise.binary(
            x, gate, caches[1].get(weight[half:]), None if bias is None else bias[half:], "mul")
    except RuntimeError as exc:
        caches[0].disable(exc)
        return None


class UnquantizedLinearMethod(LinearMethod):
    """The float weight as it is, through the fast paths above."""

    quantized = False

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return linear(x, layer.weight, bias, layer._packed)

    def apply_add(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
                  other: torch.Tensor) -> torch.Tensor:
        return linear_add(x, layer.weight, bias, other, layer._packed)

    def describe(self) -> str:
        return "unquantized"


UNQUANTIZED = UnquantizedLinearMethod()


class Linear(nn.Linear):
    """`nn.Linear` (same parameters and state dict) with the packed CPU bfloat16 fast path,
    computing through its `quant_method`."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._packed = PackedWeight()
        self.quant_method: LinearMethod = UNQUANTIZED

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)
