"""INT4 decode at up to 8 rows: a Llama layer's RMSNorms and residual adds folded into its GEMVs.

Why: at batch 1 each norm is a kernel of its own between two GEMVs (~1.8 us a step each on an
H100 under PDL, 64 a step: ~115 us of a 2.6 ms token), mostly the chain's latency, not its bytes.
Here the layer runs four launches where it ran six (plus attention):
- o_proj and down_proj (split-K launches) add their result into the float32 residual stream in
  their epilogue (`mma_gemv(add_to=stream)`: the result rounded to the activation dtype, then
  added in float32, as the fused add + norm kernel did);
- qkv_proj and gate_up_proj read the stream itself: each CTA computes the row's rms and writes
  the normalized slice of K it reads (`mma_gemv(norm=...)`, the kernel's NORM), with
  `triton_ops.rms_norm`'s roundings. The rms comes from partial sums of squares that the add
  before it wrote (one per channel block: 32-64 floats a row, summed in a fixed order), or, for
  the first layer (TOKENMILL_INT4_NORM_FOLD=row: every layer), from a pass over the row. The layer returns (stream, None): the stream form
  `LlamaDecoderLayer` already hands on where adds run in matmuls.
Values: those of the unfused path up to the float32 summation order of the rms (the adds: bit
for bit; `tests/layers/test_int4_norm_fold.py`).

Where: CUDA, <= 8 rows, every linear of the layer INT4 in the mma layout without bias or LoRA,
gate_up paired (`int4.pair_gate_up`), o_proj and down_proj split-K, no TP, plain `RMSNorm`s,
no q/k norm; the device self-test passed (`selftest`). TOKENMILL_INT4_NORM_FOLD=0: off, =row: no
partial sums (A/B runs).
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from tokenmill.layers.quantization import int4_packing as packing

logger = logging.getLogger(__name__)

ENV_VAR = "TOKENMILL_INT4_NORM_FOLD"


def enabled() -> bool:
    return os.environ.get(ENV_VAR, "1") != "0"


def partial_sums() -> bool:
    """Whether the adds hand the next norm their partial sums of squares (`mma_gemv`'s sumsq: the
    norm reads 32-64 floats a row, not the row); TOKENMILL_INT4_NORM_FOLD=row: each norm's CTAs
    make a pass over the whole row instead (A/B runs)."""
    return os.environ.get(ENV_VAR, "1") != "row"


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
    for lin in (attn.o_proj, mlp.down_proj):  # the add runs in the split-K epilogue
        n, k = lin.qweight.shape[0] * 16, lin.qweight.shape[1] * 64
        if mma.config_for(n, k, _group(lin, k)).split == 1:
            return False
    w = attn.qkv_proj.qweight
    return selftest(w.device, attn.qkv_proj.scales.dtype)


def _group(linear: nn.Module, k: int) -> int:
    g = linear.quant_method.config.group_size
    return k if g == -1 else g


def normed_gemv(linear: nn.Module, stream: torch.Tensor, norm: nn.Module, sumsq: torch.Tensor | None,
                silu: bool = False) -> torch.Tensor:
    """linear(norm(stream)) (silu: SiLU-and-mul of it, the paired gate_up) in one launch; `sumsq`:
    the stream's partial sums of squares from the add that last changed it (`add_gemv`), or None."""
    from tokenmill.layers.quantization import triton_int4_mma as mma

    return mma.mma_gemv(stream, linear.qweight, linear.scales, linear.zeros, linear.quant_method.config.group_size,
                        counters=linear.stream_counters.tensor, silu=silu, norm=(norm.weight, norm.eps), sumsq=sumsq)


def add_gemv(linear: nn.Module, x: torch.Tensor, stream: torch.Tensor) -> torch.Tensor | None:
    """stream += linear(x), in place (the split-K epilogue); returns the new stream's partial sums
    of squares for the next norm (`partial_sums`), or None."""
    from tokenmill.layers.quantization import triton_int4_mma as mma

    group = linear.quant_method.config.group_size
    n, k = linear.qweight.shape[0] * 16, linear.qweight.shape[1] * 64
    sumsq = (torch.empty((x.shape[0], mma.sumsq_parts(n, k, k if group == -1 else group)), dtype=torch.float32,
                         device=x.device) if partial_sums() else None)
    mma.mma_gemv(x, linear.qweight, linear.scales, linear.zeros, group, counters=linear.stream_counters.tensor,
                 add_to=stream, sumsq=sumsq)
    return sumsq


_SUMSQ = "_int4_fold_sumsq"  # the attribute of a stream tensor that holds its sums of squares between layers


def keep_sumsq(stream: torch.Tensor, sumsq: torch.Tensor | None) -> None:
    """Hand the next layer's folded norm the stream's sums of squares (the layer returns the stream)."""
    setattr(stream, _SUMSQ, sumsq)


def take_sumsq(stream: torch.Tensor) -> torch.Tensor | None:
    """What `keep_sumsq` left on the stream, removed (valid only if nothing changed the stream since:
    callers take it only for a stream handed on as it was)."""
    return stream.__dict__.pop(_SUMSQ, None)


_SELFTEST: dict = {}


def selftest(device: torch.device, dtype: torch.dtype) -> bool:
    """Once per device and dtype: NORM (the plain and the pipelined loop, with and without SiLU
    pairs) and RES on a small weight against `rms_norm` + the GEMV and the GEMV + a float32 add,
    under PDL as the engine launches them. False (logged): layers run unfused."""
    key = (str(device), dtype)
    if key in _SELFTEST:
        return _SELFTEST[key]
    from tokenmill.layers.quantization import triton_int4_mma as mma
    from tokenmill.layers.triton_ops.rms_norm import rms_norm

    ok, why = False, ""
    try:
        g = torch.Generator(device=device).manual_seed(2)
        n, k, group = 256, 1024, 128
        codes = packing.quantize_int4(torch.randn(n, k, device=device, generator=g), group, sym=False)
        wt = packing.from_codes(codes, dtype, act_order=False)
        qm = packing.to_mma(wt.qweight)
        counters = torch.zeros(64, dtype=torch.int32, device=device)
        w = (torch.rand(k, device=device, generator=g) + 0.5).to(dtype)
        errs = []
        for m, c, silu in ((1, mma.MmaGemv(4, 2, hint=True, pipe=mma.PIPE_ENABLED), False),
                           (3, mma.MmaGemv(4, 4), True), (1, mma.MmaGemv(4, 1), False)):
            stream = torch.randn(m, k, device=device, generator=g) * 4
            ref = mma.mma_gemv(rms_norm(stream, w, 1e-5, dtype), qm, wt.scales, wt.zeros, group, c, counters, silu=silu)
            out = mma.mma_gemv(stream, qm, wt.scales, wt.zeros, group, c, counters, silu=silu, norm=(w, 1e-5))
            errs.append(((out.float() - ref.float()).norm() / ref.float().norm()).item())
        # the add into a stream of K channels (a [K, K] weight), then the norm from its sums of squares
        codes = packing.quantize_int4(torch.randn(k, k, device=device, generator=g), group, sym=False)
        sq_w = packing.from_codes(codes, dtype, act_order=False)
        sq_qm = packing.to_mma(sq_w.qweight)
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
        ok = max(errs) < 5e-3 and not counters.any()
        why = f"relative errors {', '.join(f'{e:.1e}' for e in errs)}"
    except Exception as e:  # noqa: BLE001 - a compile or launch failure: fall back, loudly
        why = f"{type(e).__name__}: {str(e)[:500]}"
    if not ok:
        logger.warning("int4: the GEMVs' folded norm / residual add failed their self-test on %s (%s); layers "
                       "run their norms apart", device, why)
    _SELFTEST[key] = ok
    return ok
