"""Rotary position embedding, neox style (rotate_half over the two halves, as HF Llama does).

cos/sin are precomputed in float32 for every position up to `max_position` and gathered
per token; they are cast to the activation dtype before use, as HF does. On CUDA
(`triton_ops.enabled`) a Triton kernel rotates q and k in place and reads cos/sin by position
itself, so no per-step gather exists (`triton_ops.rotary`).

LongRoPE (`rope_type` "longrope", HF's "su") as HF transformers chooses its factors: HF rotates a
forward call with the long factors iff the call's length (its highest position + 1) exceeds
`original_max_position_embeddings`, so a prompt longer than that is rotated with the long factors
from position 0, and each token generated after it by its own position + 1. Here a token at
position p of a sequence uses the long factors iff max(p + 1, L) > original_max, where L is its
sequence's full prompt length (`AttentionMetadata.prompt_lens`): HF's unchunked prefill and
one-token decodes, whatever the chunking, and keys keep the factors they were written with.
Where the prompt length is unknown (None) the step's own per-sequence length stands in (HF's rule
for one call). The choice is a gather on the device: no host sync, so CUDA graphs capture it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tokenmill.config import RopeConfig
from tokenmill.layers import triton_ops

if TYPE_CHECKING:
    from tokenmill.layers.attention.metadata import AttentionMetadata


def compute_inv_freq(params: RopeConfig, rotary_dim: int, max_position: int) -> torch.Tensor:
    """float32 [rotary_dim // 2] inverse frequencies, scaled per `params.rope_type`."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    inv_freq = 1.0 / (params.theta ** exponents)
    if params.rope_type == "linear":
        return inv_freq / params.factor
    if params.rope_type == "llama3":
        return _llama3_scale(inv_freq, params, max_position)
    if params.rope_type == "yarn":
        return _yarn_scale(inv_freq, params, rotary_dim)
    return inv_freq


def _yarn_scale(inv_freq: torch.Tensor, p: RopeConfig, rotary_dim: int) -> torch.Tensor:
    """YaRN, as HF computes it: interpolated (divided by `factor`) below the ramp, extrapolated
    (kept) above it, blended linearly between the correction dims of beta_slow and beta_fast."""
    old_len = p.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return rotary_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(p.theta))

    low, high = correction_dim(p.beta_fast), correction_dim(p.beta_slow)
    if p.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    return inv_freq / p.factor * (1 - extrapolation) + inv_freq * extrapolation


def _angles(params: RopeConfig, rotary_dim: int, max_position: int) -> torch.Tensor:
    """float32 [rows, rotary_dim]: each position's rotation angles (both halves), one row per
    position; LongRoPE holds two tables, the short factors' rows then the long ones' (a token
    reads row position + max_position when it uses the long factors: `_table_rows`)."""
    positions = torch.arange(max_position, dtype=torch.float32)[:, None]
    if params.rope_type != "longrope":
        freqs = positions * compute_inv_freq(params, rotary_dim, max_position)[None, :]
        return torch.cat((freqs, freqs), dim=-1)
    short = positions * _longrope_inv_freq(params, params.short_factor, rotary_dim)[None, :]
    long = positions * _longrope_inv_freq(params, params.long_factor, rotary_dim)[None, :]
    freqs = torch.cat((short, long))
    return torch.cat((freqs, freqs), dim=-1)


def _longrope_inv_freq(params: RopeConfig, factors: tuple[float, ...], rotary_dim: int) -> torch.Tensor:
    if len(factors) != rotary_dim // 2:
        raise ValueError(f"rope_scaling: longrope factors have {len(factors)} entries, expected {rotary_dim // 2}")
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * params.theta ** exponents)


def _attention_factor(params: RopeConfig) -> float:
    """The scale HF applies to cos and sin (LongRoPE's and YaRN's attention factors; 1 elsewhere)."""
    if params.rope_type not in ("longrope", "yarn"):
        return 1.0
    if params.attention_factor is not None:
        return params.attention_factor
    if params.rope_type == "yarn":
        return _yarn_mscale(params)
    original = params.original_max_position_embeddings
    if params.factor <= 1.0 or not original:
        return 1.0
    return math.sqrt(1 + math.log(params.factor) / math.log(original))


def _yarn_mscale(p: RopeConfig) -> float:
    """YaRN's default attention factor (DeepSeek: mscale over mscale_all_dim), as HF derives it."""

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if p.mscale and p.mscale_all_dim:
        return mscale(p.factor, p.mscale) / mscale(p.factor, p.mscale_all_dim)
    return mscale(p.factor)


def _llama3_scale(inv_freq: torch.Tensor, p: RopeConfig, max_position: int) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, and the band between blended.
    old_len = p.original_max_position_embeddings or max_position
    low_freq_wavelen = old_len / p.low_freq_factor
    high_freq_wavelen = old_len / p.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / p.factor, inv_freq)
    smooth = (old_len / wavelen - p.low_freq_factor) / (p.high_freq_factor - p.low_freq_factor)
    smoothed = (1 - smooth) * scaled / p.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates the first cos.shape[-1] dims of each head of x ([T, heads, head_dim]); the rest pass.

    `x * cos + rotate_half(x) * sin`, written half by half into one new tensor (cos and sin
    repeat over the two halves), so no rotated copy of x is built.
    """
    rotary_dim = cos.shape[-1]
    half = rotary_dim // 2
    c, s = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., :half], x[..., half:rotary_dim]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    o1, o2 = out[..., :half], out[..., half:rotary_dim]
    torch.mul(x1, c, out=o1).addcmul_(x2, s, value=-1)
    torch.mul(x2, c, out=o2).addcmul_(x1, s)
    if rotary_dim < x.shape[-1]:
        out[..., rotary_dim:] = x[..., rotary_dim:]
    return out


@dataclasses.dataclass(frozen=True)
class RotaryStep:
    """One forward pass's rotary inputs, prepared once and used by every layer.

    Torch path: `cos`/`sin` gathered per token ([T, 1, rotary_dim], activation dtype) and
    `apply_rotary` building new tensors. Fused path (`cos` None): the kernel rotates in place,
    reading `cos_cache`/`sin_cache` at `positions`.
    """

    positions: torch.Tensor
    cos_cache: torch.Tensor
    sin_cache: torch.Tensor
    rotary_dim: int
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim] rotated (in place on the fused path, so use the result only)."""
        if self.cos is None:
            from tokenmill.layers.triton_ops.rotary import rotate_
            rotate_(x, None, self.positions, self.cos_cache, self.sin_cache, self.rotary_dim)
            return x
        return apply_rotary(x, self.cos, self.sin)

    def rotate_pair(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k rotated (one launch on the fused path, in place)."""
        if self.cos is None:
            from tokenmill.layers.triton_ops.rotary import rotate_
            rotate_(q, k, self.positions, self.cos_cache, self.sin_cache, self.rotary_dim)
            return q, k
        return apply_rotary(q, self.cos, self.sin), apply_rotary(k, self.cos, self.sin)


class RotaryEmbedding(nn.Module):
    """Holds the cos/sin caches; `prepare` makes a step's `RotaryStep` from the token positions."""

    def __init__(self, head_dim: int, max_position: int, params: RopeConfig) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = int(head_dim * params.partial_rotary_factor)
        self.max_position = max_position
        # LongRoPE: the long factors' rows follow the short ones' in the caches (see _table_rows).
        self.longrope_original = (params.original_max_position_embeddings or max_position
                                  if params.rope_type == "longrope" else None)
        # Built under the meta device (deferred init), the caches are computed on the host instead:
        # _apply below carries their values through to_empty().
        device = torch.get_default_device()
        with torch.device("cpu" if device.type == "meta" else device):
            emb = _angles(params, self.rotary_dim, max_position)
            scale = _attention_factor(params)
            self.register_buffer("cos_cache", emb.cos() * scale, persistent=False)
            self.register_buffer("sin_cache", emb.sin() * scale, persistent=False)

    def _apply(self, fn: Any, recurse: bool = True) -> "RotaryEmbedding":
        # The caches only ever change device: they stay float32 when the model is cast
        # (e.g. .to(bfloat16)) and keep their values through to_empty().
        cos, sin = self.cos_cache, self.sin_cache
        super()._apply(fn, recurse)
        device = self.cos_cache.device
        self.cos_cache, self.sin_cache = cos.to(device), sin.to(device)
        return self

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, 1, rotary_dim] cos and sin for `positions`, in `dtype`; computed once per step."""
        cos = self.cos_cache.index_select(0, positions).to(dtype).unsqueeze(1)
        sin = self.sin_cache.index_select(0, positions).to(dtype).unsqueeze(1)
        return cos, sin

    def _table_rows(self, positions: torch.Tensor, meta: AttentionMetadata | None) -> torch.Tensor:
        """LongRoPE: each token's row in the caches, position + max_position where it uses the
        long factors, i.e. where max(position + 1, its sequence's prompt length) > original_max."""
        lengths = positions + 1
        if meta is not None:
            qsl = meta.query_start_loc
            tokens = torch.arange(positions.shape[0], dtype=qsl.dtype, device=positions.device)
            seq = torch.searchsorted(qsl[1:], tokens, right=True).clamp_max(qsl.shape[0] - 2)
            per_seq = meta.seq_lens if meta.prompt_lens is None else meta.prompt_lens
            lengths = torch.maximum(lengths, per_seq.index_select(0, seq).to(positions.dtype))
        return torch.where(lengths > self.longrope_original, positions + self.max_position, positions)

    def prepare(self, positions: torch.Tensor, dtype: torch.dtype,
                meta: AttentionMetadata | None = None) -> RotaryStep:
        """The step's rotary inputs; gathers cos/sin only where the fused kernel does not run.
        `meta` gives LongRoPE its sequences' lengths (without it, each token's own position + 1)."""
        if self.longrope_original is not None:
            positions = self._table_rows(positions, meta)
        if triton_ops.enabled(positions):
            return RotaryStep(positions, self.cos_cache, self.sin_cache, self.rotary_dim)
        cos, sin = self.cos_sin(positions, dtype)
        return RotaryStep(positions, self.cos_cache, self.sin_cache, self.rotary_dim, cos, sin)
