"""INT4 decode at up to 8 rows: a Llama layer's RMSNorms and residual adds folded into its GEMVs.

Why: at batch 1 each norm is a kernel of its own between two GEMVs (~1.8 us a step each on an
H100 under PDL, 64 a step: ~115 us of a 2.6 ms token), mostly the chain's latency, not its bytes.
The layer returns (stream, None), the stream form `LlamaDecoderLayer` already hands on where adds
run in matmuls; o_proj and down_proj (split-K launches) add their result into the float32 stream
in their epilogue (`mma_gemv(add_to=stream)`: rounded to the activation dtype, then added in
float32, as the fused add + norm kernel did) and write each channel block's sums of squares of the
new rows (`sumsq`). The norm before qkv_proj / gate_up_proj then runs, by TOKENMILL_INT4_NORM_FOLD:
- scale (1): the add also writes y = stream * the next norm's weight (rounded); the GEMV reads y
  and multiplies each row's float32 result by rstd (from the sums of squares) in its split-K
  epilogue (RSTD): the normalized input rounded once where the norm kernel rounds it twice. A
  layer whose input comes from no folded add (the first) runs the norm kernel before its qkv.
- prologue: each GEMV CTA normalizes the slice of K it reads into scratch first (NORM; the
  rstd from the sums of squares), with the norm kernel's roundings;
- row: as prologue, the rstd from a pass over the whole row (no sums handed on);
- 0: off (the norm kernels).
The default is scale (1): on one H100 it took 96 us off a 2.54 ms token (session 9's final round).
H200, session 9 round 1: prologue / row cost the GEMVs more than the norms they replace (qkv
+100, gate_up +176 us a step: every CTA writes and reads its normalized slice); scale keeps
the GEMVs' loads as they are. What each mode gives: `scripts/gpu_int4_b1.py` (int4nofold /
int4scale / int4fold). Values: the unfused path's up to the float32 order of the sum of squares
(and, scaled, the one rounding); `tests/layers/test_int4_norm_fold.py`.

Where: CUDA, <= 8 rows, every linear of the layer INT4 in the mma layout without bias or LoRA,
gate_up paired (`int4.pair_gate_up`), o_proj and down_proj split-K (scale: qkv and gate_up too;
bf16 activations: y is not normalized), no TP, plain `RMSNorm`s, no q/k norm; the device
self-test passed (`selftest`).
"""

from __future__ import annotations

import logging
import os
from typing import NamedTuple

import torch
from torch import nn

from tokenmill.layers.quantization import int4_packing as packing

logger = logging.getLogger(__name__)

ENV_VAR = "TOKENMILL_INT4_NORM_FOLD"
MODES = {"0": "off", "1": "scale", "scale": "scale", "prologue": "prologue", "row": "row"}
DEFAULT = "1"  # scale: one H100, session 9 final: 2.447 against 2.543 ms a token (two engines each)


def mode() -> str:
    """TOKENMILL_INT4_NORM_FOLD: 0 (off), 1 / scale, prologue, row (module docstring)."""
    value = os.environ.get(ENV_VAR, DEFAULT)
    if value not in MODES:
        raise ValueError(f"{ENV_VAR}={value!r}: expected one of {sorted(MODES)}")
    return MODES[value]


def enabled() -> bool:
    return mode() != "off"


def partial_sums() -> bool:
    """Whether the adds hand the next norm their partial sums of squares (`mma_gemv`'s sumsq)."""
    return mode() != "row"


class Carry(NamedTuple):
    """What an add hands the next norm: the new stream's partial sums of squares, and in scale mode
    y = stream * that norm's weight (None where no norm follows on this stage)."""

    sumsq: torch.Tensor | None
    y: torch.Tensor | None
    norm: nn.Module | None


def _mma_int4(linear: nn.Module) -> bool:
    from tokenmill.layers.quantization.int4 import Int4LinearMethod

    return (isinstance(getattr(linear, "quant_method", None), Int4LinearMethod) and linear.bias is None
            and linear.__dict__.get("lora") is None and getattr(linear, "qweight", None) is not None
            and linear.qweight.dim() == 4 and linear.qweight.is_cuda and linear.stream_counters is not None)


def layer_fits(layer: nn.Module) -> bool:
    """Whether a `LlamaDecoderLayer` (plain: its own forwards, checked by the caller) can run folded:
    every condition but the step's rows (module docstring)."""
    from tokenmill.layers.activation import SiluAndMul
    from tokenmill.layers.norm import RMSNorm
    from tokenmill.layers.quantization import triton_int4_mma as mma

    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attn is None or mlp is None or not enabled():
        return False
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if not (all(_mma_int4(m) for m in linears) and all(type(n) is RMSNorm and not n.fp8_out for n in norms)
            and not attn.qk_norm and attn.o_proj.parallel.tp_size == 1
            and getattr(mlp.gate_up_proj, "pair_order", None) is not None
            and type(mlp.act) is SiluAndMul and not mlp.act.fp8_defer):
        return False
    # the add runs in the split-K epilogue; in scale mode, the rstd too (and bf16: y = stream * weight
    # is not normalized, fp16 could overflow)
    split_k = (attn.o_proj, mlp.down_proj) + ((attn.qkv_proj, mlp.gate_up_proj) if mode() == "scale" else ())
    if mode() == "scale" and attn.qkv_proj.scales.dtype != torch.bfloat16:
        return False
    for lin in split_k:
        n, k = lin.qweight.shape[0] * 16, lin.qweight.shape[1] * 64
        if mma.config_for(n, k, _group(lin, k)).split == 1:
            return False
    w = attn.qkv_proj.qweight
    return selftest(w.device, attn.qkv_proj.scales.dtype)


def _group(linear: nn.Module, k: int) -> int:
    g = linear.quant_method.config.group_size
    return k if g == -1 else g


def _args(linear: nn.Module) -> tuple:
    return linear.qweight, linear.scales, linear.zeros, linear.quant_method.config.group_size


def input_gemv(linear: nn.Module, stream: torch.Tensor, norm: nn.Module, carry: Carry | None,
               silu: bool = False) -> torch.Tensor:
    """linear(norm(stream)) (silu: SiLU-and-mul of it, the paired gate_up) as the mode does it, from
    what the add before it handed on (`carry`, None: nothing, as for the first layer)."""
    from tokenmill.layers.quantization import triton_int4_mma as mma

    counters = linear.stream_counters.tensor
    if mode() != "scale":  # the norm in the GEMV's prologue
        sumsq = carry.sumsq if carry is not None else None
        return mma.mma_gemv(stream, *_args(linear), counters=counters, silu=silu, norm=(norm.weight, norm.eps),
                            sumsq=sumsq)
    if carry is not None and carry.y is not None and carry.norm is norm:  # rstd after the GEMV of y
        return mma.mma_gemv(carry.y, *_args(linear), counters=counters, silu=silu, rstd_of=(carry.sumsq, norm.eps))
    from tokenmill.layers.triton_ops.rms_norm import rms_norm

    return mma.mma_gemv(rms_norm(stream, norm.weight, norm.eps, linear.scales.dtype), *_args(linear),
                        counters=counters, silu=silu)


def add_gemv(linear: nn.Module, x: torch.Tensor, stream: torch.Tensor, next_norm: nn.Module | None) -> Carry:
    """stream += linear(x), in place (the split-K epilogue); returns what the next norm (`next_norm`,
    None: none on this stage) gets: the new stream's partial sums of squares, and in scale mode
    y = stream * its weight."""
    from tokenmill.layers.quantization import triton_int4_mma as mma

    qweight, scales, zeros, group = _args(linear)
    n, k = qweight.shape[0] * 16, qweight.shape[1] * 64
    sumsq = (torch.empty((x.shape[0], mma.sumsq_parts(n, k, k if group == -1 else group)), dtype=torch.float32,
                         device=x.device) if partial_sums() else None)
    y = (torch.empty((x.shape[0], n), dtype=scales.dtype, device=x.device)
         if mode() == "scale" and next_norm is not None else None)
    mma.mma_gemv(x, qweight, scales, zeros, group, counters=linear.stream_counters.tensor, add_to=stream,
                 sumsq=sumsq, weighted=(y, next_norm.weight) if y is not None else None)
    return Carry(sumsq, y, next_norm if y is not None else None)


_CARRY = "_int4_fold_carry"  # the attribute of a stream tensor that holds its Carry between layers


def keep_carry(stream: torch.Tensor, carry: Carry) -> None:
    """Hand the next layer's first GEMV what the last add made (the layer returns the stream)."""
    setattr(stream, _CARRY, carry)


def take_carry(stream: torch.Tensor) -> Carry | None:
    """What `keep_carry` left on the stream, removed (valid only if nothing changed the stream since:
    callers take it only for a stream handed on as it was)."""
    return stream.__dict__.pop(_CARRY, None)


_SELFTEST: dict = {}


def selftest(device: torch.device, dtype: torch.dtype, shape: tuple[int, int, int] = (256, 1024, 128)) -> bool:
    """Once per device and dtype: NORM (the plain and the pipelined loop, with and without SiLU
    pairs), RES with its sums of squares and y, and RSTD on a small weight (`shape`: N, K, group;
    the CPU tests, under the interpreter, take a smaller one) against `rms_norm` + the GEMV and the
    GEMV + a float32 add, under PDL as the engine launches them. False (logged): layers run unfused."""
    key = (str(device), dtype)
    if key in _SELFTEST:
        return _SELFTEST[key]
    from tokenmill.layers.quantization import triton_int4_mma as mma
    from tokenmill.layers.triton_ops.rms_norm import rms_norm

    ok, why = False, ""
    try:
        g = torch.Generator(device=device).manual_seed(2)
        n, k, group = shape
        wt, qm, counters = packing.mma_selftest_weight(n, k, group, dtype, g)
        w = (torch.rand(k, device=device, generator=g) + 0.5).to(dtype)
        errs = []
        for m, c, silu in ((1, mma.MmaGemv(4, 2, hint=True, pipe=mma.PIPE_ENABLED), False),
                           (3, mma.MmaGemv(4, 4), True), (1, mma.MmaGemv(4, 1), False)):
            stream = torch.randn(m, k, device=device, generator=g) * 4
            ref = mma.mma_gemv(rms_norm(stream, w, 1e-5, dtype), qm, wt.scales, wt.zeros, group, c, counters, silu=silu)
            out = mma.mma_gemv(stream, qm, wt.scales, wt.zeros, group, c, counters, silu=silu, norm=(w, 1e-5))
            errs.append(((out.float() - ref.float()).norm() / ref.float().norm()).item())
        # the add into a stream of K channels (a [K, K] weight), then the norm from its sums of squares
        sq_w, sq_qm, _ = packing.mma_selftest_weight(k, k, group, dtype, g)
        x = torch.randn(2, k, device=device, generator=g).to(dtype)
        res = torch.randn(2, k, device=device, generator=g)
        c = mma.MmaGemv(4, 4)
        ref = res + mma.mma_gemv(x, sq_qm, sq_w.scales, sq_w.zeros, group, c, counters).float()
        sumsq = torch.empty((2, k // 64), dtype=torch.float32, device=device)
        mma.mma_gemv(x, sq_qm, sq_w.scales, sq_w.zeros, group, c, counters, add_to=res, sumsq=sumsq)
        errs.append(((res - ref).norm() / ref.norm()).item())
        errs.append(((sumsq.sum(1) - ref.square().sum(1)).norm() / ref.square().sum(1).norm()).item())
        ref = mma.mma_gemv(rms_norm(res, w, 1e-5, dtype), qm, wt.scales, wt.zeros, group, c, counters)
        out = mma.mma_gemv(res, qm, wt.scales, wt.zeros, group, c, counters, norm=(w, 1e-5), sumsq=sumsq)
        errs.append(((out.float() - ref.float()).norm() / ref.float().norm()).item())
        # scale mode: the add writes y = stream * weight; the GEMV of y scales its rows by rstd
        y = torch.empty((2, k), dtype=dtype, device=device)
        mma.mma_gemv(x, sq_qm, sq_w.scales, sq_w.zeros, group, c, counters, add_to=res, sumsq=sumsq, weighted=(y, w))
        # (scale mode rounds the normalized input once where the norm kernel rounds it twice: its
        # outputs differ from the unfused ones by a bf16 rounding's size, ~2-6e-3 on an H100, and
        # are checked against a float32 reference; a missing or wrong rstd is off by far more)
        scaled = [((y.float() - res * w.float()).norm() / (res * w.float()).norm()).item()]
        normed32 = res * torch.rsqrt(res.square().mean(-1, keepdim=True) + 1e-5) * w.float()
        ref32 = normed32 @ packing.dequantize(wt, group, torch.float32)
        for c2, silu in ((mma.MmaGemv(4, 2, hint=True, pipe=mma.PIPE_ENABLED), True), (mma.MmaGemv(4, 8), False)):
            ref = ref32 if not silu else mma.mma_gemv(rms_norm(res, w, 1e-5, dtype), qm, wt.scales, wt.zeros, group, c2,
                                                      counters, silu=silu).float()
            out = mma.mma_gemv(y, qm, wt.scales, wt.zeros, group, c2, counters, silu=silu, rstd_of=(sumsq, 1e-5))
            scaled.append(((out.float() - ref).norm() / ref.norm()).item())
        ok = max(errs) < 5e-3 and max(scaled) < 2e-2 and not counters.any()
        errs += scaled
        why = f"relative errors {', '.join(f'{e:.1e}' for e in errs)}"
    except Exception as e:  # noqa: BLE001 - a compile or launch failure: fall back, loudly
        why = f"{type(e).__name__}: {str(e)[:500]}"
    if not ok:
        logger.warning("int4: the GEMVs' folded norm / residual add failed their self-test on %s (%s); layers "
                       "run their norms apart", device, why)
    _SELFTEST[key] = ok
    return ok
