"""FP8 W8A8 linear methods: weights in e4m3 with float32 scales, activations quantized per token
(or per token and 128 columns) at run time.

- `Fp8LinearMethod`: one scale per output channel. Checkpoints: fbgemm_fp8 and compressed-tensors
  channel ([N, 1] `weight_scale`), fp8 / compressed-tensors tensor (one scale per checkpoint
  tensor, spread over its rows: a fused q/k/v keeps each part's own). Online: a float weight
  quantized at load. CUDA: `torch._scaled_mm` with row-wise scales (activations: one Triton
  kernel per call). Up to `stream_tiles.FP8_STREAM_MAX_ROWS` rows (decode) the Triton
  weight-streaming kernel runs instead (`triton_fp8_stream`): activations stay in bf16, so no
  quantization launch, and only the weight is rounded.
- `Fp8BlockLinearMethod`: one scale per [bn, bk] weight tile (`weight_scale_inv`), activations
  per (token, bk columns); CUDA: the Triton block GEMM (small batches: the streaming kernel).
Elsewhere (CPU, shapes _scaled_mm refuses) both dequantize the weight for each call and
round the activations as the GPU would, then run the float matmul: correct, not fast.
"""

from __future__ import annotations

import logging
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.quantization import fp8_ops, stream_tiles
from tokenmill.layers.quantization.base import LinearMethod, ParamLayout, new_param, replace_param

logger = logging.getLogger(__name__)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


_WARNED: set[str] = set()


def _warn_slow_path(reason: str) -> None:
    """Once per reason: a CUDA fp8 layer that runs the dequantize-per-call emulation is correct
    but far slower than bf16, so it must never pass unnoticed in a benchmark."""
    if reason not in _WARNED:
        _WARNED.add(reason)
        logger.warning("fp8 W8A8 SLOW PATH on CUDA (dequantizing the weight on every call): %s", reason)


def _streams(layer: nn.Module, x: torch.Tensor) -> bool:
    """Whether this call takes the weight-streaming kernel (CUDA with fp8 conversions, few rows)."""
    rows = x.numel() // max(x.shape[-1], 1)
    return getattr(layer, "stream_counters", None) is not None and rows <= stream_tiles.FP8_STREAM_MAX_ROWS


def _stream(layer: nn.Module, x: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
            bias: torch.Tensor | None, silu_x: bool = False) -> torch.Tensor:
    from tokenmill.layers.quantization.triton_fp8_stream import fp8_stream_gemm

    out = fp8_stream_gemm(_rows(x), layer.weight, scale, block, layer.stream_counters.tensor, silu_x=silu_x)
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], out.shape[-1])


def _w8a8_mm(layer: nn.Module, xq: torch.Tensor, xs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """xq * xs @ (weight * scale)^T by the GEMM `stream_tiles.w8a8_path` names for this size:
    row-wise `torch._scaled_mm`, tensor-wise `_scaled_mm` (scales 1) then one scaling pass, or
    the Triton fp8 GEMM with both scales in its epilogue (`triton_fp8_gemm`)."""
    m, k = xq.shape
    n = layer.weight.shape[0]
    path, tiles = stream_tiles.w8a8_path(m, n, k)
    if path == "triton":
        from tokenmill.layers.quantization.triton_fp8_gemm import fp8_gemm

        counters = getattr(layer, "stream_counters", None)
        return fp8_gemm(xq, xs, layer.weight, layer.weight_scale, dtype, *tiles,
                        counters=None if counters is None else counters.tensor)
    if path == "tensorwise":
        one = layer.scale_one
        return torch._scaled_mm(xq, layer.weight.t(), scale_a=one, scale_b=one, out_dtype=dtype).mul_(
            xs * layer.scale_row)
    return torch._scaled_mm(xq, layer.weight.t(), scale_a=xs, scale_b=layer.scale_row, out_dtype=dtype)


def _stream_counters(q: torch.Tensor) -> stream_tiles.SplitCounters | None:
    """The split-K counters of a layer that can stream (Triton's fp8 conversions need 8.9+)."""
    if not q.is_cuda or torch.cuda.get_device_capability(q.device) < (8, 9):
        return None
    return stream_tiles.SplitCounters(q.shape[0], q.device)


def _scaled_mm_refusal(q: torch.Tensor) -> str | None:
    """Why torch._scaled_mm with row-wise scales cannot run this weight (None: it can)."""
    n, k = q.shape
    if torch.cuda.get_device_capability(q.device) < (8, 9):
        return f"{torch.cuda.get_device_name(q.device)} has no fp8 tensor cores (needs compute capability 8.9+)"
    if n % 16 or k % 16:
        return f"a {n}x{k} weight (torch._scaled_mm needs both sizes multiples of 16)"
    return None


class Fp8LinearMethod(LinearMethod):
    ignored_suffixes = ("input_scale", "input_scale_ub")

    def __init__(self, online: bool) -> None:
        self.online = online

    def create_weights(self, layer: nn.Module) -> None:
        if self.online:
            return  # the float weight loads as it is, and is quantized after
        n, k = layer.out_features, layer.in_features
        replace_param(layer, "weight", None)
        new_param(layer, "weight", (n, k), fp8_ops.FP8, ParamLayout(0, 1, 1, 1))
        new_param(layer, "weight_scale", (n, 1), torch.float32, ParamLayout(0, 1, None, 0, scalar_ok=True))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.online:
            q, scale = fp8_ops.quantize_weight_rows(layer.weight.data)
        else:
            q, scale = layer.weight.data, layer.weight_scale.data.float()
        replace_param(layer, "weight", q.contiguous())
        replace_param(layer, "weight_scale", scale.reshape(-1, 1).contiguous())
        # _scaled_mm wants the weight column-major ([K, N] view of [N, K]) and scales [1, N].
        layer.scale_row = scale.reshape(1, -1).contiguous()
        layer.scale_one = torch.ones((), dtype=torch.float32, device=q.device)  # tensor-wise _scaled_mm
        refusal = _scaled_mm_refusal(q) if q.is_cuda else "not on CUDA"
        layer.use_scaled_mm = refusal is None
        layer.stream_counters = _stream_counters(q)
        if q.is_cuda and refusal is not None:
            _warn_slow_path(refusal)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if getattr(x, _SILU_PENDING, False):  # x is [gate | up]: SiLU-and-mul happens in the GEMV (`defer_silu`)
            return _stream(layer, x, layer.weight_scale, None, bias, silu_x=True)
        if _streams(layer, x):
            return _stream(layer, x, layer.weight_scale, None, bias)
        # Row-wise scaled_mm writes bfloat16 only (CUTLASS's row-wise kernels).
        if layer.use_scaled_mm and x.dtype != torch.bfloat16:
            _warn_slow_path(f"activations in {x.dtype} (row-wise torch._scaled_mm writes bfloat16 only)")
        elif layer.use_scaled_mm:
            from tokenmill.layers.quantization.triton_fp8 import quantize_row_groups

            x2 = _rows(x)
            codes = fp8_ops.attached(x)  # quantized by the kernel that wrote x (`triton_fp8_fused`)
            xq, xs = codes if codes is not None else quantize_row_groups(x2, x2.shape[1])
            out = _w8a8_mm(layer, xq, xs, x.dtype)
            if bias is not None:
                out = out + bias
            return out.view(*x.shape[:-1], out.shape[-1])
        w = (layer.weight.float() * layer.weight_scale).to(x.dtype)
        return F.linear(fp8_ops.fake_quantize_rows(x), w, bias)

    def describe(self) -> str:
        return "fp8 W8A8 (per-channel weights, MSE-chosen scales when quantized online; per-token activations)"


class Fp8BlockLinearMethod(LinearMethod):
    ignored_suffixes = ("input_scale",)

    def __init__(self, block: tuple[int, int], online: bool) -> None:
        self.block = (int(block[0]), int(block[1]))
        self.online = online

    def create_weights(self, layer: nn.Module) -> None:
        n, k = layer.out_features, layer.in_features
        bn, bk = self.block
        if k % bk:
            raise ValueError(f"fp8 block quantization: in_features {k} is not a multiple of the block's {bk} "
                             f"columns (weight_block_size {list(self.block)})")
        if self.online:
            return
        replace_param(layer, "weight", None)
        new_param(layer, "weight", (n, k), fp8_ops.FP8, ParamLayout(0, 1, 1, 1))
        new_param(layer, "weight_scale_inv", (-(-n // bn), k // bk), torch.float32, ParamLayout(0, bn, 1, bk))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.online:
            q, scale = fp8_ops.quantize_blocks(layer.weight.data, self.block)
        else:
            q, scale = layer.weight.data, layer.weight_scale_inv.data.float()
        replace_param(layer, "weight", q.contiguous())
        replace_param(layer, "weight_scale_inv", scale.contiguous())
        layer.stream_counters = _stream_counters(q)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        bn, bk = self.block
        if _streams(layer, x) and stream_tiles.streams_blocks(self.block):
            return _stream(layer, x, layer.weight_scale_inv, self.block, bias)
        if layer.weight.is_cuda:
            from tokenmill.layers.quantization.triton_fp8 import block_fp8_gemm, quantize_row_groups

            x2 = _rows(x)
            xq, xs = quantize_row_groups(x2, bk)
            out = block_fp8_gemm(xq, xs, layer.weight, layer.weight_scale_inv, self.block, x.dtype)
            if bias is not None:
                out = out + bias
            return out.view(*x.shape[:-1], out.shape[-1])
        w = fp8_ops.dequantize_blocks(layer.weight, layer.weight_scale_inv, self.block, x.dtype)
        return F.linear(fp8_ops.fake_quantize_row_groups(x, bk), w, bias)

    def describe(self) -> str:
        return f"fp8 W8A8 ({self.block[0]}x{self.block[1]} weight blocks, per-token-group activations)"


# ---------------------------------------------------------------- fused activation quantization

# Whether SiLU-and-mul quantizes down_proj's input in the same pass
# (`triton_fp8_fused.silu_and_mul_quant`, rows of up to SILU_QUANT_MAX_COLS), instead of the
# down_proj's own quantization launch re-reading the activation.
FUSE_SILU_QUANT = True
SILU_QUANT_MAX_COLS = 16384


# Whether SiLU-and-mul leaves its product to down_proj's fp8 weight-streaming GEMV at small
# batches (`defer_silu`): one launch and one round trip of the activation less per layer.
FUSE_SILU_GEMV = True
_SILU_PENDING = "_fp8_silu_pending"


def _streams_silu(layer: nn.Module | None) -> bool:
    """Whether this linear can take a deferred SiLU-and-mul: channel-scale fp8 with the streaming kernel."""
    return (layer is not None and isinstance(getattr(layer, "quant_method", None), Fp8LinearMethod)
            and getattr(layer, "stream_counters", None) is not None)


def defer_silu(producer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """For a marked SiLU-and-mul (`mark_fused_producers`): where its consumer takes this call with the
    streaming GEMV (few rows, no LoRA), a new view of `x` itself ([.., 2d], gate | up) flagged so
    that the consumer's GEMV computes silu(gate) * up in its loads; else None (compute it here).
    Only the flagged tensor object carries the flag, and its width (2d) fails any other consumer."""
    ref = producer.__dict__.get("_fp8_consumer")
    consumer = ref() if ref is not None else None
    if not FUSE_SILU_GEMV or consumer is None or "lora" in consumer.__dict__ and consumer.__dict__["lora"] is not None:
        return None
    if x.dim() != 2 or x.stride(-1) != 1 or x.shape[-1] != 2 * consumer.in_features or not _streams(consumer, x):
        return None
    out = x.view(x.shape)
    setattr(out, _SILU_PENDING, True)
    return out


def _takes_fused_codes(layer: nn.Module | None) -> bool:
    """Whether this linear quantizes its input per token for row-wise _scaled_mm (so a producer's
    attached codes save it a launch)."""
    return (layer is not None and isinstance(getattr(layer, "quant_method", None), Fp8LinearMethod)
            and bool(getattr(layer, "use_scaled_mm", False)))


def mark_fused_producers(model: nn.Module) -> int:
    """Let the kernels that write a W8A8 linear's input quantize it too: a decoder layer's
    input_layernorm (-> qkv_proj), post_attention_layernorm (-> gate_up_proj), found by their
    HF names, and its MLP's SiLU-and-mul (`mlp.act` -> down_proj) when FUSE_SILU_QUANT; and let
    that SiLU-and-mul defer to down_proj's streaming GEMV at small batches (`defer_silu`).
    Returns how many were marked."""
    from tokenmill.layers.activation import SiluAndMul
    from tokenmill.layers.norm import RMSNorm

    marked = 0
    for module in model.modules():
        attn, mlp = getattr(module, "self_attn", None), getattr(module, "mlp", None)
        pairs = [(getattr(module, "input_layernorm", None), getattr(attn, "qkv_proj", None), RMSNorm),
                 (getattr(module, "post_attention_layernorm", None), getattr(mlp, "gate_up_proj", None), RMSNorm)]
        if FUSE_SILU_QUANT:
            pairs.append((getattr(mlp, "act", None), getattr(mlp, "down_proj", None), SiluAndMul))
        for producer, consumer, kind in pairs:
            if type(producer) is kind and _takes_fused_codes(consumer):
                producer.fp8_out = True
                marked += 1
        act, down = getattr(mlp, "act", None), getattr(mlp, "down_proj", None)
        if type(act) is SiluAndMul and _streams_silu(down):
            act.fp8_defer = True
            act._fp8_consumer = weakref.ref(down)
            marked += 1
    return marked


def fused_codes_wanted(producer: nn.Module, x: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """Whether a marked producer writes codes for this call: CUDA, a bf16 output (row-wise
    _scaled_mm's), 2-D, and more rows than the streaming kernel takes (it reads bf16)."""
    return (getattr(producer, "fp8_out", False) and x.is_cuda and out_dtype == torch.bfloat16 and x.dim() == 2
            and x.shape[0] > stream_tiles.FP8_STREAM_MAX_ROWS and x.shape[-1] <= 2 * SILU_QUANT_MAX_COLS)
