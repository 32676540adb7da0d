"""FP8 (e4m3) quantization in torch: the references the Triton kernels are tested against, the
online quantizers, and the CPU path (which dequantizes and runs the float matmul).

Conventions: a quantized tensor q and its float32 scale s stand for q * s (scales multiply, as
`torch._scaled_mm` wants; a checkpoint's `weight_scale_inv` is the same number under another name).
Rounding saturates at +-448 (e4m3's largest finite value) instead of overflowing to NaN.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
_MIN_SCALE = 1e-12  # an all-zero row gets this scale, never 0 (no division by zero)


def to_fp8(x: torch.Tensor) -> torch.Tensor:
    """Saturating round to e4m3 (explicit, whatever the cast does past the range)."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per row (per output channel of a weight, per token of an activation):
    (fp8 [.., K], float32 scales [.., 1])."""
    wf = w.float()
    scale = (wf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=_MIN_SCALE)
    return to_fp8(wf / scale), scale


# Online weight scales: per output channel, the shrink of amax / 448 (of these) that minimises the
# row's squared rounding error. Clipping a few outliers buys resolution for every other weight; on
# SmolLM2-135M this moves the W8A8 NLL from +2.4% (amax scales) to +0.1% of float32's. It is the
# "mse" observer of llm-compressor, applied at load.
WEIGHT_SHRINKS = tuple(round(0.8 + 0.005 * i, 3) for i in range(41))  # 0.800 .. 1.000


def quantize_weight_rows(w: torch.Tensor, shrinks: tuple[float, ...] = WEIGHT_SHRINKS,
                         rows_per_chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel fp8 weights with MSE-chosen scales: (fp8 [N, K], float32 scales [N, 1]).
    Rows go in chunks so the float32 temporaries stay small for the largest weights."""
    qs, ss = [], []
    for chunk in w.split(rows_per_chunk):
        wf = chunk.float()
        amax = wf.abs().amax(dim=-1, keepdim=True).clamp(min=_MIN_SCALE * FP8_MAX)
        best_scale, best_err = None, None
        for shrink in shrinks:
            scale = amax * (shrink / FP8_MAX)
            err = (to_fp8(wf / scale).float() * scale - wf).square().sum(dim=-1, keepdim=True)
            if best_err is None:
                best_scale, best_err = scale, err
            else:
                better = err < best_err
                best_scale, best_err = torch.where(better, scale, best_scale), torch.minimum(err, best_err)
        qs.append(to_fp8(wf / best_scale))
        ss.append(best_scale)
    return torch.cat(qs), torch.cat(ss)


def quantize_row_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per `group` consecutive columns of each row (block-wise activations):
    (fp8 [M, K], float32 scales [M, K // group])."""
    m, k = x.shape
    xg = x.float().view(m, k // group, group)
    scale = (xg.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=_MIN_SCALE)
    return to_fp8(xg / scale).view(m, k), scale.view(m, k // group)


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per [bn, bk] tile of a weight [N, K] (edge tiles may be partial):
    (fp8 [N, K], float32 scales [ceil(N / bn), ceil(K / bk)])."""
    bn, bk = block
    n, k = w.shape
    pn, pk = -(-n // bn) * bn, -(-k // bk) * bk
    padded = torch.zeros(pn, pk, dtype=torch.float32, device=w.device)
    padded[:n, :k] = w.float()
    tiles = padded.view(pn // bn, bn, pk // bk, bk)
    scale = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=_MIN_SCALE)
    q = to_fp8(tiles / scale[:, None, :, None]).view(pn, pk)[:n, :k].contiguous()
    return q, scale


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    bn, bk = block
    n, k = q.shape
    full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (q.float() * full).to(dtype)


def fake_quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """x rounded the way per-token dynamic fp8 rounds it, back in x's dtype (CPU emulation)."""
    q, s = quantize_rows(x)
    return (q.float() * s).to(x.dtype)


def fake_quantize_row_groups(x: torch.Tensor, group: int) -> torch.Tensor:
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    q, s = quantize_row_groups(x2, group)
    return (q.float() * s.repeat_interleave(group, 1)).to(x.dtype).view(shape)


_CODES_ATTR = "_fp8_rows"


def attach(out: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Give `out` its per-token fp8 codes and scales (computed by the kernel that wrote it), for the
    W8A8 linear it feeds (`triton_fp8_fused`). Only this tensor object carries them: a view or a
    copy does not, so a consumer never takes codes of anything but exactly these values."""
    setattr(out, _CODES_ATTR, (q, scale))
    return out


def attached(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(codes [M, K], scales [M, 1]) attached to exactly this tensor, else None."""
    return getattr(x, _CODES_ATTR, None)


def scaled_mm_reference(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                        out_dtype: torch.dtype) -> torch.Tensor:
    """(xq * x_scale) @ (wq * w_scale).T in float32: x_scale [M, 1], w_scale [N, 1]."""
    return ((xq.float() * x_scale) @ (wq.float() * w_scale).t()).to(out_dtype)


def block_mm_reference(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                       block: tuple[int, int], out_dtype: torch.dtype) -> torch.Tensor:
    """Block-wise W8A8: x_scale [M, K / bk] per token group, w_scale [N / bn, K / bk] per tile."""
    x = xq.float() * x_scale.repeat_interleave(block[1], 1)[:, :xq.shape[1]]
    return (x @ dequantize_blocks(wq, w_scale, block).t()).to(out_dtype)
