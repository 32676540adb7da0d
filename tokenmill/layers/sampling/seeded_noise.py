"""Reproducible Exp(1) noise for seeded rows, from a counter-based hash: no generator objects.

The noise of token t at a seeded request's output position p is a pure function of
(seed, p, t), so a seeded request samples the same tokens alone or in any batch, at any slot,
across chunked prefill and preemption (p lives on the device: the slot's output count).

Construction (all integer values stay in [0, 2**32), every product is below 2**63, so the torch
int64 ops never overflow and right shifts of non-negative values are logical):

    mix32(x)       = the 32-bit "splitmix32" finalizer (constants from Wellons' hash-prospector):
                     x ^= x >> 16; x = x * 0x21F0AAAD mod 2**32; x ^= x >> 15;
                     x = x * 0x735A2D97 mod 2**32; x ^= x >> 15          (a bijection on 32 bits)
    seed_key(s)    = mix32(mix32((s >> 32) ^ SEED_SALT) ^ (s mod 2**32))  (on the host, once per add)
    row_key(k, p)  = mix32((k + (p mod 2**32) * POSITION_MULT) mod 2**32)    ([N] per step)
    token_key(t)   = mix32((t + TOKEN_SALT) mod 2**32)                        ([V], computed once)
    h              = mix32(row_key ^ token_key(t))                            ([N, V] per step)
    U              = ((h >> 9) + 0.5) / 2**23     in (0, 1), exactly representable in float32
    E              = -log(U)                      in [6e-8, 16.6], never 0

For a fixed seed, row keys of different positions differ (POSITION_MULT is odd), and mix32 is a
bijection, so within a request no two positions share a row key.

Streams (speculative decoding draws several independent quantities per output position): stream s
at position p uses the row key of position p + s * 2**30. Plain sampling is stream MAIN (s = 0, the
keys above, unchanged); a request's (position, stream) pairs get distinct row keys while p < 2**30.
"""

from __future__ import annotations

from enum import IntEnum

import torch

MASK32 = 0xFFFF_FFFF
MULT_1 = 0x21F0AAAD  # both multipliers < 2**31: x * MULT < 2**63 for x < 2**32
MULT_2 = 0x735A2D97
POSITION_MULT = 0x7FEB352D  # odd, < 2**31
SEED_SALT = 0x2545F491
TOKEN_SALT = 0x6A09E667
U_BITS = 23  # float32 holds (q + 0.5) exactly for q < 2**23
STREAM_STRIDE = 1 << 30  # position offset between streams (positions stay below it)


class NoiseStream(IntEnum):
    """What a random draw at an output position is for; each stream is independent of the others."""

    MAIN = 0  # plain sampling, one-hot verification, bonus tokens (and draft proposals: spec_verify.py)
    DRAFT = 1  # an independent stream for draft proposals
    ACCEPT = 2  # acceptance uniforms of rejection sampling
    RESIDUAL = 3  # the token drawn from max(p - q, 0) after a rejection


def mix32_int(x: int) -> int:
    """mix32 on a Python int in [0, 2**32): the host reference of `mix32_`."""
    x ^= x >> 16
    x = (x * MULT_1) & MASK32
    x ^= x >> 15
    x = (x * MULT_2) & MASK32
    return x ^ (x >> 15)


def mix32_(x: torch.Tensor) -> torch.Tensor:
    """mix32 in place on an int64 tensor with values in [0, 2**32)."""
    x.bitwise_xor_(x >> 16)
    x.mul_(MULT_1).bitwise_and_(MASK32)
    x.bitwise_xor_(x >> 15)
    x.mul_(MULT_2).bitwise_and_(MASK32)
    return x.bitwise_xor_(x >> 15)


def seed_key(seed: int) -> int:
    """Fold a seed in [0, 2**63) into a 32-bit key."""
    return mix32_int(mix32_int(((seed >> 32) & MASK32) ^ SEED_SALT) ^ (seed & MASK32))


def token_keys(vocab_size: int, device: torch.device) -> torch.Tensor:
    """int64 [V]: token_key(t) for every token."""
    return mix32_(torch.arange(vocab_size, dtype=torch.int64, device=device).add_(TOKEN_SALT))


def row_keys(seed_keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """int64 [N] from the rows' seed keys and output positions (both int64 [N])."""
    offset = (positions & MASK32).mul_(POSITION_MULT).bitwise_and_(MASK32)
    return mix32_(offset.add_(seed_keys).bitwise_and_(MASK32))


def stream_positions(positions: torch.Tensor, stream: int | torch.Tensor) -> torch.Tensor:
    """The positions whose row keys belong to `stream` (an int, or int64 per row): p + s * 2**30."""
    if isinstance(stream, int) and stream == NoiseStream.MAIN:
        return positions
    return positions + stream * STREAM_STRIDE


def hashed_uniform(rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """float32 U in (0, 1) from row keys and token keys of broadcastable shapes."""
    h = mix32_(rows ^ tokens)
    h >>= 32 - U_BITS
    return h.to(torch.float32).add_(0.5).mul_(2.0 ** -U_BITS)


def seeded_exponential(rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """float32 [N, V] Exp(1) noise from row keys [N] and token keys [V]."""
    return hashed_uniform(rows[:, None], tokens[None, :]).log_().neg_()
