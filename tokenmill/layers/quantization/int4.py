"""INT4 W4A16 linear method: GPTQ, AWQ and compressed-tensors pack-quantized checkpoints, loaded
in their own layouts (sharded under TP like the weight they stand for) and repacked after
loading into the one layout the kernel reads (`int4_packing.Int4Weights`).

CUDA: `triton_int4.int4_matmul` (one row: the panel GEMV of `triton_int4_gemv`, the weight
repacked into its panels at load; more rows: the streaming / tensor-core kernel of
`triton_int4_stream`; act-order weights: the per-channel-group kernel; large batches: dequantize,
then cuBLAS). Weights in the tensor-core GEMV's layout (the default on CUDA, `for_device`):
`triton_int4_mma.mma_matmul` (the GEMV up to 8 rows, the GEMMs of `triton_int4_dot_gemm` where
its measured table lists the rows, else dequantize + cuBLAS).
Elsewhere: the weight is dequantized for each call and the float matmul runs (correct, not fast).

Act-order (GPTQ desc_act) under row parallelism: each rank holds a slice of the input channels
whose groups are scattered, so it keeps every group's scales and zeros (`g_idx` says which).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.quantization import int4_kperm, stream_tiles
from tokenmill.layers.quantization import int4_packing as packing
from tokenmill.layers.quantization.base import LinearMethod, ParamLayout, new_param, replace_param
from tokenmill.quant_config import QuantConfig

logger = logging.getLogger(__name__)


def gemv_panel(n: int, k: int, group: int, sms: int = stream_tiles._DEFAULT_SMS) -> int:
    """The panel width the one-row GEMV reads for this shape: the prefetching GEMV's
    (`triton_int4_prefetch_gemv.TABLE`) where it lists the shape and the weight fits it, else the
    older GEMV's (`stream_tiles.gemv_config`); 0: no panels."""
    from tokenmill.layers.quantization import triton_int4_prefetch_gemv as prefetch

    c = prefetch.config_for(n, k, group)
    return c.panel if c is not None else stream_tiles.gemv_config(n, k, group, sms).panel


def mma_enabled() -> bool:
    """The tensor-core GEMV's layout on CUDA (`TOKENMILL_INT4_MMA=0`: the panels, for A/B runs)."""
    import os

    return os.environ.get("TOKENMILL_INT4_MMA", "1") != "0"


def silu_pairs_enabled() -> bool:
    """[gate | up] INT4 weights in the mma layout are kept in `int4_packing.gate_up_pairs` order, so
    that a few rows' GEMV writes silu(gate) * up itself (`Int4LinearMethod.apply_silu_mul`; one
    launch less per MLP). TOKENMILL_INT4_SILU_PAIRS=0: natural order (A/B runs)."""
    import os

    return os.environ.get("TOKENMILL_INT4_SILU_PAIRS", "1") != "0"


def pair_gate_up(wt: packing.Int4Weights) -> tuple[packing.Int4Weights, torch.Tensor]:
    """Weights in the mma layout with their channels in `gate_up_pairs` order, and the index that
    puts a result of them back in natural order."""
    order = packing.gate_up_pairs(wt.scales.shape[1]).to(wt.scales.device)
    q = packing.to_mma(packing.from_mma(wt.qweight)[:, order])
    return packing.Int4Weights(q, wt.scales[:, order].contiguous(), wt.zeros[:, order].contiguous(), None), \
        torch.argsort(order)


_SILU_SELFTEST: dict = {}


def silu_selftest(device: torch.device, dtype: torch.dtype) -> bool:
    """Once per device and dtype: the GEMV's SiLU-and-mul epilogue (one slice and split-K) on a
    small paired weight against silu(gate) * up of dequantize + matmul. False (logged): gate_up
    weights stay in natural order (the SiLU kernel after the GEMV)."""
    key = (str(device), dtype)
    if key not in _SILU_SELFTEST:
        from tokenmill.layers.quantization import triton_int4_mma as mma

        ok, why = False, ""
        try:
            g = torch.Generator(device=device).manual_seed(0)
            n, k, group = 256, 512, 128
            wt, qm, counters = packing.mma_selftest_weight(n, k, group, dtype, g)
            ref_w = packing.dequantize(wt, group, torch.float32)
            paired, _ = pair_gate_up(packing.Int4Weights(qm, wt.scales, wt.zeros, None))
            errs = []
            for m, c in ((1, mma.MmaGemv(4, 2)), (3, mma.MmaGemv(4, 1))):
                x = torch.randn(m, k, device=device, generator=g).to(dtype)
                out = mma.mma_gemv(x, paired.qweight, paired.scales, paired.zeros, group, c, counters, silu=True)
                r = x.float() @ ref_w
                ref = F.silu(r[:, :n // 2]) * r[:, n // 2:]
                errs.append(((out.float() - ref).norm() / ref.norm()).item())
            ok = max(errs) < 2e-2 and not counters.any()
            why = f"relative errors {', '.join(f'{e:.1e}' for e in errs)}"
        except Exception as e:  # noqa: BLE001 - a compile or launch failure: fall back, loudly
            why = f"{type(e).__name__}: {str(e)[:500]}"
        if not ok:
            logger.warning("int4: the GEMV's SiLU-and-mul epilogue failed its self-test on %s (%s); gate_up "
                           "weights stay in natural order", device, why)
        _SILU_SELFTEST[key] = ok
    return _SILU_SELFTEST[key]


def _pipe_selftest(device: torch.device, dtype: torch.dtype) -> bool:
    """The pipelined loop (`MmaGemv.pipe`; inline PTX only on a GPU) at one row against dequantize +
    matmul, one slice and split-K; False (logged) where it fails."""
    from tokenmill.layers.quantization import triton_int4_mma as mma

    why = ""
    try:
        g = torch.Generator(device=device).manual_seed(1)
        n, k, group = 256, 1024, 128
        wt, qm, counters = packing.mma_selftest_weight(n, k, group, dtype, g)
        ref_w = packing.dequantize(wt, group, torch.float32)
        x = torch.randn(1, k, device=device, generator=g).to(dtype)
        ref = x.float() @ ref_w
        errs = [((mma.mma_gemv(x, qm, wt.scales, wt.zeros, group, mma.MmaGemv(4, s, hint=True, pipe=True), counters)
                  .float() - ref).norm() / ref.norm()).item() for s in (1, 2)]
        if max(errs) < 1e-2 and not counters.any():
            return True
        why = f"relative errors {', '.join(f'{e:.1e}' for e in errs)}"
    except Exception as e:  # noqa: BLE001 - a compile or launch failure: fall back, loudly
        why = f"{type(e).__name__}: {str(e)[:500]}"
    logger.warning("int4: the GEMV's pipelined loop failed its self-test on %s (%s); launches run without it",
                   device, why)
    return False


_SELFTEST: dict = {}


def mma_selftest(device: torch.device, dtype: torch.dtype) -> bool:
    """Once per device and dtype: the tensor-core GEMV (inline PTX: what this GPU and Triton
    compile and run) on a small random weight at 1, 5 and 12 rows, split-K included, against
    dequantize + matmul. False (logged): the engine keeps the panels and their GEMVs."""
    key = (str(device), dtype)
    if key not in _SELFTEST:
        from tokenmill.layers.quantization import triton_int4_mma as mma

        ok, why = False, ""
        try:
            g = torch.Generator(device=device).manual_seed(0)
            n, k, group = 256, 512, 128
            wt, qm, counters = packing.mma_selftest_weight(n, k, group, dtype, g)
            ref_w = packing.dequantize(wt, group, torch.float32)
            errs = []
            for m, c in ((1, mma.MmaGemv(4, 2)), (5, mma.MmaGemv(2, 1)), (12, None)):
                x = torch.randn(m, k, device=device, generator=g).to(dtype)
                out = (mma.mma_gemv(x, qm, wt.scales, wt.zeros, group, c, counters) if c is not None
                       else mma.mma_matmul(x, qm, wt.scales, wt.zeros, group, counters))
                ref = x.float() @ ref_w
                errs.append(((out.float() - ref).norm() / ref.norm()).item())
            ok = max(errs) < 1e-2 and not counters.any()
            why = f"relative errors {', '.join(f'{e:.1e}' for e in errs)}"
        except Exception as e:  # noqa: BLE001 - a compile or launch failure: fall back, loudly
            why = f"{type(e).__name__}: {str(e)[:500]}"
        if not ok:
            logger.warning("int4: the tensor-core GEMV failed its self-test on %s (%s); INT4 layers keep the "
                           "panel GEMVs", device, why)
        elif not _pipe_selftest(device, dtype):
            mma.PIPE_ENABLED = False
        _SELFTEST[key] = ok
    return _SELFTEST[key]


_GEMM_SELFTEST: dict = {}


def gemm_selftest(device: torch.device, dtype: torch.dtype) -> bool:
    """Once per device and dtype: every launch the INT4 GEMMs' tables list (`triton_int4_dot_gemm`,
    `int4_wsa_route`) on a small random weight against dequantize + matmul, at a row count filling its
    row tile and one that does not (the compiles the engine's warm-up needs anyway). False (logged): the
    GEMMs are switched off (`ENABLED`) and every row count above 8 takes the other paths."""
    key = (str(device), dtype)
    if key not in _GEMM_SELFTEST:
        from tokenmill.layers.quantization import int4_wsa_route as wsa
        from tokenmill.layers.quantization import triton_int4_dot_gemm as dot

        tiles = {t for t in dot.TABLE.values() if t is not None}
        ok, why = True, "no launches listed"
        try:
            g = torch.Generator(device=device).manual_seed(0)
            n, k, group = 256, 512, 128
            wt, qm, counters = packing.mma_selftest_weight(n, k, group, dtype, g, counters=256)
            ref_w = packing.dequantize(wt, group, torch.float32)
            errs = []
            for t in sorted(tiles, key=lambda t: t.label()):
                if isinstance(t, (dot.GluonTiles, dot.SwapTiles)) and dtype != torch.bfloat16:
                    continue  # the Gluon GEMMs serve bf16 only (`dot_tiles` skips them otherwise)
                for m in (t.block_m, t.block_m + 3):
                    x = torch.randn(m, k, device=device, generator=g).to(dtype)
                    ref = x.float() @ ref_w
                    errs.append(((dot.run(x, qm, wt.scales, wt.zeros, group, t, counters).float() - ref).norm()
                                 / ref.norm()).item())
            listed = {*wsa.TABLE.values(), *wsa.PREFILL.values()} if dtype == torch.bfloat16 else set()
            for t in sorted(listed, key=lambda t: t.label()):
                from tokenmill.layers.quantization.gluon_int4_swap_gemm import permute_x

                tiles.add(t)  # the warp-specialized swapped GEMM (bf16, x in the fragment's K order)
                for m in (t.bt, t.bt - 3):
                    x = torch.randn(m, k, device=device, generator=g).to(dtype)
                    errs.append(((wsa.run(permute_x(x), qm, wt.scales, wt.zeros, group, t, counters).float()
                                  - x.float() @ ref_w).norm() / (x.float() @ ref_w).norm()).item())
            if errs:
                ok = max(errs) < 1e-2 and not counters.any()
                why = f"worst relative error {max(errs):.1e} over {len(tiles)} launches"
        except Exception as e:  # noqa: BLE001 - a compile or launch failure: fall back, loudly
            ok, why = False, f"{type(e).__name__}: {str(e)[:500]}"
        if not ok:
            logger.warning("int4: the GEMM on the mma layout failed its self-test on %s (%s); more than 8 rows "
                           "take dequantize + cuBLAS", device, why)
            dot.ENABLED = wsa.ENABLED = False
        _GEMM_SELFTEST[key] = ok
    return _GEMM_SELFTEST[key]


def for_device(wt: packing.Int4Weights, group: int) -> packing.Int4Weights:
    """On CUDA, words of weights without act-order repacked for the small-batch kernels:
    16-bit activations, K a multiple of 64 and of a group of 64s, N of 16: the tensor-core GEMV's
    layout (`int4_packing.to_mma`; `triton_int4_mma.mma_matmul` serves every row count from it);
    if the GEMV passes its self-test there (`mma_selftest`); else groups of 16s: the panels of the CUDA-core GEMV (`int4_packing.to_panels`, the width
    from `gemv_panel`), which every other CUDA path of `triton_int4.int4_matmul` reads too.
    Elsewhere, unchanged."""
    q = wt.qweight
    if not q.is_cuda or wt.g_idx is not None or group % 16:
        return wt
    k, n = q.shape[0] * 8, q.shape[1]
    from tokenmill.layers.quantization.triton_int4_mma import layout_fits

    if (mma_enabled() and wt.scales.dtype in (torch.bfloat16, torch.float16) and layout_fits(n, k, group)
            and mma_selftest(q.device, wt.scales.dtype)):
        gemm_selftest(q.device, wt.scales.dtype)
        return packing.Int4Weights(packing.to_mma(q), wt.scales, wt.zeros, None)
    panel = gemv_panel(n, k, group, stream_tiles.sm_count(q.device))
    if not panel:
        return wt
    return packing.Int4Weights(packing.to_panels(q, panel), wt.scales, wt.zeros, None)


class Int4LinearMethod(LinearMethod):
    def __init__(self, config: QuantConfig, act_dtype: torch.dtype, row_parallel: bool) -> None:
        self.config = config
        self.act_dtype = act_dtype
        self.row_parallel = row_parallel
        # gptq without act-order: g_idx is k // G, and not read; compressed-tensors: the shape is known.
        self.ignored_suffixes = (("g_idx",) if config.fmt == "gptq" and not config.desc_act else ()) + \
            (("weight_shape",) if config.fmt == "compressed-tensors" else ())

    def _group(self, k: int) -> int:
        return k if self.config.group_size == -1 else self.config.group_size

    def create_weights(self, layer: nn.Module) -> None:
        c = self.config
        n, k = layer.out_features, layer.in_features
        group = self._group(k)
        if k % group or k % 8 or n % 8:
            raise ValueError(f"int4 ({c.fmt}): a linear of {k} inputs and {n} outputs does not fit group size "
                             f"{c.group_size} and 8-value packing (inputs must be a multiple of both, outputs of 8)")
        if c.online:
            return
        replace_param(layer, "weight", None)
        groups, group_div = k // group, group
        if c.desc_act and self.row_parallel:  # act-order scales stay whole: their groups are scattered over K
            full_k = layer.full_in_features
            groups, group_div = full_k // self._group(full_k), 0
        if c.fmt == "gptq":
            new_param(layer, "qweight", (k // 8, n), torch.int32, ParamLayout(1, 1, 0, 8))
            new_param(layer, "qzeros", (groups, n // 8), torch.int32, ParamLayout(1, 8, 0, group_div))
            new_param(layer, "scales", (groups, n), torch.float32, ParamLayout(1, 1, 0, group_div))
            if c.desc_act:
                new_param(layer, "g_idx", (k,), torch.int32, ParamLayout(None, 1, 0, 1))
        elif c.fmt == "awq":
            new_param(layer, "qweight", (k, n // 8), torch.int32, ParamLayout(1, 8, 0, 1))
            new_param(layer, "qzeros", (groups, n // 8), torch.int32, ParamLayout(1, 8, 0, group))
            new_param(layer, "scales", (groups, n), torch.float32, ParamLayout(1, 1, 0, group))
        else:
            new_param(layer, "weight_packed", (n, k // 8), torch.int32, ParamLayout(0, 1, 1, 8))
            new_param(layer, "weight_scale", (n, groups), torch.float32, ParamLayout(0, 1, 1, group))
            if not c.sym:  # zero points packed along the output axis (+8, like the codes)
                new_param(layer, "weight_zero_point", (n // 8, groups), torch.int32, ParamLayout(0, 8, 1, group))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        c, dtype = self.config, self.act_dtype
        if c.online:  # dummy weights of a quantized config: round to nearest into the same kernel layout
            codes = packing.quantize_int4(layer.weight.data, c.group_size, c.sym)
            wt = packing.from_codes(codes, dtype, act_order=False)
        elif c.fmt == "gptq":
            g_idx = layer.g_idx.data if c.desc_act else None
            wt = packing.from_gptq(layer.qweight.data, layer.qzeros.data, layer.scales.data, c.zero_offset, dtype,
                                   g_idx)
        elif c.fmt == "awq":
            wt = packing.from_awq(layer.qweight.data, layer.qzeros.data, layer.scales.data, dtype)
        else:
            zp = layer.weight_zero_point.data if not c.sym else None
            wt = packing.from_compressed_tensors(layer.weight_packed.data, layer.weight_scale.data, dtype, zp)
        for name in ("weight", "qweight", "qzeros", "scales", "g_idx", "weight_packed", "weight_scale",
                     "weight_zero_point"):
            if getattr(layer, name, None) is not None:
                replace_param(layer, name, None)
        wt = for_device(wt, self._group(layer.in_features))
        layer.pair_order = None  # natural order of a paired [gate | up] weight's results (`pair_gate_up`)
        if (wt.qweight.dim() == 4 and getattr(layer, "silu_halves", False) and layer.bias is None
                and silu_pairs_enabled() and silu_selftest(wt.qweight.device, wt.scales.dtype)):
            wt, layer.pair_order = pair_gate_up(wt)
        replace_param(layer, "qweight", wt.qweight)
        replace_param(layer, "scales", wt.scales)
        replace_param(layer, "zeros", wt.zeros)
        replace_param(layer, "g_idx", wt.g_idx)
        if wt.qweight.dim() == 4 and wt.qweight.is_cuda:  # the mma layout: the GEMMs' packed scales, made now
            from tokenmill.layers.quantization import triton_int4_dot_gemm as dot

            dot.keep_scale_offset(layer.scales, layer.zeros)
            from tokenmill.layers.quantization import int4_norm_fold

            if int4_norm_fold.enabled():  # (now, once per device: never inside a graph capture)
                int4_norm_fold.selftest(wt.qweight.device, wt.scales.dtype)
        # split-K counters of the small-batch kernel, allocated here: never inside a graph capture
        layer.stream_counters = (stream_tiles.SplitCounters(layer.out_features, wt.qweight.device)
                                 if wt.qweight.is_cuda else None)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        k = x.shape[-1]
        kperm = int4_kperm.marked(x)  # written by its producer in the swapped GEMM's K order
        if kperm and not (x.is_cuda and layer.qweight.dim() == 4):
            x, kperm = int4_kperm.unpermute(x), False
        if x.is_cuda:
            from tokenmill.layers.quantization.triton_int4 import int4_matmul

            out = int4_matmul(x.reshape(-1, k), layer.qweight, layer.scales, layer.zeros, layer.g_idx,
                              self.config.group_size, layer.stream_counters.tensor, x_kperm=kperm)
            if getattr(layer, "pair_order", None) is not None:  # a paired [gate | up] weight: natural order
                out = out.index_select(-1, layer.pair_order)
            if bias is not None:
                out = out + bias
            return out.view(*x.shape[:-1], out.shape[-1])
        wt = packing.Int4Weights(layer.qweight, layer.scales, layer.zeros, layer.g_idx)
        w = packing.dequantize(wt, self.config.group_size, x.dtype)  # [K, N]
        return F.linear(x, w.t(), bias)

    def apply_silu_mul(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, act: nn.Module
                       ) -> torch.Tensor:
        """act(x @ W^T + bias) for a [gate | up] layer whose act is SiLU-and-mul (`Linear.run_silu_mul`).
        A paired weight (`pair_gate_up`): up to 8 rows the GEMV writes the product itself (SILU);
        more rows, its GEMM's paired result goes through `silu_and_mul(paired=True)`. Else, act
        of `apply`. The same values as `act(apply(...))` either way."""
        from tokenmill.layers.activation import SiluAndMul

        order = getattr(layer, "pair_order", None)
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if order is None or bias is not None or type(act) is not SiluAndMul or act.fp8_defer or rows == 0:
            return act(self.apply(layer, x, bias))
        from tokenmill.layers.quantization import triton_int4_mma as mma
        from tokenmill.layers.triton_ops.silu_and_mul import silu_and_mul

        kperm = int4_kperm.marked(x)
        x2 = x.reshape(rows, x.shape[-1])
        args = (layer.qweight, layer.scales, layer.zeros, self.config.group_size)
        if rows <= mma.ROWS:
            out = mma.mma_gemv(int4_kperm.unpermute(x2) if kperm else x2, *args, counters=layer.stream_counters.tensor,
                               silu=True)
        else:  # the product in down_proj's swapped GEMM's K order where it takes these rows (`int4_kperm`)
            h = mma.mma_matmul(x2, *args, layer.stream_counters.tensor, x_kperm=kperm)
            out_kperm = h.dim() == 2 and act.int4_kperm(h)
            out = int4_kperm.mark(silu_and_mul(h, paired=True, kperm=out_kperm), out_kperm)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[-1])  # (a view drops the mark)

    def describe(self) -> str:
        return self.config.describe()
