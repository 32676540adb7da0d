"""INT4 weight formats: round-to-nearest quantization, each checkpoint format's packing (to write
test checkpoints and dummy weights) and its conversion to the one layout the kernels read.

Every format stores affine 4-bit codes q in [0, 15] with a scale s and a zero point z per
(group of input channels, output channel): w = (q - z) * s.

- GPTQ: `qweight` int32 [K/8, N], eight input channels per word (channel 8r + i in bits 4i..4i+3);
  `qzeros` int32 [K/G, N/8], eight output channels per word, sequential; `scales` [K/G, N];
  `g_idx` int32 [K] (act-order: the group of each input channel, not k // G). Format v1
  ("gptq") stores z - 1 in qzeros, v2 stores z.
- AWQ (GEMM): `qweight` int32 [K, N/8] and `qzeros` int32 [K/G, N/8], eight output channels per
  word in the interleaved order: nibble i holds channel 8c + AWQ_ORDER[i]; `scales` [K/G, N].
- compressed-tensors pack-quantized: `weight_packed` int32 [N, K/8], eight input channels per
  word, sequential, codes stored as the signed value + 8; `weight_scale` [N, K/G];
  `weight_shape` [2] (N, K). Symmetric: z = 8; asymmetric: `weight_zero_point` int32 [N/8, K/G],
  the signed zero point + 8 packed along the output axis.

Kernel layout (`Int4Weights`): `qweight` int32 [K/8, N] packed as GPTQ's, `scales` and `zeros`
[G, N] in the activation dtype (z as a float), `g_idx` int32 [K] or None (then k // group).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds output channel 8c + AWQ_ORDER[i]


@dataclass
class Int4Codes:
    """A quantized weight in plain form: codes [N, K] (uint8 0..15), scales / zeros [N, G]
    (float32 / int64), g_idx [K] (int64) giving each input channel's group."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    g_idx: torch.Tensor


def quantize_int4(w: torch.Tensor, group_size: int, sym: bool, perm: torch.Tensor | None = None) -> Int4Codes:
    """Round-to-nearest int4 of w [N, K], per group of `group_size` input channels (-1: one group).
    `perm` (act-order): groups are formed over the input channels in that order, so g_idx is not
    k // G (GPTQ's desc_act)."""
    n, k = w.shape
    size = k if group_size == -1 else group_size
    dev = w.device
    order = torch.arange(k, device=dev) if perm is None else perm.to(dev)
    g_idx = torch.empty(k, dtype=torch.int64, device=dev)
    g_idx[order] = torch.arange(k, device=dev) // size
    groups = k // size
    wf = w.float()
    grouped = wf[:, order].view(n, groups, size)
    if sym:
        amax = grouped.abs().amax(dim=-1)
        scales = (2 * amax / 15).clamp(min=1e-8)
        zeros = torch.full((n, groups), 8, dtype=torch.int64, device=dev)
    else:
        lo, hi = grouped.amin(dim=-1).clamp(max=0), grouped.amax(dim=-1).clamp(min=0)
        scales = ((hi - lo) / 15).clamp(min=1e-8)
        zeros = torch.round(-lo / scales).clamp(0, 15).to(torch.int64)
    s_full, z_full = scales[:, g_idx], zeros[:, g_idx]
    codes = torch.clamp(torch.round(wf / s_full) + z_full, 0, 15).to(torch.uint8)
    return Int4Codes(codes, scales, zeros, g_idx)


def dequantize_codes(c: Int4Codes) -> torch.Tensor:
    """w [N, K] in float32."""
    return (c.codes.float() - c.zeros[:, c.g_idx].float()) * c.scales[:, c.g_idx]


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words in [0, 2^32) to int32 with the same bits."""
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def pack_along(values: torch.Tensor, dim: int, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """Eight 4-bit values along `dim` into one int32: nibble i holds value order[i] of the eight."""
    v = values.to(torch.int64).movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], v.shape[-1] // 8, 8)
    words = torch.zeros(v.shape[:-1], dtype=torch.int64, device=v.device)
    for i, j in enumerate(order):
        words |= v[..., j] << (4 * i)
    return _to_int32(words).movedim(-1, dim).contiguous()


def unpack_along(words: torch.Tensor, dim: int, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """The inverse of `pack_along`: int64 values, 8x longer along `dim`."""
    w = words.to(torch.int64).movedim(dim, -1)
    out = torch.empty(*w.shape, 8, dtype=torch.int64, device=w.device)
    for i, j in enumerate(order):
        out[..., j] = (w >> (4 * i)) & 0xF
    return out.reshape(*w.shape[:-1], w.shape[-1] * 8).movedim(-1, dim)


# ---------------------------------------------------------------- writers (test checkpoints, dummy weights)

def to_gptq(c: Int4Codes, zero_offset: int = 1, dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
    return {"qweight": pack_along(c.codes.t(), 0),
            "qzeros": pack_along((c.zeros - zero_offset).t() & 0xF, 1),
            "scales": c.scales.t().to(dtype).contiguous(),
            "g_idx": c.g_idx.to(torch.int32)}


def to_awq(c: Int4Codes, dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
    return {"qweight": pack_along(c.codes.t(), 1, AWQ_ORDER),
            "qzeros": pack_along(c.zeros.t(), 1, AWQ_ORDER),
            "scales": c.scales.t().to(dtype).contiguous()}


def to_compressed_tensors(c: Int4Codes, dtype: torch.dtype = torch.bfloat16, sym: bool = True
                          ) -> dict[str, torch.Tensor]:
    """The signed codes q - 8, stored + 8 (and the zero points likewise, when asymmetric)."""
    out = {"weight_packed": pack_along(c.codes, 1),
           "weight_scale": c.scales.to(dtype).contiguous(),
           "weight_shape": torch.tensor(list(c.codes.shape), dtype=torch.int64)}
    if not sym:
        out["weight_zero_point"] = pack_along(c.zeros, 0)
    return out


# ---------------------------------------------------------------- checkpoint tensors -> kernel layout

@dataclass
class Int4Weights:
    qweight: torch.Tensor  # int32 [K/8, N]
    scales: torch.Tensor  # [G, N]
    zeros: torch.Tensor  # [G, N], float zero points
    g_idx: torch.Tensor | None  # int32 [K], or None: k // group


def from_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, zero_offset: int,
              dtype: torch.dtype, g_idx: torch.Tensor | None = None) -> Int4Weights:
    zeros = (unpack_along(qzeros, 1) + zero_offset)[:, :scales.shape[1]]
    return Int4Weights(qweight.contiguous(), scales.to(dtype).contiguous(), zeros.to(dtype).contiguous(),
                       None if g_idx is None else g_idx.to(torch.int32).contiguous())


def from_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> Int4Weights:
    codes = unpack_along(qweight, 1, AWQ_ORDER)  # [K, N]
    zeros = unpack_along(qzeros, 1, AWQ_ORDER)
    return Int4Weights(pack_along(codes, 0), scales.to(dtype).contiguous(), zeros.to(dtype).contiguous(), None)


def from_compressed_tensors(weight_packed: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype,
                            weight_zero_point: torch.Tensor | None = None) -> Int4Weights:
    codes = unpack_along(weight_packed, 1)  # [N, K], signed value + 8
    scales = weight_scale.t().to(dtype).contiguous()
    if weight_zero_point is None:
        zeros = torch.full_like(scales, 8)
    else:
        zeros = unpack_along(weight_zero_point, 0)[:codes.shape[0]].t().to(dtype).contiguous()
    return Int4Weights(pack_along(codes.t(), 0), scales, zeros, None)


def from_codes(c: Int4Codes, dtype: torch.dtype, act_order: bool) -> Int4Weights:
    return Int4Weights(pack_along(c.codes.t(), 0), c.scales.t().to(dtype).contiguous(),
                       c.zeros.t().to(dtype).contiguous(), c.g_idx.to(torch.int32) if act_order else None)


def dequantize(wt: Int4Weights, group_size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The kernel layout (words or panels) back to w^T [K, N]: the torch reference of the kernels."""
    words = {3: from_panels, 4: from_mma}.get(wt.qweight.dim(), lambda q: q)(wt.qweight)
    codes = unpack_along(words, 0)  # [K, N]
    k = codes.shape[0]
    if wt.g_idx is not None:
        groups = wt.g_idx.long()
    else:
        groups = torch.arange(k, device=codes.device) // (k if group_size == -1 else group_size)
    return ((codes.to(torch.float32) - wt.zeros.float()[groups]) * wt.scales.float()[groups]).to(dtype)


def to_panels(qweight: torch.Tensor, panel: int) -> torch.Tensor:
    """The kernel layout's words [K/8, N] as panels [N / panel, K/8, panel]: the words of `panel`
    output channels over all of K contiguous (what `triton_int4_gemv` streams)."""
    k8, n = qweight.shape
    if n % panel:
        raise ValueError(f"int4 panels: {n} output channels are not a multiple of the panel width {panel}")
    return qweight.view(k8, n // panel, panel).permute(1, 0, 2).contiguous()


def from_panels(qpanels: torch.Tensor) -> torch.Tensor:
    """The inverse of `to_panels`: words [K/8, N]."""
    tiles, k8, panel = qpanels.shape
    return qpanels.permute(1, 0, 2).reshape(k8, tiles * panel).contiguous()


def gate_up_pairs(n: int) -> torch.Tensor:
    """The channel order of a [gate | up] weight of N = 2 I outputs (I a multiple of 8) in which
    the tensor-core GEMV computes silu(gate) * up in its epilogue (`triton_int4_mma`'s SILU): in
    each block of 16 channels, gate channels 8b .. 8b + 7 then up channels I + 8b .. I + 8b + 7, so
    one thread's two channels (g, g + 8) are one product's. Returns the natural channel at each
    position (int64 [N]); `argsort` of it puts a result back in natural order."""
    if n % 16:
        raise ValueError(f"gate_up_pairs: {n} channels are not a multiple of 16")
    pos = torch.arange(n)
    block, r = pos // 16, pos % 16
    return torch.where(r < 8, 8 * block + r, n // 2 + 8 * block + r - 8)


def to_mma(qweight: torch.Tensor) -> torch.Tensor:
    """The kernel layout's words [K/8, N] as the tensor-core GEMV's layout int32 [N/16, K/64, 32, 4]
    (`triton_int4_mma`): per block of 16 output channels and K step of 64 inputs, lane t (g = t // 4,
    j = t % 4) holds in word m the codes of channels g and g + 8 at inputs 64 s + 16 j + 4 m + (0..3);
    nibble n: channel g + 8 (n % 2), input offset 2 ((n % 4) // 2) + n // 4."""
    codes = unpack_along(qweight, 0)  # [K, N]
    k, n = codes.shape
    if k % 64 or n % 16:
        raise ValueError(f"int4 mma layout: {k} inputs must be a multiple of 64 and {n} outputs of 16")
    # k = 64 s + 16 j + 4 m + 2 a + b; n = 16 cb + 8 hi + g; nibble = hi + 2 a + 4 b
    v = codes.view(k // 64, 4, 4, 2, 2, n // 16, 2, 8)  # s, j, m, a, b, cb, hi, g
    v = v.permute(5, 0, 7, 1, 2, 4, 3, 6).reshape(n // 16, k // 64, 32, 4, 8)  # cb, s, (g, j), m, (b, a, hi)
    words = torch.zeros(v.shape[:-1], dtype=torch.int64, device=v.device)
    for nib in range(8):
        words |= v[..., nib] << (4 * nib)
    return _to_int32(words)


def from_mma(qm: torch.Tensor) -> torch.Tensor:
    """The inverse of `to_mma`: words [K/8, N]."""
    blocks, steps = qm.shape[:2]
    w = qm.to(torch.int64)
    nibs = torch.stack([(w >> (4 * nib)) & 0xF for nib in range(8)], dim=-1)  # cb, s, lane, m, nibble
    v = nibs.view(blocks, steps, 8, 4, 4, 2, 2, 2)  # cb, s, g, j, m, b, a, hi
    codes = v.permute(1, 3, 4, 6, 5, 0, 7, 2).reshape(steps * 64, blocks * 16)  # s, j, m, a, b, cb, hi, g
    return pack_along(codes, 0)


class MmaSelftestWeight(NamedTuple):
    """A random weight for a device self-test of the tensor-core kernels (`int4.mma_selftest`,
    `int4_norm_fold.selftest`): its `Int4Weights` (words [K/8, N]), the same words in the mma
    layout (`to_mma`) and zeroed split-K counters (the kernels leave them zero when they finish)."""

    wt: Int4Weights
    qm: torch.Tensor
    counters: torch.Tensor


def mma_selftest_weight(n: int, k: int, group: int, dtype: torch.dtype, generator: torch.Generator,
                        counters: int = 64) -> MmaSelftestWeight:
    """An asymmetric round-to-nearest INT4 weight of N x K standard normal values drawn from
    `generator` (on its device), scales and zeros in `dtype`, no act-order."""
    device = generator.device
    codes = quantize_int4(torch.randn(n, k, device=device, generator=generator), group, sym=False)
    wt = from_codes(codes, dtype, act_order=False)
    return MmaSelftestWeight(wt, to_mma(wt.qweight), torch.zeros(counters, dtype=torch.int32, device=device))
