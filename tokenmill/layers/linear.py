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

What a layer computes with is decided once per layer state, not per call (`Linear.rebind`): its
method, its LoRA slots, and for a float32 CPU weight the C kernel, bound into `run` (and
`run_silu_mul` for a [gate | up] projection). The state changes only through `quant_method` /
`lora` (setters), a parameter registered or replaced, `.to()` / `to_empty()` (`_apply`) and a
copy (`__setstate__`): each rebinds. Per call only the input's own shape, dtype and device are
looked at (decode and prefill rows take different kernels).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers import cpu_amx_gemm, cpu_bf16_gemm, cpu_gemm
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


def _use_amx(x: torch.Tensor, weight: torch.Tensor | None, silu_mul: bool = False) -> bool:
    """bf16 on the amx path where `cpu_amx_gemm`'s tiles beat oneDNN's AMX kernels (`takes_bf16`:
    activations up to ~1 MiB, and every size for the fused silu-mul), with the same roundings."""
    return (weight is not None and x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16
            and x.device.type == "cpu" and weight.device.type == "cpu" and weight.dim() == 2
            and not (torch.is_grad_enabled() and weight.requires_grad)
            and cpu_amx_gemm.takes_bf16(x.numel() // x.shape[-1] if x.shape[-1] else 0, x.shape[-1], silu_mul))


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
    if _use_amx(x, weight):
        out = cpu_amx_gemm.gemm(x.reshape(-1, x.shape[-1]), weight, cache.gemm_cache(), bias=bias,
                                mode=cpu_amx_gemm.OUT_BF16)
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
    vdpbf16ps GEMM over the weight with gate and up rows interleaved, the same roundings; on AMX
    CPUs the AMX tile GEMM the same way (`cpu_amx_gemm.takes_bf16`)."""
    if x.dim() == 2 and _use_gemm(x, weight):
        return cpu_bf16_gemm.gemm(x, weight, caches[0].gemm_cache(), bias=bias, mode=cpu_bf16_gemm.OUT_SILU_MUL)
    if x.dim() == 2 and _use_amx(x, weight, silu_mul=True):  # (AMX tiles: the same interleaved packing)
        return cpu_amx_gemm.gemm(x, weight, caches[0].gemm_cache(), bias=bias, mode=cpu_amx_gemm.OUT_SILU_MUL)
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
    computing through its `quant_method`, plus LoRA deltas where slots are attached (`lora`)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._packed = PackedWeight()
        self._silu_packed = (PackedWeight(), PackedWeight())  # `silu_mul_linear`'s halves
        self.__dict__["quant_method"] = UNQUANTIZED
        self.__dict__["lora"] = None  # (read as `__dict__["lora"]` by `lora_layer.has_lora`)
        self.rebind()

    @property
    def quant_method(self) -> LinearMethod:
        return self.__dict__["quant_method"]

    @quant_method.setter
    def quant_method(self, method: LinearMethod) -> None:
        self.__dict__["quant_method"] = method
        self.rebind()

    @property
    def lora(self):
        """The layer's `LoRASlots` (`worker/lora_manager.py`), or None."""
        return self.__dict__["lora"]

    @lora.setter
    def lora(self, slots) -> None:
        self.__dict__["lora"] = slots
        self.rebind()

    def register_parameter(self, name: str, param: nn.Parameter | None) -> None:
        super().register_parameter(name, param)
        if "_packed" in self.__dict__:  # (not during nn.Linear's own __init__)
            self.rebind()

    def _apply(self, fn, recurse: bool = True):
        out = super()._apply(fn, recurse)
        self.rebind()  # new device or dtype: maybe other kernels
        return out

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.rebind()  # (a copy's bound functions would still hold the original's tensors)

    def rebind(self) -> None:
        """Decide, for the layer's state now, the function each call runs (`run`; `run_silu_mul`).
        The only place these decisions are made: see the module docstring for when it runs."""
        base = bind_base(self, self.bias)
        self.run = with_lora(self.__dict__["lora"], base)
        self.run_silu_mul = bind_silu_mul(self, base)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(x)


F32 = torch.float32


def bind_base(layer: Linear, bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> `x @ W.T + bias` through the layer's method (no LoRA): a quantized method's `apply`;
    unquantized, `linear` on the weight, or the C kernel straight for a float32 CPU weight
    (`cpu_f32_run`)."""
    method = layer.quant_method
    if method is not UNQUANTIZED:
        return lambda x: method.apply(layer, x, bias)
    weight, cache = layer.weight, layer._packed
    if cpu_gemm.takes_weight(weight, bias):
        return cpu_f32_run(weight, bias, cache)
    return lambda x: linear(x, weight, bias, cache)


def bind_base_add(layer: Linear, bias: torch.Tensor | None, base: Callable[[torch.Tensor], torch.Tensor]
                  ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """(x, other) -> `base(x) + other`, the add inside the packed matmul where it runs (`linear_add`)."""
    method = layer.quant_method
    if method is not UNQUANTIZED:
        return lambda x, other: method.apply_add(layer, x, bias, other)
    weight, cache = layer.weight, layer._packed
    if not cpu_gemm.takes_weight(weight, bias):
        return lambda x, other: linear_add(x, weight, bias, other, cache)
    max_rows = cpu_gemm.MAX_ROWS

    def add(x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        if x.numel() <= max_rows * x.shape[-1]:  # the C kernel's rows: no fused add there (as `linear_add`)
            return base(x) + other
        return linear_add(x, weight, bias, other, cache)
    return add


def cpu_f32_run(weight: torch.Tensor, bias: torch.Tensor | None, cache: PackedWeight
                ) -> Callable[[torch.Tensor], torch.Tensor]:
    """For a weight `cpu_gemm.takes_weight` accepted: up to MAX_ROWS float32 CPU rows (decode,
    speculative verification) go to the C kernel with no further checks on the weight; anything
    else to `linear`, which decides as always."""
    max_rows = cpu_gemm.MAX_ROWS
    grad_enabled = torch.is_grad_enabled

    def run(x: torch.Tensor) -> torch.Tensor:
        if (x.dtype is F32 and x.is_cpu and 0 < x.numel() <= max_rows * x.shape[-1]
                and not (grad_enabled() and (weight.requires_grad or x.requires_grad))):
            return cpu_gemm.linear(x, weight, bias)
        return linear(x, weight, bias, cache)
    return run


def with_lora(lora, base: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """`base` plus the step's LoRA deltas of `lora` (a `LoRASlots`; None: `base` itself). Decided by
    whether slots are attached, not by whether an adapter is loaded: CUDA graphs are captured with
    the LoRA path before any adapter arrives, and `LoRABatch.active` is the per-step switch (a step
    without adapter tokens runs `base` alone, no closure made)."""
    if lora is None:
        return base
    batch = lora.batch

    def run(x: torch.Tensor) -> torch.Tensor:
        if not batch.active:
            return base(x)
        return lora.forward(x, lambda: base(x))
    return run


def bind_silu_mul(layer: Linear, base: Callable[[torch.Tensor], torch.Tensor]) -> Callable:
    """(x, act, then) -> `act(layer(x))` for a [gate | up] projection whose `act` is SiLU-and-mul,
    `then` the layer its output goes to: with LoRA, `LoRASlots.forward_silu_mul` (fused on CUDA);
    unquantized, the packed path's fused matmuls where they run (`silu_mul_linear`)."""
    lora = layer.__dict__["lora"]
    if lora is not None:
        batch = lora.batch

        def run_lora(x: torch.Tensor, act: Callable, then: nn.Module | None) -> torch.Tensor:
            if not batch.active:
                return act(base(x))
            return lora.forward_silu_mul(x, lambda: base(x), act, None if then is None else then.__dict__.get("lora"))
        return run_lora
    if layer.quant_method is not UNQUANTIZED:
        method = layer.quant_method
        fused = getattr(method, "apply_silu_mul", None)  # (INT4: the product in the GEMV's epilogue)
        if fused is not None:
            return lambda x, act, then: fused(layer, x, layer.bias, act)
        return lambda x, act, then: act(base(x))
    weight, bias, caches = layer.weight, layer.bias, layer._silu_packed
    f32_cpu = cpu_gemm.takes_weight(weight, bias)

    def run(x: torch.Tensor, act: Callable, then: nn.Module | None) -> torch.Tensor:
        if not (f32_cpu and x.numel() <= cpu_gemm.MAX_ROWS * x.shape[-1]):  # (few float32 rows: never fused)
            out = silu_mul_linear(x, weight, bias, caches)
            if out is not None:
                return out
        return act(base(x))
    return run
