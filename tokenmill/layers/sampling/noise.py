"""The sampler's random numbers: Exp(1) noise for the exponential race, uniforms for acceptance tests.

Seeded rows hash (seed, output position, token, stream) (seeded_noise.py), so what a seeded request
draws at an output position does not depend on the batch; unseeded rows draw from torch's generator
(fresh, independent numbers on every call, whatever the stream). A row's output position is its
slot's NUM_OUTPUTS plus the row's offset (speculative rows: offset j is the j-th token of the step).
Only what the plan needs is computed: a step without seeded slots never hashes.
"""

from __future__ import annotations

import torch

from tokenmill.layers.sampling.plan import SamplingPlan
from tokenmill.layers.sampling.seeded_noise import (NoiseStream, hashed_uniform, row_keys, seeded_exponential,
                                                    stream_positions)
from tokenmill.layers.sampling.slot_table import IntCol, RowParams

_TINY = torch.finfo(torch.float32).tiny


def output_positions(rows: RowParams, offsets: torch.Tensor | None,
                     stream: int | torch.Tensor = NoiseStream.MAIN) -> torch.Tensor:
    """int64 [N] (or [N, M] for offsets [N, M]): NUM_OUTPUTS + offsets, moved to `stream`'s keys."""
    positions = rows.i(IntCol.NUM_OUTPUTS)
    if offsets is not None:
        positions = (positions[:, None] if offsets.dim() == 2 else positions) + offsets
    return stream_positions(positions, stream)


def exponential_noise(like: torch.Tensor, rows: RowParams, plan: SamplingPlan, token_keys: torch.Tensor,
                      offsets: torch.Tensor | None = None, stream: int | torch.Tensor = NoiseStream.MAIN,
                      buffer: torch.Tensor | None = None) -> torch.Tensor:
    """Exp(1) noise, float32 of `like`'s shape [N, V]: hashed on seeded rows, torch's generator
    elsewhere. `buffer`: a free float32 [N, V] tensor the generator's noise may be written into."""
    if not plan.seeded:
        return _generator_exponential(like, buffer)
    keys = row_keys(rows.i(IntCol.SEED_KEY), output_positions(rows, offsets, stream))
    seeded = seeded_exponential(keys, token_keys)
    if not plan.unseeded:
        return seeded  # every non-seeded row of the step is greedy or scratch: any noise will do
    unseeded = _generator_exponential(like, buffer)
    return torch.where((rows.i(IntCol.SEEDED) != 0)[:, None], seeded, unseeded, out=seeded)


def uniform_noise(rows: RowParams, plan: SamplingPlan, token_keys: torch.Tensor, offsets: torch.Tensor,
                  tokens: torch.Tensor, stream: int | torch.Tensor) -> torch.Tensor:
    """float32 [N, M] uniforms in (0, 1), one per (row, offset): seeded rows hash (seed, position,
    tokens[i, j], stream); other rows draw from torch's generator. offsets, tokens: int64 [N, M]."""
    if not plan.seeded:
        return torch.rand(tokens.shape, device=tokens.device)
    keys = row_keys(rows.i(IntCol.SEED_KEY)[:, None], output_positions(rows, offsets, stream))
    seeded = hashed_uniform(keys, token_keys[tokens])
    if not plan.unseeded:
        return seeded
    unseeded = torch.rand(tokens.shape, device=tokens.device)
    return torch.where((rows.i(IntCol.SEEDED) != 0)[:, None], seeded, unseeded, out=seeded)


def _generator_exponential(like: torch.Tensor, buffer: torch.Tensor | None) -> torch.Tensor:
    noise = torch.empty_like(like, dtype=torch.float32) if buffer is None else buffer
    # E = 0 would turn a zero-probability token into 0/0.
    return noise.exponential_().clamp_min_(_TINY)
